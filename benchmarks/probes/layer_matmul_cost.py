"""`python -m benchmarks.probes.layer_matmul_cost`: which formulation of a decode step's layer matmuls
`x [M, K] x W [K, N]` is fastest on this machine, at small M, for a model's projection shapes.

XLA:CPU hands a dot to YNNPACK, which packs the dot's right operand into its tile layout on every call (unless
it is a constant). The layers keep their weights `[in, out]` on the right, so at decode's M (1-64 rows) each
step may copy every weight before reading it. Formulations, each jitted, timed round-robin in one process:

  row          `x [M, K] @ W [K, N]` (the layers' formulation before out-major weights)
  left+T       `(Wt [N, K] @ x^T).T`: the weight stored out-major `[N, K]` (HF's layout), as the left operand,
               the result transposed back through an optimization barrier (without it XLA folds the
               transpose into the dot and emits `row` again)
  feature      `Wt [N, K] @ xt [K, M]`: activations kept feature-major, no transposes at all (a lower bound of
               the weight-left forms)

  kernel       `panel_matmul_cpu(x, pack_panels(Wt), N)`: the C++ matmul on weights packed once into column
               panels (`pallas_kernels/panel_matmul_cpu.py`; only where the kernel is built)

Why panels, not the weight read in place: a C++ kernel reading `W [K, N]` in place did not beat `left+T` on an
AVX2 machine over a scanned stack; one reading `Wt [N, K]` in place led it over the unrolled stack on an AVX-512
machine, and the panel kernel is level with it at 1-8 rows and faster at 24-64.

Two tables: one matmul per shape (weight passed as an argument), and a stack of `--layers` layers (qkv, o,
gate+up, down with their elementwise glue, no attention), unrolled over per-layer weights as the engine runs
them on a CPU, or with `--scan` a `lax.scan` over stacked weights (which adds the per-layer weight slice, a
copy). The floor is the weights' bytes over the read
bandwidth (a jitted reduction's, `pallas_kernels.machine_rates`). The median and the best of `--repeats`
timed calls are reported (on a shared machine the best is the least disturbed).

XLA flags are process-wide: to compare one, run this probe twice, with and without it in `XLA_FLAGS`.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.machine_rates import memory_bandwidth
from pallas_kernels.panel_matmul_cpu import cpu_matmul_status, pack_panels, panel_matmul_cpu
from pallas_kernels.timing import seconds_per_call

HIGHEST = jax.lax.Precision.HIGHEST

# name -> (hidden, intermediate, q heads, kv heads, head_dim, layers)
MODELS = {"60m": (512, 1408, 8, 8, 64, 8), "smollm2": (576, 1536, 9, 3, 64, 30)}


def projection_shapes(hidden: int, mlp: int, heads: int, kv_heads: int, head_dim: int) -> dict[str, tuple[int, int]]:
    """(K, N) of each fused layer matmul: qkv, o, gate+up, down."""
    return {"qkv": (hidden, (heads + 2 * kv_heads) * head_dim), "o": (heads * head_dim, hidden),
            "gate_up": (hidden, 2 * mlp), "down": (mlp, hidden)}


FORMS = ("row", "left+T", "feature", "kernel")


def left_t(x: jax.Array, wt: jax.Array) -> jax.Array:
    """`x [M, K] @ wt[N, K]^T` with the weight as the dot's left operand, `[M, N]`."""
    yt = jax.lax.dot_general(wt, x, (((1,), (1,)), ((), ())), precision=HIGHEST)
    return jax.lax.optimization_barrier(yt).T


def matmul_formulations() -> dict[str, Callable[..., Any]]:
    """name -> jitted (x or xt, W or Wt) -> y or yt."""
    return {
        "row": jax.jit(lambda x, w: jnp.dot(x, w, precision=HIGHEST)),
        "left+T": jax.jit(left_t),
        "feature": jax.jit(lambda xt, wt: jnp.dot(wt, xt, precision=HIGHEST)),
        "kernel": jax.jit(panel_matmul_cpu, static_argnums=2),
    }


def layer_stack(form: str, shapes: dict[str, tuple[int, int]], mlp: int, scan: bool) -> Callable[..., Any]:
    """A jitted stack of the four matmuls with a layer's elementwise glue (residuals, SiLU-gate), `x [M, hidden]`
    in and out, in formulation `form`, over per-layer weights (a tuple of `(qkv, o, gate+up, down)` per
    layer) or with `scan` over stacked ones (`[L, K, N]` for row, `[L, N, K]` for left+T and feature, panels
    `[L, ceil(N / 64), K, 64]` for kernel)."""
    q_width = shapes["o"][0]
    n_qkv, n_o, n_gu, n_down = (n for _, n in shapes.values())

    def mm(h: jax.Array, w: jax.Array, n: int) -> jax.Array:
        if form == "kernel":
            return panel_matmul_cpu(h, w, n)
        return jnp.dot(h, w, precision=HIGHEST) if form == "row" else left_t(h, w)

    def body_rows(x: jax.Array, ws: tuple[jax.Array, ...]) -> tuple[jax.Array, None]:
        w_qkv, w_o, w_gu, w_down = ws
        a = mm(x, w_qkv, n_qkv)[:, :q_width]
        x = x + mm(a, w_o, n_o)
        gu = mm(x, w_gu, n_gu)
        return x + mm(jax.nn.silu(gu[:, :mlp]) * gu[:, mlp:], w_down, n_down), None

    def body_features(xt: jax.Array, ws: tuple[jax.Array, ...]) -> tuple[jax.Array, None]:
        w_qkv, w_o, w_gu, w_down = ws
        a = jnp.dot(w_qkv, xt, precision=HIGHEST)[:q_width]
        xt = xt + jnp.dot(w_o, a, precision=HIGHEST)
        gu = jnp.dot(w_gu, xt, precision=HIGHEST)
        return xt + jnp.dot(w_down, jax.nn.silu(gu[:mlp]) * gu[mlp:], precision=HIGHEST), None

    body = body_features if form == "feature" else body_rows

    def stack(x: jax.Array, ws: Any) -> jax.Array:
        h = x.T if form == "feature" else x
        if scan:
            h = jax.lax.scan(body, h, ws)[0]
        else:
            for layer in ws:
                h, _ = body(h, layer)
        return h.T if form == "feature" else h

    return jax.jit(stack)


