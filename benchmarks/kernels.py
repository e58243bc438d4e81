"""Benchmark for ragged paged attention: the Pallas kernel against its hardware floor, the jnp (XLA) path and
FlashAttention (PyTorch's `scaled_dot_product_attention` on contiguous K/V), case by case.

    python -m benchmarks.kernels                      # the suite, Mistral-7B heads (32/8/128, bf16)
    python -m benchmarks.kernels --heads llama1b --out bench.json
    python -m benchmarks.kernels --decodes 32 --decode-ctx 1024 --prefill-chunks 512 --prefill-ctx 1536

Without batch flags it runs the suite (`SUITE`, six batches: 64 decodes x ctx 1024, 256 decodes
x ctx 2048, 8 decodes x ctx 16384, 32 decodes at ctx 1024 + one 512-token chunk at ctx 1536, a 2048-token
prefill, and a 512-token chunk at ctx 1536). With `--decodes` / `--prefill-chunks` it runs that one batch:
`--decodes` decode rows (one query token each, `--decode-ctx` tokens of context before it) plus one prefill
chunk per entry of `--prefill-chunks` (comma separated), each after the matching `--prefill-ctx` tokens of
context (one value is broadcast). Rows are padded to a multiple of 16 (the engine's buckets), block tables
are shuffled.

Per case it prints:
  * the work: attention FLOPs (2 matmuls of 2 * head_dim flops per visible (query head, key) pair; the
    softmax is not counted) and the minimal bytes that must move (q in, out back, every sequence's K and V
    read once per KV head);
  * the hardware floor: max(FLOPs / measured matmul rate, bytes / measured bandwidth), where the rates are
    measured once per run on this device by `pallas_kernels.machine_rates` (a jnp matmul in the input dtype;
    a jnp elementwise float32 copy, read + write);
  * which kernel config it used (tuning-table entry or rules, see `pallas_kernels/tuning.py`);
  * per implementation: time per call, TFLOP/s, GB/s, time / floor; Pallas / FlashAttention when PyTorch
    with CUDA is importable (it says so when not); the max difference between Pallas and XLA outputs.

On a CPU (`jax.default_backend() == "cpu"`) the default is the CPU suite instead (`CPU_SUITE`, `--cpu-heads`):
the C++ kernel (`attention_backend="cpu"`) and the jnp path (`"xla"`) side by side, for head layouts with
GQA groups 1, 4 and 8 at head_dim 64 and 128, decode batches of 1-128 rows at contexts 64-4096, and
prefills and chunks; the floors use the matmul rate and the read bandwidth (attention mostly reads). The jnp
path is skipped where its K/V exceed `--xla-max-mb` (it would take seconds per call); `--cpu-only` skips it
everywhere. `--baseline-library SO` times another build of the C++ kernel (an older checkout's .so) in
alternating rounds with this one, on the same inputs, and reports the ratio.

    python -m benchmarks.kernels                            # on a CPU: the CPU suite
    python -m benchmarks.kernels --cpu-heads 8,8,64 --decodes 32 --decode-ctx 512

Timing: after a warm-up call (compiles), `--iters` back-to-back calls are timed together, the device is
synchronised once at the end, and the best of `--repeats` such runs divided by `--iters` is reported (so host
dispatch overlaps device work, as in a serving loop). FlashAttention is timed the same way with
torch.cuda.synchronize(). On CPU the kernel runs with interpret=True: that checks correctness, but its times
say nothing about the kernel; the script says so.

The cases and batches are in `bench_cases.py`, the CPU suite in `bench_cpu.py`, the timing in `timing.py`;
this module holds the GPU suite (`run_case`, FlashAttention beside it) and the command line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import machine_rates
from pallas_kernels.cases import CPU_HEADS, CPU_SUITE, HEADS, SUITE, Case, build_batch, count_work
from benchmarks.kernels_cpu import cpu_main
from pallas_kernels.ragged_paged_attention import ragged_paged_attention, resolve_kernel_config
from pallas_kernels.ragged_paged_attention_xla import ragged_paged_attention_xla
from pallas_kernels.timing import best_seconds_per_call


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()] if text else []


def torch_status() -> tuple[object | None, str]:
    """(torch module or None, why not)."""
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - any import failure means "not available"
        return None, f"PyTorch not importable ({type(e).__name__}: {e})"
    if not torch.cuda.is_available():
        return None, f"PyTorch {torch.__version__} importable but CUDA is not available"
    return torch, f"PyTorch {torch.__version__}, {torch.cuda.get_device_name()}"


def time_flash_attention(torch, seqs, *, num_q_heads, num_kv_heads, head_dim, dtype: str, iters: int,
                         repeats: int) -> tuple[float, str]:
    """Seconds per batch of `torch.nn.functional.scaled_dot_product_attention` over the same (q_len, kv_len)
    work with contiguous K/V: one call per group of equal-shaped sequences (batched). q_len == kv_len uses
    is_causal (FlashAttention kernels); a chunk after context needs a bottom-right causal mask (explicit
    boolean mask, so usually not the flash kernel)."""
    F = torch.nn.functional
    tdtype = getattr(torch, dtype)
    groups: dict[tuple[int, int], int] = {}
    for s in seqs:
        groups[s] = groups.get(s, 0) + 1
    gqa = True
    calls = []
    for (ql, kv), count in groups.items():
        q = torch.randn(count, num_q_heads, ql, head_dim, device="cuda", dtype=tdtype)
        k = torch.randn(count, num_kv_heads, kv, head_dim, device="cuda", dtype=tdtype)
        v = torch.randn_like(k)
        if ql == kv:
            kw = dict(is_causal=True)
        elif ql == 1:
            kw = {}
        else:
            pos = torch.arange(kv, device="cuda")
            kw = dict(attn_mask=pos[None, :] <= (kv - ql + torch.arange(ql, device="cuda"))[:, None])
        calls.append((q, k, v, kw))
    try:
        for q, k, v, kw in calls:
            F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)
    except (TypeError, RuntimeError):
        gqa = False  # older torch: expand the KV heads (reads group x more K/V than GQA needs)
        rep = num_q_heads // num_kv_heads
        calls = [(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), kw) for q, k, v, kw in calls]

    def run():
        for q, k, v, kw in calls:
            if gqa:
                F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)
            else:
                F.scaled_dot_product_attention(q, k, v, **kw)

    run()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            run()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / iters)
    return best, ("enable_gqa" if gqa else "KV heads expanded") + f", {len(calls)} call(s)"


def run_case(case: Case, args, *, peak_flops, peak_bw, interpret: bool, torch, rng) -> dict:
    dtype = jnp.dtype(args.dtype)
    hq, hkv, d = args.heads
    seqs = case.seqs()
    if args.shuffle_seqs:
        seqs = [seqs[i] for i in rng.permutation(len(seqs))]
    arrays = build_batch(seqs, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=args.block_size,
                         dtype=dtype, rng=rng, pad_seqs=args.pad_seqs, pad_rows=args.pad_rows, seed=args.seed)
    q, k_pages, _, _, block_tables, cu, _ = arrays
    flops, min_bytes = count_work(seqs, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, itemsize=dtype.itemsize)
    t_compute, t_memory = flops / peak_flops, min_bytes / peak_bw
    floor = max(t_compute, t_memory)
    overrides = dict(block_q=args.block_q, num_kv_pages_per_block=args.kv_pages_per_block,
                     num_warps=args.num_warps, num_stages=args.num_stages, num_kv_splits=args.num_kv_splits)
    config, source = resolve_kernel_config(q.shape, k_pages.shape, block_tables.shape, dtype, **overrides)
    rec = dict(case=case.name, seqs=len(seqs), rows=int(sum(ql for ql, _ in seqs)), tokens=int(q.shape[0]),
               max_num_seqs=int(arrays[3].shape[0]), max_context=int(block_tables.shape[1] * args.block_size),
               gflop=flops / 1e9, min_mb=min_bytes / 1e6, floor_us=floor * 1e6,
               floor_kind="memory" if t_memory >= t_compute else "compute",
               config=dataclasses.asdict(config), config_source=source)
    print(f"\n== {case.name}: {len(seqs)} seqs, {rec['rows']} rows padded to T={q.shape[0]}, "
          f"max_num_seqs={rec['max_num_seqs']}, cache context {rec['max_context']}")
    print(f"   work {flops / 1e9:.4g} GFLOP, {min_bytes / 1e6:.4g} MB; floor {floor * 1e6:.4g} us "
          f"({rec['floor_kind']}; compute {t_compute * 1e6:.4g} us, memory {t_memory * 1e6:.4g} us)")
    print(f"   config: {source}")
    c = config
    print(f"     decode  tiles: block_q {c.decode.block_q}, kv pages/step {c.decode.kv_pages_per_block}, "
          f"warps {c.decode.num_warps}, stages {c.decode.num_stages}; splits <= {c.max_splits} "
          f"(>= {c.min_split_kv} tokens each, target {c.split_target_programs} programs)")
    print(f"     prefill tiles: block_q {c.prefill.block_q}, kv pages/step {c.prefill.kv_pages_per_block}, "
          f"warps {c.prefill.num_warps}, stages {c.prefill.num_stages}")

    kernel = jax.jit(lambda *a: ragged_paged_attention(*a, interpret=interpret, **overrides))
    fns = [("pallas" + (" (interpret)" if interpret else ""), kernel)]
    if args.xla:
        fns.append(("xla", jax.jit(ragged_paged_attention_xla)))
    outs = {}
    for name, fn in fns:
        t0 = time.perf_counter()
        outs[name] = jax.block_until_ready(fn(*arrays))
        compile_s = time.perf_counter() - t0
        t = best_seconds_per_call(fn, *arrays, iters=args.iters, repeats=args.repeats, warmup=0)
        key = name.split()[0]
        rec[f"{key}_us"] = t * 1e6
        rec[f"{key}_first_call_s"] = compile_s
        print(f"   {name:>20}: {t * 1e6:10.1f} us  {flops / t / 1e12:8.4g} TFLOP/s  {min_bytes / t / 1e9:8.4g} GB/s  "
              f"{t / floor:7.3g}x floor   (first call incl. compile {compile_s:.2f} s)")
    if torch is not None:
        t, how = time_flash_attention(torch, seqs, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=dtype.name,
                                      iters=args.iters, repeats=args.repeats)
        rec["flash_us"] = t * 1e6
        rec["pallas_over_flash"] = rec["pallas_us"] / rec["flash_us"]
        print(f"   {'flash (torch sdpa)':>20}: {t * 1e6:10.1f} us  {flops / t / 1e12:8.4g} TFLOP/s  "
              f"{min_bytes / t / 1e9:8.4g} GB/s  {t / floor:7.3g}x floor   ({how}, contiguous K/V)")
        print(f"   pallas / flash: {rec['pallas_over_flash']:.3g}")
    rec["pallas_over_floor"] = rec["pallas_us"] / rec["floor_us"]
    ok = True
    if args.xla:
        a, b = (np.asarray(outs[n], np.float32) for n, _ in fns[:2])
        rows = int(cu[len(seqs)])
        rel = float(np.abs(a[:rows] - b[:rows]).max() / max(np.abs(b[:rows]).max(), 1e-30))
        pad_ok = bool(np.all(a[rows:] == 0)) and not np.isnan(a).any()
        tol = 1e-5 if dtype == jnp.float32 else 2e-2
        ok = rel <= tol and pad_ok
        rec.update(max_rel_diff_vs_xla=rel, padding_zero_no_nan=pad_ok, ok=ok)
        print(f"   pallas vs xla: max rel diff {rel:.3g} ({'OK' if rel <= tol else 'MISMATCH'}, tol {tol:g}); "
              f"padding rows zero and no NaN: {pad_ok}")
    return rec


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--decodes", type=int, default=None, help="custom batch: number of decode rows")
    p.add_argument("--decode-ctx", type=int, default=256, help="context tokens before each decode token")
    p.add_argument("--prefill-chunks", default=None, help="custom batch: comma-separated prefill chunk sizes")
    p.add_argument("--prefill-ctx", default="0", help="prior context per chunk (one value or one per chunk)")
    p.add_argument("--cases", default=None,
                   help="suite: comma-separated indices into SUITE (default: all six)")
    p.add_argument("--heads", default=None,
                   help=f"one of {sorted(HEADS)} or 'Q,KV,D' (query heads, KV heads, head_dim); default mistral7b "
                        "(on a CPU: the suite's CPU_HEADS)")
    p.add_argument("--num-q-heads", type=int, default=None, help="overrides --heads")
    p.add_argument("--num-kv-heads", type=int, default=None, help="overrides --heads")
    p.add_argument("--head-dim", type=int, default=None, help="overrides --heads")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32", "float16"],
                   help="default: bfloat16 on a GPU, float32 on a CPU (the engine's defaults)")
    p.add_argument("--block-q", type=int, default=None, help="override: prefill tiles' query rows")
    p.add_argument("--kv-pages-per-block", type=int, default=None, help="override: pages per KV step")
    p.add_argument("--num-warps", type=int, default=None)
    p.add_argument("--num-stages", type=int, default=None)
    p.add_argument("--num-kv-splits", type=int, default=None, help="override: split bound (1 = no split-KV)")
    p.add_argument("--pad-seqs", type=int, default=2, help="padding sequence slots (max_num_seqs - num_seqs)")
    p.add_argument("--pad-rows", type=int, default=0, help="extra padding rows beyond the 16-row bucket")
    p.add_argument("--shuffle-seqs", action="store_true", help="interleave decodes and prefills")
    p.add_argument("--iters", type=int, default=None, help="calls per timed run (default 20 on GPU, 1 on CPU)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs, best kept (default 3 on GPU, 1 on CPU)")
    p.add_argument("--xla", action=argparse.BooleanOptionalAction, default=True,
                   help="also time the jnp path and compare outputs (default on)")
    p.add_argument("--torch", action=argparse.BooleanOptionalAction, default=True,
                   help="compare with torch scaled_dot_product_attention when PyTorch with CUDA is importable")
    p.add_argument("--interpret", action=argparse.BooleanOptionalAction, default=None,
                   help="Pallas interpret mode (default: on when the backend is CPU)")
    p.add_argument("--matmul-n", type=int, default=None, help="size of the square matmul used to measure peak")
    p.add_argument("--copy-mib", type=int, default=None, help="MiB copied to measure bandwidth")
    p.add_argument("--out", default=None, help="write the results as JSON to this file")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kernel", default=None, choices=["pallas", "cpu"],
                   help="the kernel timed: the Pallas kernel (default on a GPU; interpret mode on a CPU) or the "
                        "C++ CPU kernel (default on a CPU: the CPU suite)")
    p.add_argument("--cpu-heads", default=None,
                   help="CPU suite: head layouts 'Q,KV,D;Q,KV,D' (default: CPU_HEADS, or --heads when given)")
    p.add_argument("--cpu-only", action="store_true", help="CPU suite: time the C++ kernel only")
    p.add_argument("--xla-max-mb", type=float, default=300.0,
                   help="CPU suite: time the jnp path only where the minimal bytes are at most this")
    p.add_argument("--baseline-library", default=None, metavar="SO",
                   help="CPU suite: another build of the C++ kernel (its _cpu_attention*.so, from another "
                        "checkout), timed in alternating rounds with this one on the same inputs")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    on_cpu = jax.default_backend() == "cpu"
    cpu_kernel = (args.kernel or ("cpu" if on_cpu else "pallas")) == "cpu"
    if cpu_kernel and not on_cpu:
        raise SystemExit("--kernel cpu: the C++ kernel runs on a CPU backend only")

    heads_given = args.heads is not None or any(
        x is not None for x in (args.num_q_heads, args.num_kv_heads, args.head_dim))
    args.heads = args.heads or "mistral7b"
    args.dtype = args.dtype or ("float32" if cpu_kernel else "bfloat16")
    heads = HEADS.get(args.heads) or tuple(_ints(args.heads))
    if len(heads) != 3:
        raise SystemExit(f"--heads: one of {sorted(HEADS)} or Q,KV,D")
    args.heads = (args.num_q_heads or heads[0], args.num_kv_heads or heads[1], args.head_dim or heads[2])

    if args.decodes is not None or args.prefill_chunks is not None:
        chunks = _ints(args.prefill_chunks or "")
        ctxs = _ints(args.prefill_ctx) or [0]
        if len(ctxs) == 1:
            ctxs = ctxs * len(chunks)
        if len(ctxs) != len(chunks):
            raise SystemExit("--prefill-ctx needs one value or one per --prefill-chunks entry")
        cases = [Case("custom", decodes=args.decodes or 0, decode_ctx=args.decode_ctx, chunks=tuple(chunks),
                      chunk_ctx=tuple(ctxs))]
        if not cases[0].seqs():
            raise SystemExit("empty batch: give --decodes and/or --prefill-chunks")
    else:
        suite = CPU_SUITE if cpu_kernel else SUITE
        picked = _ints(args.cases) if args.cases else list(range(len(suite)))
        if any(not 0 <= i < len(suite) for i in picked):
            raise SystemExit(f"--cases: indices into the {len(suite)}-case suite, 0..{len(suite) - 1}")
        cases = [suite[i] for i in picked]

    if cpu_kernel:
        if args.dtype == "float16":
            raise SystemExit("--dtype float16: the CPU kernel takes float32 or bfloat16")
        args.cpu_heads = ([tuple(_ints(h)) for h in args.cpu_heads.split(";")] if args.cpu_heads
                          else [args.heads] if heads_given else list(CPU_HEADS))
        return cpu_main(args, cases)

    backend = jax.default_backend()
    interpret = on_cpu if args.interpret is None else args.interpret
    args.iters = args.iters or (1 if on_cpu else 20)
    args.repeats = args.repeats or (1 if on_cpu else 3)
    matmul_n = args.matmul_n or (512 if on_cpu else 8192)
    copy_mib = args.copy_mib or (64 if on_cpu else 1024)
    dtype = jnp.dtype(args.dtype)
    rate_iters = max(args.iters, 3)
    peak_flops = machine_rates.matmul_rate(matmul_n, dtype.name, repeats=3, iters=rate_iters)
    peak_bw = machine_rates.memory_bandwidth(copy_mib, repeats=3, iters=rate_iters).copy_bytes_per_s
    torch, torch_msg = torch_status() if args.torch else (None, "disabled (--no-torch)")
    device = jax.devices()[0].device_kind
    hq, hkv, d = args.heads
    print(f"device: {device} ({backend}); dtype {dtype.name}; heads q/kv {hq}/{hkv}, head_dim {d}, "
          f"block_size {args.block_size}")
    print(f"measured: matmul {peak_flops / 1e12:.4g} TFLOP/s ({matmul_n}^3 {dtype.name}), "
          f"copy {peak_bw / 1e9:.4g} GB/s ({copy_mib} MiB)")
    print(f"FlashAttention comparison: {torch_msg}")

    rng = np.random.default_rng(args.seed)
    records = [run_case(c, args, peak_flops=peak_flops, peak_bw=peak_bw, interpret=interpret, torch=torch, rng=rng)
               for c in cases]

    print("\n| batch | Pallas us | floor us | x floor | FA us | Pallas / FA | config |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in records:
        fa = f"{r['flash_us']:.1f}" if "flash_us" in r else "-"
        ratio = f"{r['pallas_over_flash']:.3g}" if "pallas_over_flash" in r else "-"
        print(f"| {r['case']} | {r['pallas_us']:.1f} | {r['floor_us']:.1f} | {r['pallas_over_floor']:.3g} | {fa} | "
              f"{ratio} | {r['config_source']} |")
    if interpret:
        print("note: interpret mode; the Pallas times above measure the Pallas interpreter, not the kernel.")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=device, backend=backend, dtype=dtype.name, heads=list(args.heads),
                           block_size=args.block_size, interpret=interpret, matmul_tflops=peak_flops / 1e12,
                           copy_gbps=peak_bw / 1e9, flash=torch_msg, cases=records), f, indent=1)
        print(f"wrote {args.out}")
    if not all(r.get("ok", True) for r in records):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
