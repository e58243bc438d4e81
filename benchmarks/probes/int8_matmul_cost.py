"""`python -m benchmarks.probes.int8_matmul_cost`: what an int8-weight (W8A16) projection costs on this CPU, by
the C++ int8 kernel and by what would serve without it, at a model's projection shapes and a step's rows.

A weight `w [N, K]` quantized per output column: `q = round(w / scale)` int8, `scale [N]` float32; the product
is `y [M, N] = (x [M, K] . q^T) * scale` with x float32. Forms, each jitted, timed round-robin in one process
(in a shuffled order each round):

  int8      `panel_matmul_int8_cpu(x, pack_panels(q), scale, N)`: the C++ kernel, int8 panels widened in registers
  f32       `panel_matmul_cpu(x, pack_panels(w), N)`: the float32 panel kernel on the unquantized weight
  xla f32   `x @ W`, `W [K, N]` float32: XLA's dot on the unquantized weight
  xla deq   `x @ q.astype(float32) * scale`, `q [K, N]` int8: XLA without the kernel (the widened weight is
            written out on every call before the dot reads it)

Each cell is the best of `--repeats` timed calls, in ms. The floors are the weight's bytes (int8 and scales;
float32) over the read bandwidth of a jitted reduction (`pallas_kernels.machine_rates`). A model's weights do
not stay in the cache between one layer's step and the next, so by default each form cycles through copies of
its weights, a fresh copy every call, as many as make `--cold-mbytes` MiB of int8 weights (more than a
last-level cache; 4x that of float32 ones); `--warm` times one copy, cache-resident where it fits (then a form
can beat its floor).
"""

from __future__ import annotations

import argparse
import itertools
import random
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.probes.layer_matmul_cost import format_table
from pallas_kernels.machine_rates import memory_bandwidth
from pallas_kernels.panel_matmul_cpu import (
    cpu_matmul_status, int8_matmul_status, pack_panels, panel_matmul_cpu, panel_matmul_int8_cpu, vector_bits,
)
from pallas_kernels.timing import seconds_per_call

HIGHEST = jax.lax.Precision.HIGHEST

# name -> {projection: (K, N)}: a hidden-1024 Llama (16 heads of 64, MLP 2816) and SmolLM2-135M (hidden 576).
SHAPES = {
    "1024": {"qkv": (1024, 3072), "o": (1024, 1024), "gate_up": (1024, 5632), "down": (2816, 1024)},
    "576": {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)},
}

FORMS = ("int8", "f32", "xla f32", "xla deq")


def quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`w [N, K]` -> (q int8 [N, K], scale float32 [N]): scale = max_k |w| / 127, q = round-half-even(w / scale)."""
    scale = np.abs(w).max(axis=1) / 127
    q = np.round(w / np.where(scale == 0, 1, scale)[:, None]).astype(np.int8)
    return q, scale.astype(np.float32)


def forms() -> dict[str, Callable[..., Any]]:
    """name -> jitted (x, *weights) -> y [M, N]."""
    return {
        "int8": jax.jit(panel_matmul_int8_cpu, static_argnums=3),
        "f32": jax.jit(panel_matmul_cpu, static_argnums=2),
        "xla f32": jax.jit(lambda x, w: jnp.dot(x, w, precision=HIGHEST)),
        "xla deq": jax.jit(lambda x, q, scale: jnp.dot(x, q.astype(jnp.float32), precision=HIGHEST) * scale),
    }


def weights(w: np.ndarray) -> dict[str, tuple[Any, ...]]:
    """name -> the weight arguments of that form, after x, for `w [N, K]`."""
    q, scale = quantize(w)
    n = w.shape[0]
    return {"int8": (pack_panels(jnp.asarray(q)), jnp.asarray(scale), n), "f32": (pack_panels(jnp.asarray(w)), n),
            "xla f32": (jnp.asarray(np.ascontiguousarray(w.T)),),
            "xla deq": (jnp.asarray(np.ascontiguousarray(q.T)), jnp.asarray(scale))}


def timed(calls: dict[Any, Callable[[], Any]], repeats: int, seed: int = 0) -> dict[Any, list[float]]:
    """Each call compiled and run once, then `repeats` rounds of one timed call each, in a new random order every
    round: no call always follows the same one (XLA's widening leaves megabytes of dirty cache lines behind)."""
    for call in calls.values():
        seconds_per_call(call)
    order, shuffle = list(calls), random.Random(seed).shuffle
    times: dict[Any, list[float]] = {key: [] for key in calls}
    for _ in range(repeats):
        shuffle(order)
        for key in order:
            times[key].append(seconds_per_call(calls[key]))
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="1024,576", help=f"comma-separated, of {sorted(SHAPES)}")
    parser.add_argument("--rows", default="1,4,16,64,256,512", help="comma-separated M")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--cold-mbytes", type=float, default=96, help="MiB of int8 weight copies to cycle through")
    parser.add_argument("--warm", action="store_true", help="one copy of each weight (cache-resident where it fits)")
    args = parser.parse_args(argv)
    rows = [int(m) for m in args.rows.split(",")]
    bandwidth = memory_bandwidth(256, 5).read_bytes_per_s
    print(f"device: {jax.devices()[0].device_kind}, CPU matmul library vector bits: {vector_bits()}, "
          f"read bandwidth (jitted reduction, best): {bandwidth / 1e9:.1f} GB/s, "
          f"weights {'warm (one copy)' if args.warm else f'cold ({args.cold_mbytes:g} MiB of int8 copies)'}")
    statuses = {"int8": int8_matmul_status(), "f32": cpu_matmul_status()}
    names = [f for f in FORMS if statuses.get(f) is None]
    for f in FORMS:
        if statuses.get(f) is not None:
            print(f"no {f} form: {statuses[f]}")
    header = ["case", *(f"{f} ms" for f in names), "floor int8 / f32 ms", *(
        ["int8 / f32", "int8 / xla deq"] if {"int8", "f32"} <= set(names) else [])]
    single = forms()
    rng = np.random.default_rng(0)
    table = []
    for model in args.models.split(","):
        for name, (k, n) in SHAPES[model].items():
            # Copies of one weight in fresh buffers, as many as make the int8 ones --cold-mbytes (float32: 4x that).
            copies = 1 if args.warm else max(1, int(np.ceil(args.cold_mbytes * 2**20 / (k * n))))
            first = weights(rng.standard_normal((n, k), dtype=np.float32))
            per_copy = [first] + [jax.tree.map(lambda a: a.copy() if isinstance(a, jax.Array) else a, first)
                                  for _ in range(copies - 1)]
            calls: dict[Any, Callable[[], Any]] = {}
            for m in rows:
                x = jnp.asarray(rng.standard_normal((m, k), dtype=np.float32))
                for f in names:
                    cycle = itertools.cycle([ws[f] for ws in per_copy])
                    calls[(m, f)] = lambda f=f, x=x, cycle=cycle: single[f](x, *next(cycle))
            times = timed(calls, args.repeats)
            floors = ((k * n + 4 * n) / bandwidth, k * n * 4 / bandwidth)
            for m in rows:
                best = {f: min(times[(m, f)]) for f in names}
                ratios = ([f"{best['int8'] / best['f32']:.2f}", f"{best['int8'] / best['xla deq']:.2f}"]
                          if {"int8", "f32"} <= set(names) else [])
                table.append([f"{model} {name} {m}x{k}x{n}", *(f"{best[f] * 1e3:.3f}" for f in names),
                              f"{floors[0] * 1e3:.3f} / {floors[1] * 1e3:.3f}", *ratios])
            del per_copy, calls
    print(format_table(header, table))


if __name__ == "__main__":
    main()