def timed(calls: dict[Any, Callable[[], Any]], repeats: int) -> dict[Any, list[float]]:
    """Each call compiled and run once, then `repeats` timed calls round-robin over all of them."""
    for call in calls.values():
        seconds_per_call(call)
    times: dict[Any, list[float]] = {key: [] for key in calls}
    for _ in range(repeats):
        for key, call in calls.items():
            times[key].append(seconds_per_call(call))
    return times


def format_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    lines = [header, ["-" * w for w in widths], *rows]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
                     for line in lines)


def result_rows(label: str, forms: list[str], times: dict[Any, list[float]], key: Callable[[str], Any],
                floor: float) -> list[str]:
    best = {f: min(times[key(f)]) for f in forms}
    cells = [f"{statistics.median(times[key(f)]) * 1e3:.3f} / {best[f] * 1e3:.3f}" for f in forms]
    winner = min(forms, key=lambda f: best[f])
    return [label, *cells, f"{floor * 1e3:.3f}", f"{winner} {best[winner] / floor:.1f}x"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="60m,smollm2", help=f"comma-separated, of {sorted(MODELS)}")
    parser.add_argument("--rows", default="1,4,16,32,64", help="comma-separated M")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--layers", type=int, default=0, help="layers of the stack table (0: the model's own)")
    parser.add_argument("--no-single", action="store_true", help="only the layer-stack table")
    parser.add_argument("--scan", action="store_true", help="the stack as a scan over stacked weights")
    args = parser.parse_args(argv)
    rows = [int(m) for m in args.rows.split(",")]
    bandwidth = memory_bandwidth(256, 5).read_bytes_per_s
    print(f"device: {jax.devices()[0].device_kind}, read bandwidth (jitted reduction, best): {bandwidth / 1e9:.1f} GB/s")
    forms = [f for f in FORMS if f != "kernel" or cpu_matmul_status() is None]
    if "kernel" not in forms:
        print(f"no kernel form: {cpu_matmul_status()}")
    header = ["case", *(f"{f} median / best ms" for f in forms), "floor ms", "best x floor"]
    rng = np.random.default_rng(0)
    for model in args.models.split(","):
        hidden, mlp, heads, kv_heads, head_dim, layers = MODELS[model]
        layers = args.layers or layers
        shapes = projection_shapes(hidden, mlp, heads, kv_heads, head_dim)
        if not args.no_single:
            single = matmul_formulations()
            table = []
            for name, (k, n) in shapes.items():
                w = jnp.asarray(rng.standard_normal((k, n), dtype=np.float32))
                wt = jnp.asarray(np.ascontiguousarray(np.asarray(w).T))
                panels = pack_panels(wt)
                calls: dict[Any, Callable[[], Any]] = {}
                for m in rows:
                    x = jnp.asarray(rng.standard_normal((m, k), dtype=np.float32))
                    xt = jnp.asarray(np.ascontiguousarray(np.asarray(x).T))
                    args_of = {"row": (x, w), "left+T": (x, wt), "feature": (xt, wt), "kernel": (x, panels, n)}
                    for f in forms:
                        calls[(m, f)] = lambda f=f, a=args_of[f]: single[f](*a)
                times = timed(calls, args.repeats)
                for m in rows:
                    table.append(result_rows(f"{model} {name} {m}x{k}x{n}", forms, times, lambda f, m=m: (m, f),
                                             k * n * 4 / bandwidth))
            print(f"\none matmul, {model}:")
            print(format_table(header, table))
        ws = tuple(jnp.asarray(rng.standard_normal((layers, k, n), dtype=np.float32) * 0.02) for k, n in shapes.values())
        ws_t = tuple(jnp.asarray(np.ascontiguousarray(np.swapaxes(np.asarray(w), 1, 2))) for w in ws)
        ws_p = tuple(pack_panels(w) for w in ws_t)
        if not args.scan:  # per-layer arrays, as the engine holds unrolled layers
            ws, ws_t, ws_p = (tuple(tuple(w[i] for w in stacked) for i in range(layers))
                              for stacked in (ws, ws_t, ws_p))
        stacks = {f: layer_stack(f, shapes, mlp, args.scan) for f in forms}
        calls = {}
        for m in rows:
            x = jnp.asarray(rng.standard_normal((m, hidden), dtype=np.float32))
            for f in forms:
                calls[(m, f)] = lambda f=f, x=x: stacks[f](x, {"row": ws, "kernel": ws_p}.get(f, ws_t))
        times = timed(calls, args.repeats)
        floor = sum(k * n for k, n in shapes.values()) * layers * 4 / bandwidth
        table = [result_rows(f"{model} {layers} layers, M={m}", forms, times, lambda f, m=m: (m, f), floor) for m in rows]
        print(f"\nlayer stack ({'scan over stacked' if args.scan else 'unrolled over per-layer'} weights), {model}:")
        print(format_table(header, table))


if __name__ == "__main__":
    main()
