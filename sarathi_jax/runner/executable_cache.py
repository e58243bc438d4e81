"""Compiled executables kept on disk between processes, so that a warm start neither traces nor lowers.

JAX's persistent compilation cache (sarathi_jax/runner/compile_cache.py) skips XLA's compile on a second start, but
its key is the lowered program: every bucket is still traced and lowered first, and on a CPU that is most of
a warm start (about half a second per bucket for the xla attention). `ExecutableCache` stores the compiled
executables themselves (`jax.experimental.serialize_executable`) under a key computed *without* tracing:

  * the environment: the jax, jaxlib and flax versions, the backend's platform and version, the devices,
    the XLA/JAX/SARATHI environment variables, the JAX configuration (every `jax_*` option except the cache
    and logging ones), and a hash of the source of every module of `sarathi_jax` and `pallas_kernels` (and
    their JSON files, such as the kernel's tuning table), so that a changed line of the model or kernel code
    is a miss;
  * the function: a name and a description of everything the traced function closes over (`describe`:
    the model's Flax fields, functions by module, name, defaults and closure, `functools.partial`s by their
    parts, dataclasses by their repr; anything whose repr carries a memory address cannot be described, and
    such a function is simply not cached);
  * the arguments: the tree structure and, per leaf, shape, dtype, and sharding when the leaf is committed.

A miss (or any error while reading an entry) falls back to the jitted function, which traces and compiles
(or loads from JAX's own cache) as before, and the result is written here for the next start. It lives in a
`sarathi-executables` folder inside the compilation cache directory and is used only when that cache is on
and the engine runs in one process. As with JAX's cache, entries are trusted: loading one runs its code.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import os
import pickle
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
from jax import monitoring

from pallas_kernels.greedy_head_cpu import engine_uses_kernel as greedy_head_usable
from pallas_kernels.panel_matmul_cpu import engine_uses_kernel
from sarathi_jax.runner.compile_cache import EXECUTABLE_LOAD_EVENT

SUBDIR = "sarathi-executables"
_FORMAT = 1
# Configuration options that cannot change a compiled program (where caches live, what gets logged).
_CONFIG_SKIP = ("cache", "log", "explain", "traceback", "debug_key_reuse")
_ENV_PREFIXES = ("XLA_", "JAX_", "SARATHI_", "TPU_", "LIBTPU_", "CUDA_VISIBLE", "NVIDIA_")
_ENV_SKIP = ("SARATHI_JAX_COMPILATION_CACHE", "JAX_COMPILATION_CACHE_DIR")


class Undescribable(Exception):
    """A value whose description would not be the same in another process (it shows a memory address)."""


def describe(value: Any, _depth: int = 0) -> str:
    """A text that identifies `value` across processes, or `Undescribable`."""
    if _depth > 12:
        raise Undescribable("nested too deeply")
    d = functools.partial(describe, _depth=_depth + 1)
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return repr(value)
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__}({', '.join(map(d, value))})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{d(k)}: {d(v)}" for k, v in sorted(value.items(), key=lambda kv: repr(kv[0]))) + "}"
    if isinstance(value, functools.partial):
        return f"partial({d(value.func)}, {d(value.args)}, {d(value.keywords)})"
    if callable(value) and hasattr(value, "__code__"):  # a Python function: its code is in the source hash
        cells = tuple(c.cell_contents for c in (value.__closure__ or ()))
        return (f"fn({value.__module__}.{value.__qualname__}, {d(value.__defaults__)}, {d(value.__kwdefaults__)}, "
                f"{d(cells)})")
    if _is_flax_module(value):
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value) if f.name not in ("parent", "name")}
        return f"{type(value).__module__}.{type(value).__qualname__}({d(fields)})"
    text = repr(value)
    if " at 0x" in text or "object at" in text:
        raise Undescribable(text[:80])
    return f"{type(value).__module__}.{type(value).__qualname__}:{text}"


def _is_flax_module(value: Any) -> bool:
    try:
        from flax import linen as nn
    except ImportError:  # pragma: no cover
        return False
    return isinstance(value, nn.Module)


def describe_args(args: Any) -> str:
    """Tree structure, and per leaf shape, dtype and (committed leaves) sharding: what a compiled program
    accepts."""
    leaves, treedef = jax.tree.flatten(args)
    parts = [str(treedef)]
    for leaf in leaves:
        shape, dtype = getattr(leaf, "shape", None), getattr(leaf, "dtype", None)
        if shape is None or dtype is None:
            raise Undescribable(f"argument leaf of type {type(leaf).__name__}")
        sharding = getattr(leaf, "sharding", None)
        committed = getattr(leaf, "committed", sharding is not None)
        parts.append(f"{tuple(shape)}:{dtype}:{describe(sharding) if committed and sharding is not None else '-'}")
    return "\n".join(parts)


@functools.lru_cache(maxsize=1)
def _source_hash() -> str:
    h = hashlib.sha256()
    for package in ("sarathi_jax", "pallas_kernels"):
        try:
            module = __import__(package)
        except ImportError:
            continue
        root = Path(module.__file__).parent
        # Source, and data read while tracing (the Pallas kernel's tuning table).
        for path in sorted([*root.rglob("*.py"), *root.rglob("*.json")]):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def environment_fingerprint() -> str:
    """Everything outside the function and its arguments that can change what a compile produces."""
    backend = jax.devices()[0].client
    config = {k: repr(getattr(jax.config, k)) for k in dir(jax.config)
              if k.startswith("jax_") and not any(s in k for s in _CONFIG_SKIP)}
    env = {k: v for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES) and k not in _ENV_SKIP}
    devices = [(d.id, d.platform, d.device_kind, d.process_index) for d in jax.devices()]
    return "\n".join([
        f"format {_FORMAT}", f"jax {jax.__version__}", f"jaxlib {_version('jaxlib')}", f"flax {_version('flax')}",
        f"backend {backend.platform} {backend.platform_version}", f"devices {devices}",
        f"process {jax.process_index()}/{jax.process_count()}", f"env {sorted(env.items())}",
        f"config {sorted(config.items())}", f"source {_source_hash()}",
        f"cpu matmul kernel {engine_uses_kernel()}",  # CPU projections' layout (models/out_major.py)
        f"cpu greedy head kernel {greedy_head_usable()}",  # into CPU samplers (parallel/stages.py)
    ])


class ExecutableCache:
    """Compiled executables in `directory`, keyed without tracing (see the module docstring).

    `load(key)` returns a callable `jax.stages.Compiled`, or None; `save(key, compiled)` writes one (quietly
    skipped when the executable cannot be serialized). `key(name, closure, args)` is None when the function
    cannot be described, and then nothing is cached for it. Thread-safe: entries are written atomically.
    """

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._environment = environment_fingerprint()
        self.hits = self.misses = self.writes = 0

    @classmethod
    def in_compilation_cache(cls, cache_dir: str | None) -> ExecutableCache | None:
        """The store inside JAX's compilation cache directory; None without one or in a multi-process run."""
        if cache_dir is None or jax.process_count() > 1:
            return None
        try:
            return cls(Path(cache_dir) / SUBDIR)
        except OSError:
            return None

    def key(self, name: str, closure: Any, args: Any) -> str | None:
        try:
            text = "\n".join([self._environment, name, describe(closure), describe_args(args)])
        except Undescribable:
            return None
        return f"{name}-{hashlib.sha256(text.encode()).hexdigest()}"

    def _path(self, key: str) -> Path:
        return self.directory / f"{key}.exe"

    def load(self, key: str | None, devices: Any = None) -> Callable | None:
        """The executable stored under `key`, loaded onto `devices` (default: the backend's), or None."""
        from jax.experimental.serialize_executable import deserialize_and_load

        if key is None:
            return None
        start = time.time()
        try:
            with open(self._path(key), "rb") as f:
                payload, in_tree, out_tree = pickle.load(f)
            compiled = deserialize_and_load(payload, in_tree, out_tree, execution_devices=devices)
        except Exception:  # absent, truncated, or from an incompatible build: compile instead
            self.misses += 1
            return None
        self.hits += 1
        monitoring.record_event_time_span(EXECUTABLE_LOAD_EVENT, start, time.time())
        return compiled

    def save(self, key: str | None, compiled: Any) -> None:
        from jax.experimental.serialize_executable import serialize

        if key is None:
            return
        try:
            data = pickle.dumps(serialize(compiled))
        except Exception:  # not serializable on this backend, or trees that do not pickle
            return
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, self._path(key))
            self.writes += 1
        except OSError:
            Path(tmp).unlink(missing_ok=True)
