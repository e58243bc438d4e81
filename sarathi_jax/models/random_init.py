"""Seeded random weights drawn on the device, straight into their shardings.

    params = init_random_params(config, jnp.bfloat16, seed=0)                       # the default device
    params = init_random_params(config, jnp.bfloat16, seed=0, shardings=shardings)  # e.g. NamedShardings (TP/PP)

Generic over any tree of shapes (`init_random_params` draws `checkpoint_param_shapes(config, dtype)`, the
checkpoint layout, then fuses it for the model: see `fusion.py`): the kind of a leaf comes from the last key of
its path only ("scale" -> ones, "bias" -> zeros, anything else -> normal * `INIT_STD`), so the same code serves
per-layer (`layers_{i}/...`) and stacked (`layers/...`, leading layer axis) trees, and every family.

**Values.** Element `i` (flat, row-major index) of a normal leaf is a pure function of the leaf's key and `i`:
threefry2x32 of the counter `(i >> 32, i & 0xffffffff)` under the key, the two output words xor-ed into 32
random bits, mapped to a normal as `jax.random.normal` does (uniform on (-1, 1), `sqrt(2) * erf_inv`), times
`INIT_STD`, in float32, then cast to the leaf's dtype (a bfloat16 leaf is the rounded float32 one). The leaf's
key (`leaf_key_data`) is a blake2b hash of the seed and the path string `"layers_0/self_attn/q_proj/kernel"`,
computed on the host (nothing to compile). So the values depend on the seed and the path only: not on the
sharding, the device count, the order of the tree, or which of the two drawing methods below made them.
Across platforms the random bits are identical; the float32 values can differ in the last few ulps (each
backend evaluates `erf_inv` its own way: 5% of the elements, at most 4 ulps, between an H100 and a CPU).

**Drawing on accelerators ("device").** One jitted function per `(kind, shape, dtype, sharding)`, cached here
(`draw_fn`; the shape is static, a repeated shape compiles once, the key is an argument), with `out_shardings`
the leaf's sharding: each device computes only its own shard (threefry is counter-based and JAX's
partitionable random bits, the default since JAX 0.5 and forced here, are laid out by flat index), and no
weight passes through the host. Threefry's compile time grows with the rank of the array, so each run of
unsharded dimensions is merged into the sharded (or first) dimension before it (a replicated leaf is drawn
flat) and the result reshaped: each shard stays local and the values are unchanged. The distinct draws
compile on a thread pool, concurrently. (mistral-7b in bfloat16 on one H100: ~1-2 s with 9 compiles.)

**Drawing on CPU ("host").** When every target device is a CPU of this process, the device already is the
host's memory and XLA's compile time is what costs (~0.2 s per distinct shape on a 2-core CPU, against ~0.15 s
for all of tiny-llama's numpy draws). There, one jitted function per dtype draws fixed-size chunks of `CHUNK`
consecutive elements at a given flat offset (one compile in all), on a thread pool; the chunks are assembled
in a numpy buffer and `device_put` into the leaf's sharding; scales and biases are plain numpy ones and zeros.
The elements are the same function of (key, flat index), hence the same values as the device method.

**PRNG: threefry.** `jax.random.key(..., impl="rbg")` and "unsafe_rbg" compiled at most a little faster per
shape on a 2-core CPU but drew about half as fast, are documented as not identical across backends, and
their sharded draws are not shard-local (every device materialises the whole array, then slices it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.random import threefry2x32_p
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from sarathi_jax.models.config import ModelConfig
from sarathi_jax.models.families import checkpoint_param_logical_axes, checkpoint_param_shapes
from sarathi_jax.models.fusion import fuse_projections
from sarathi_jax.models.layers import INIT_STD
from sarathi_jax.models.quantization import quantize_tree

PRNG_IMPL = "threefry2x32"
CHUNK = 1 << 20  # elements per chunk of the host method (a power of two: a chunk never straddles 2**32)
METHODS = ("auto", "device", "host")

# (kind, shape, dtype, sharding) -> jitted `key_data -> leaf` (device method); each entry compiles once.
_DRAW_FNS: dict[tuple[str, tuple[int, ...], Any, Any], Callable[[Any], jax.Array]] = {}
# (dtype, device) -> jitted `(key_data, counter_hi, counter_lo) -> dtype[CHUNK]` (host method).
_CHUNK_FNS: dict[tuple[Any, Any], Callable[..., jax.Array]] = {}


def leaf_kind(path: tuple[Any, ...]) -> str:
    """`"ones"` (a norm's "scale"), `"zeros"` (a "bias") or `"normal"`, from the last key of a leaf's path."""
    last = _key_name(path[-1]) if path else ""
    return {"scale": "ones", "bias": "zeros"}.get(last, "normal")


def path_string(path: tuple[Any, ...]) -> str:
    """`"layers_0/self_attn/q_proj/kernel"`: a spelling of a tree path that does not depend on JAX's reprs."""
    return "/".join(_key_name(k) for k in path)


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):  # DictKey / FlattenedIndexKey, GetAttrKey, SequenceKey
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def leaf_key_data(seed: int, path: tuple[Any, ...] | str) -> np.ndarray:
    """The raw threefry2x32 key (`uint32[2]`) of one leaf: a blake2b hash of the seed and the path (a tree path
    or its `path_string`). Stable across processes, platforms and Python versions (unlike `hash`); any int seed."""
    name = path if isinstance(path, str) else path_string(path)
    digest = hashlib.blake2b(f"{int(seed)}\0{name}".encode(), digest_size=8, person=b"sarathi-init").digest()
    return np.frombuffer(digest, dtype="<u4").astype(np.uint32)


