"""Microbenchmark for ragged paged attention on one batch mix: the Pallas kernel against the jnp (XLA) path.

    python -m pallas_kernels.bench --decodes 32 --decode-ctx 1024 --prefill-chunks 256 --prefill-ctx 0

A batch is `--decodes` decode rows (one query token each, `--decode-ctx` tokens of context before it) plus
one prefill chunk per entry of `--prefill-chunks` (comma separated sizes), each with the matching entry of
`--prefill-ctx` tokens of prior context (one value is broadcast to all chunks). Rows are padded to a
multiple of 16 (the engine's buckets), and the block tables are shuffled.

It prints:
  * the work: attention FLOPs (2 matmuls of 2 * head_dim flops per visible (query head, key) pair; the
    softmax is not counted) and the minimal bytes that must move (q in, out back, and every sequence's K
    and V read once per KV head; block tables and metadata are negligible and not counted);
  * the device's measured matmul rate (a jnp matmul in the input dtype) and memory bandwidth (a jnp
    elementwise copy, read + write), hence a compute floor and a memory floor for this batch;
  * for both implementations: the median time, achieved TFLOP/s and GB/s, and time relative to the
    larger floor; and the max difference between the two outputs (relative to max |xla output|).

On CPU the kernel runs with interpret=True: that checks correctness, but its times say nothing about the
kernel (the interpreter runs the grid as a sequential loop of XLA ops); the script says so.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.ragged_paged_attention_xla import ragged_paged_attention_xla


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()] if text else []


def build_batch(args, rng: np.random.Generator):
    """Returns (arrays for the attention call, per-sequence (q_len, kv_len) list)."""
    seqs = [(1, args.decode_ctx + 1)] * args.decodes
    chunks = _ints(args.prefill_chunks)
    ctxs = _ints(args.prefill_ctx) or [0]
    if len(ctxs) == 1:
        ctxs = ctxs * len(chunks)
    if len(ctxs) != len(chunks):
        raise SystemExit("--prefill-ctx needs one value or one per --prefill-chunks entry")
    seqs += [(c, c + x) for c, x in zip(chunks, ctxs)]
    if not seqs:
        raise SystemExit("empty batch: give --decodes and/or --prefill-chunks")
    order = rng.permutation(len(seqs)) if args.shuffle_seqs else np.arange(len(seqs))
    seqs = [seqs[i] for i in order]

    bs = args.block_size
    n = len(seqs)
    max_num_seqs = n + args.pad_seqs
    num_rows = sum(q for q, _ in seqs)
    num_tokens = -(-num_rows // 16) * 16 + args.pad_rows
    max_kv = max(kv for _, kv in seqs)
    max_blocks = -(-max_kv // bs)
    pages_needed = sum(-(-kv // bs) for _, kv in seqs)
    num_blocks = pages_needed + 1
    dtype = jnp.dtype(args.dtype)

    kv_lens = np.zeros(max_num_seqs, np.int32)
    cu = np.zeros(max_num_seqs + 1, np.int32)
    block_tables = np.zeros((max_num_seqs, max_blocks), np.int32)
    free = list(rng.permutation(num_blocks))
    for i, (ql, kv) in enumerate(seqs):
        kv_lens[i] = kv
        cu[i + 1] = cu[i] + ql
        for b in range(-(-kv // bs)):
            block_tables[i, b] = free.pop()
    cu[n + 1 :] = cu[n]

    key = jax.random.key(args.seed)
    kq, kk, kv_ = jax.random.split(key, 3)
    q = jax.random.normal(kq, (num_tokens, args.num_q_heads, args.head_dim), jnp.float32).astype(dtype)
    cache_shape = (num_blocks, bs, args.num_kv_heads, args.head_dim)
    k_pages = jax.random.normal(kk, cache_shape, jnp.float32).astype(dtype)
    v_pages = jax.random.normal(kv_, cache_shape, jnp.float32).astype(dtype)
    arrays = (
        q, k_pages, v_pages, jnp.asarray(kv_lens), jnp.asarray(block_tables), jnp.asarray(cu),
        jnp.asarray([n], jnp.int32),
    )
    return arrays, seqs


def count_work(seqs, *, num_q_heads, num_kv_heads, head_dim, itemsize):
    flops = 0
    kv_bytes = 0
    for ql, kv in seqs:
        visible = sum(kv - ql + j + 1 for j in range(ql))  # keys seen by each query row, causal
        flops += 4 * head_dim * visible * num_q_heads
        kv_bytes += 2 * kv * num_kv_heads * head_dim * itemsize
    rows = sum(ql for ql, _ in seqs)
    q_out_bytes = 2 * rows * num_q_heads * head_dim * itemsize
    return flops, kv_bytes + q_out_bytes


def time_fn(fn, *args, iters: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_device(dtype, *, matmul_n: int, copy_mib: int, iters: int):
    a = jax.random.normal(jax.random.key(1), (matmul_n, matmul_n), jnp.float32).astype(dtype)
    mm = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
    t = time_fn(mm, a, a, iters=iters)
    flops_per_s = 2 * matmul_n**3 / t
    n = copy_mib * 2**20 // 4
    x = jnp.arange(n, dtype=jnp.float32)
    copy = jax.jit(lambda x: x + 1.0)
    t = time_fn(copy, x, iters=iters)
    bytes_per_s = 2 * n * 4 / t
    return flops_per_s, bytes_per_s


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--decodes", type=int, default=8, help="number of decode rows")
    p.add_argument("--decode-ctx", type=int, default=256, help="context tokens before each decode token")
    p.add_argument("--prefill-chunks", default="64", help="comma-separated prefill chunk sizes")
    p.add_argument("--prefill-ctx", default="0", help="prior context per chunk (one value or one per chunk)")
    p.add_argument("--num-q-heads", type=int, default=8)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--block-q", type=int, default=None)
    p.add_argument("--kv-pages-per-block", type=int, default=None)
    p.add_argument("--num-warps", type=int, default=None)
    p.add_argument("--num-stages", type=int, default=None)
    p.add_argument("--pad-seqs", type=int, default=2, help="padding sequence slots (max_num_seqs - num_seqs)")
    p.add_argument("--pad-rows", type=int, default=0, help="extra padding rows beyond the 16-row bucket")
    p.add_argument("--shuffle-seqs", action="store_true", help="interleave decodes and prefills")
    p.add_argument("--iters", type=int, default=None, help="timed iterations (default 20 on GPU, 3 on CPU)")
    p.add_argument("--interpret", action=argparse.BooleanOptionalAction, default=None,
                   help="Pallas interpret mode (default: on when the backend is CPU)")
    p.add_argument("--matmul-n", type=int, default=None, help="size of the square matmul used to measure peak")
    p.add_argument("--copy-mib", type=int, default=None, help="MiB copied to measure bandwidth")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    backend = jax.default_backend()
    on_cpu = backend == "cpu"
    interpret = on_cpu if args.interpret is None else args.interpret
    iters = args.iters or (3 if on_cpu else 20)
    matmul_n = args.matmul_n or (512 if on_cpu else 8192)
    copy_mib = args.copy_mib or (64 if on_cpu else 1024)
    dtype = jnp.dtype(args.dtype)

    rng = np.random.default_rng(args.seed)
    arrays, seqs = build_batch(args, rng)
    q, k_pages = arrays[0], arrays[1]
    flops, min_bytes = count_work(
        seqs, num_q_heads=args.num_q_heads, num_kv_heads=args.num_kv_heads, head_dim=args.head_dim,
        itemsize=dtype.itemsize,
    )
    peak_flops, peak_bw = measure_device(dtype, matmul_n=matmul_n, copy_mib=copy_mib, iters=iters)
    t_compute, t_memory = flops / peak_flops, min_bytes / peak_bw
    floor = max(t_compute, t_memory)

    print(f"device: {jax.devices()[0].device_kind} ({backend}); dtype {dtype.name}; "
          f"heads q/kv {args.num_q_heads}/{args.num_kv_heads}, head_dim {args.head_dim}, block_size {args.block_size}")
    n_dec = sum(1 for ql, kv in seqs if ql == 1)
    print(f"batch: {len(seqs)} seqs ({n_dec} decode rows), {sum(ql for ql, _ in seqs)} query rows "
          f"padded to T={q.shape[0]}, max_num_seqs={arrays[3].shape[0]}, kv tokens {sum(kv for _, kv in seqs)}, "
          f"cache {k_pages.shape[0]} pages")
    print(f"work: {flops / 1e9:.4g} GFLOP, min bytes {min_bytes / 1e6:.4g} MB, "
          f"intensity {flops / min_bytes:.3g} FLOP/B")
    print(f"measured: matmul {peak_flops / 1e12:.4g} TFLOP/s ({matmul_n}^3 {dtype.name}), "
          f"copy {peak_bw / 1e9:.4g} GB/s ({copy_mib} MiB)")
    print(f"floors: compute {t_compute * 1e6:.4g} us, memory {t_memory * 1e6:.4g} us "
          f"-> {'memory' if t_memory >= t_compute else 'compute'} bound, floor {floor * 1e6:.4g} us")

    kernel = jax.jit(
        lambda *a: ragged_paged_attention(
            *a, interpret=interpret, block_q=args.block_q, num_kv_pages_per_block=args.kv_pages_per_block,
            num_warps=args.num_warps, num_stages=args.num_stages,
        )
    )
    xla = jax.jit(ragged_paged_attention_xla)
    results = {}
    for name, fn in (("pallas" + (" (interpret)" if interpret else ""), kernel), ("xla", xla)):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*arrays))
        compile_s = time.perf_counter() - t0
        t = time_fn(fn, *arrays, iters=iters, warmup=0)
        results[name] = out
        print(f"{name:>20}: {t * 1e6:10.1f} us  {flops / t / 1e12:8.4g} TFLOP/s  {min_bytes / t / 1e9:8.4g} GB/s  "
              f"{t / floor:8.3g}x floor   (first call incl. compile {compile_s:.2f} s)")
    (_, a), (_, b) = results.items()
    rows = int(arrays[5][len(seqs)])
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    rel = np.abs(a[:rows] - b[:rows]).max() / max(np.abs(b[:rows]).max(), 1e-30)
    pad_ok = bool(np.all(a[rows:] == 0)) and not np.isnan(a).any()
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    print(f"pallas vs xla: max rel diff {rel:.3g} ({'OK' if rel <= tol else 'MISMATCH'}, tol {tol:g}); "
          f"padding rows zero and no NaN: {pad_ok}")
    if interpret:
        print("note: interpret mode; the Pallas times above measure the Pallas interpreter, not the kernel.")
    if rel > tol or not pad_ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