def _normal_from_bits(bits: jax.Array) -> jax.Array:
    """`jax.random.normal`'s map from uint32 bits to a float32 standard normal (uniform on (-1, 1), erf_inv)."""
    floats = lax.bitcast_convert_type((bits >> np.uint32(9)) | np.uint32(0x3F800000), jnp.float32) - np.float32(1)
    lo = np.nextafter(np.float32(-1), np.float32(0))
    u = lax.max(lo, floats * (np.float32(1) - lo) + lo)
    return np.float32(np.sqrt(2)) * lax.erf_inv(u)


# -- device method ---------------------------------------------------------------------------------------------


def _shard_counts(shape: tuple[int, ...], sharding: Any) -> list[int] | None:
    """Per-dimension shard counts of a `NamedSharding`, or `None` if they cannot be read (other `Sharding`s)."""
    if not isinstance(sharding, NamedSharding):
        return None
    spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
    counts = []
    for entry in spec:
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        counts.append(math.prod(sharding.mesh.shape[a] for a in axes))
    return counts


def draw_layout(shape: tuple[int, ...], sharding: Any) -> tuple[tuple[int, ...], Any]:
    """`(draw_shape, draw_sharding)`: the lower-rank shape a leaf is drawn in before the reshape to `shape`
    (each run of unsharded dimensions merged into the dimension before it), and the sharding the draw is
    constrained to (`None`: left to XLA)."""
    shape = tuple(shape)
    if sharding is None or sharding.is_fully_replicated:
        return (math.prod(shape),), None
    counts = _shard_counts(shape, sharding)
    if counts is None or any(n % c for n, c in zip(shape, counts)):
        return shape, None  # an opaque or uneven sharding: draw in the leaf's own shape
    starts = [d for d in range(len(shape)) if d == 0 or counts[d] > 1]
    ends = starts[1:] + [len(shape)]
    draw_shape = tuple(math.prod(shape[a:b]) for a, b in zip(starts, ends))
    spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
    return draw_shape, NamedSharding(sharding.mesh, PartitionSpec(*(spec[d] for d in starts)))


def draw_fn(kind: str, shape: tuple[int, ...], dtype: Any, sharding: Any = None) -> Callable[[Any], jax.Array]:
    """The cached jitted `key_data -> array` of the device method for one leaf kind ("ones", "zeros" or
    "normal"), shape, dtype and sharding (`None`: the default device). The key is ignored by ones and zeros.
    Call it under `jax.threefry_partitionable(True)` (as `init_random_tree` does)."""
    shape, dtype = tuple(shape), jnp.dtype(dtype)
    cache_key = (kind, shape, dtype, sharding)
    fn = _DRAW_FNS.get(cache_key)
    if fn is not None:
        return fn
    if kind not in ("ones", "zeros", "normal"):
        raise ValueError(f"unknown leaf kind {kind!r}")
    draw_shape, draw_sharding = draw_layout(shape, sharding)

    def draw(key_data: jax.Array) -> jax.Array:
        if kind != "normal":
            return jnp.full(shape, 1 if kind == "ones" else 0, dtype)
        # Partitionable threefry: bits[i] = xor of threefry2x32(key, (i >> 32, i & 0xffffffff)), flat index i.
        bits = jax.random.bits(jax.random.wrap_key_data(key_data, impl=PRNG_IMPL), draw_shape, jnp.uint32)
        if draw_sharding is not None:
            bits = lax.with_sharding_constraint(bits, draw_sharding)
        return (_normal_from_bits(bits) * np.float32(INIT_STD)).astype(dtype).reshape(shape)

    fn = jax.jit(draw) if sharding is None else jax.jit(draw, out_shardings=sharding)
    _DRAW_FNS[cache_key] = fn
    return fn


# -- host method -----------------------------------------------------------------------------------------------


def chunk_fn(dtype: Any, device: Any) -> Callable[..., jax.Array]:
    """The cached jitted `(key_data, counter_hi, counter_lo) -> dtype[CHUNK]` of the host method: elements
    `counter_hi * 2**32 + counter_lo + [0, CHUNK)` of a leaf (`counter_lo` a multiple of `CHUNK`), on `device`."""
    dtype = jnp.dtype(dtype)
    fn = _CHUNK_FNS.get((dtype, device))
    if fn is None:

        def chunk(key_data: jax.Array, hi: jax.Array, lo: jax.Array) -> jax.Array:
            counter_lo = lo + lax.iota(jnp.uint32, CHUNK)
            bits1, bits2 = threefry2x32_p.bind(key_data[0], key_data[1], jnp.broadcast_to(hi, (CHUNK,)), counter_lo)
            return (_normal_from_bits(bits1 ^ bits2) * np.float32(INIT_STD)).astype(dtype)

        fn = _CHUNK_FNS[(dtype, device)] = jax.jit(chunk, out_shardings=SingleDeviceSharding(device))
    return fn


def host_draw(
    kind: str, shape: tuple[int, ...], dtype: Any, key_data: np.ndarray, pool: Executor | None = None
) -> np.ndarray:
    """One leaf as a numpy array, by the host method (see the module docstring). `pool`: threads to draw the
    chunks on (XLA runs executions from several threads at once: ~5x on 16 cores); default: this thread."""
    dtype = jnp.dtype(dtype)
    if kind == "ones":
        return np.ones(shape, dtype)
    if kind == "zeros":
        return np.zeros(shape, dtype)
    n = math.prod(shape)
    fn = chunk_fn(dtype, jax.devices("cpu")[0])
    out = np.empty(n, dtype)

    def fill(offset: int) -> None:
        chunk = fn(key_data, np.uint32(offset >> 32), np.uint32(offset & 0xFFFFFFFF))
        out[offset : offset + CHUNK] = np.asarray(chunk)[: min(CHUNK, n - offset)]

    offsets = range(0, n, CHUNK)
    if pool is None or len(offsets) == 1:
        for offset in offsets:
            fill(offset)
    else:
        for _ in pool.map(fill, offsets):  # re-raises a worker's exception
            pass
    return out.reshape(shape)


def _default_device() -> Any:
    device = jax.config.jax_default_device
    if isinstance(device, str):
        return jax.devices(device)[0]
    return device if device is not None else jax.devices()[0]


def _on_host_cpus(sharding: Any) -> bool:
    """Whether every device of `sharding` (`None`: the default device) is a CPU of this process."""
    if sharding is None:
        return _default_device().platform == "cpu"
    return sharding.is_fully_addressable and all(d.platform == "cpu" for d in sharding.device_set)


# -- public entry points ---------------------------------------------------------------------------------------


def cache_size() -> int:
    """Number of cached jitted draws (device method, plus the host method's one per dtype); each compiles once."""
    return len(_DRAW_FNS) + len(_CHUNK_FNS)


def clear_cache() -> None:
    """Drop the cached jitted draws (and with them their compiled executables)."""
    _DRAW_FNS.clear()
    _CHUNK_FNS.clear()


def init_random_tree(shapes: Any, seed: int = 0, shardings: Any = None, method: str = "auto") -> Any:
    """Random arrays for a tree of `jax.ShapeDtypeStruct`s (see the module docstring for the rules).

    `shardings`: `None` (the default device), one `jax.sharding.Sharding` for every leaf, or a tree with the
    same structure as `shapes` holding one `Sharding` (or `None`: the default device) per leaf.
    `method`: "device" (jitted draws into the shardings), "host" (chunked draws on the CPU, then placed) or
    "auto": "host" for a leaf whose devices are all CPUs of this process, else "device". Same values.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    leaves_with_paths, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    if shardings is None or isinstance(shardings, jax.sharding.Sharding):
        leaf_shardings = [shardings] * len(leaves_with_paths)
    else:
        leaf_shardings = treedef.flatten_up_to(shardings)
    out: list[Any] = [None] * len(leaves_with_paths)
    host, device = [], []  # (leaf index, kind, leaf, sharding, key data)
    for i, ((path, leaf), sharding) in enumerate(zip(leaves_with_paths, leaf_shardings)):
        kind = leaf_kind(path)
        key_data = leaf_key_data(seed, path) if kind == "normal" else np.zeros(2, np.uint32)
        on_host = method == "host" or (method == "auto" and _on_host_cpus(sharding))
        (host if on_host else device).append((i, kind, leaf, sharding, key_data))
    # Config contexts are thread-local: the workers re-enter the caller's default device.
    default_device = jax.config.jax_default_device

    def call(fn: Callable[[Any], jax.Array], key_data: np.ndarray) -> jax.Array:
        with jax.threefry_partitionable(True), jax.default_device(default_device):
            return fn(key_data)

    with ThreadPoolExecutor(max_workers=max(1, min(os.cpu_count() or 1, 16))) as pool:
        # Device method: the first call of each distinct draw compiles it; those run on threads, so the
        # compiles overlap (XLA releases the GIL); the other leaves then reuse the compiled draws.
        firsts, rest, seen = [], [], set()
        for i, kind, leaf, sharding, key_data in device:
            fn = draw_fn(kind, leaf.shape, leaf.dtype, sharding)
            (rest if fn in seen else firsts).append((i, fn, key_data))
            seen.add(fn)
        for (i, _, _), value in zip(firsts, pool.map(lambda item: call(item[1], item[2]), firsts)):
            out[i] = value
        for i, fn, key_data in rest:
            out[i] = call(fn, key_data)
        # Host method: leaf by leaf, each leaf's chunks on the threads.
        for i, kind, leaf, sharding, key_data in host:
            value = host_draw(kind, leaf.shape, leaf.dtype, key_data, pool)
            out[i] = jax.device_put(value) if sharding is None else jax.device_put(value, sharding)
    return jax.tree_util.tree_unflatten(treedef, out)


def init_random_params(
    config: ModelConfig, dtype: Any = jnp.float32, seed: int = 0, shardings: Any = None, kv_replication: int = 1
) -> Any:
    """Seeded random params for `config`, in the model's (serving) layout: normal (std `INIT_STD`) matrices,
    unit norm scales, zero biases, drawn on the device(s) in the checkpoint layout (so the values depend on
    `seed` and the checkpoint's param paths only, see the module docstring), then fused
    (`fusion.fuse_projections`, with `kv_replication`). `shardings`: optional tree of one `Sharding` per leaf of
    the checkpoint layout, e.g. `nn.logical_to_mesh_sharding(checkpoint_param_logical_axes(config), mesh, rules)`;
    each device then draws only its own shards, and a fused leaf follows its first part's sharding. With
    `config.quantization` the same float weights are drawn, then quantized (`quantization.quantize_tree`)."""
    if config.quantization is None:
        return fuse_projections(init_random_tree(checkpoint_param_shapes(config, jnp.dtype(dtype)), seed, shardings),
                                kv_replication)
    # Quantized: the float weights are drawn (the same values as the float model's), then quantized.
    float_config = dataclasses.replace(config, quantization=None)
    float_shapes = checkpoint_param_shapes(float_config, jnp.dtype(dtype))
    if shardings is not None:  # without the scales' entries
        shardings = jax.tree.map(lambda _, s: s, float_shapes, shardings)
    drawn = quantize_tree(init_random_tree(float_shapes, seed, shardings), checkpoint_param_logical_axes(config),
                          config.quantization)
    return fuse_projections(drawn, kv_replication)
