"""The CPU suite of `python -m benchmarks.kernels` (the default on a CPU backend; see bench.py's doc): the C++
kernel and, within `--xla-max-mb`, the jnp path, per head layout and batch, against the floor of the matmul
rate and the read bandwidth that `pallas_kernels.machine_rates` measures (attention mostly reads).
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import machine_rates
from pallas_kernels.cases import Case, build_batch, count_work
from pallas_kernels.ragged_paged_attention_cpu import cpu_kernel_status, kernel_of_library, ragged_paged_attention_cpu
from pallas_kernels.ragged_paged_attention_xla import ragged_paged_attention_xla
from pallas_kernels.timing import best_seconds_per_call


def run_cpu_case(case: Case, heads, args, *, peak_flops, peak_bw, rng, baseline=None) -> dict:
    """One batch on a CPU: the C++ kernel and (within --xla-max-mb) the jnp path, against the floor; with
    `baseline` (another build of the kernel), both builds timed in alternating rounds on the same inputs."""
    dtype = jnp.dtype(args.dtype)
    hq, hkv, d = heads
    seqs = case.seqs()
    arrays = build_batch(seqs, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=args.block_size,
                         dtype=dtype, rng=rng, pad_seqs=args.pad_seqs, pad_rows=args.pad_rows, seed=args.seed)
    flops, min_bytes = count_work(seqs, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, itemsize=dtype.itemsize)
    t_compute, t_memory = flops / peak_flops, min_bytes / peak_bw
    floor = max(t_compute, t_memory)
    rec = dict(case=case.name, heads=list(heads), group=hq // hkv, rows=int(sum(ql for ql, _ in seqs)),
               gflop=flops / 1e9, min_mb=min_bytes / 1e6, floor_us=floor * 1e6, memory_floor_us=t_memory * 1e6,
               floor_kind="memory" if t_memory >= t_compute else "compute")
    fns = [("cpu", jax.jit(ragged_paged_attention_cpu))]
    if args.xla and not args.cpu_only and min_bytes / 1e6 <= args.xla_max_mb:
        fns.append(("xla", jax.jit(ragged_paged_attention_xla)))
    if baseline is not None:
        fns.append(("baseline", baseline))
    outs = {name: jax.block_until_ready(fn(*arrays)) for name, fn in fns}
    best = {name: float("inf") for name, _ in fns}
    for _ in range(args.repeats):  # rounds alternate between the functions: drift hits them alike
        for name, fn in fns:
            best[name] = min(best[name], best_seconds_per_call(fn, *arrays, iters=args.iters, repeats=1, warmup=0))
    for name, _ in fns:
        t = best[name]
        rec[f"{name}_us"] = t * 1e6
        rec[f"{name}_over_floor"] = t / floor
        rec[f"{name}_over_memory_floor"] = t / t_memory
    rows = int(arrays[5][len(seqs)])
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    for other in ("xla", "baseline"):
        if other in outs:
            a, b = (np.asarray(outs[n], np.float32)[:rows] for n in ("cpu", other))
            rec[f"max_rel_diff_vs_{other}"] = diff = float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))
            rec["ok"] = rec.get("ok", True) and diff <= tol
    if "baseline" in outs:
        rec["baseline_ratio"] = rec["cpu_us"] / rec["baseline_us"]
    return rec


def format_cpu_table(records: list[dict]) -> str:
    lines = ["| heads q/kv/d (G) | batch | cpu us | x floor | x bytes floor | xla us | x floor | cpu speed-up | "
             "floor us (kind) |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in records:
        hq, hkv, d = r["heads"]
        xla = (f"{r['xla_us']:.0f} | {r['xla_over_floor']:.3g} | {r['xla_us'] / r['cpu_us']:.3g}x"
               if "xla_us" in r else "- | - | -")
        lines.append(f"| {hq}/{hkv}/{d} ({r['group']}) | {r['case']} | {r['cpu_us']:.1f} | {r['cpu_over_floor']:.3g} | "
                     f"{r['cpu_over_memory_floor']:.3g} | {xla} | {r['floor_us']:.1f} ({r['floor_kind']}) |")
    if any("baseline_us" in r for r in records):
        lines += ["", "| heads q/kv/d (G) | batch | baseline us | this build us | this / baseline |", "| --- | --- | --- | --- | --- |"]
        lines += [f"| {r['heads'][0]}/{r['heads'][1]}/{r['heads'][2]} ({r['group']}) | {r['case']} | {r['baseline_us']:.1f} | "
                  f"{r['cpu_us']:.1f} | {r['baseline_ratio']:.2f}x |" for r in records if "baseline_us" in r]
    return "\n".join(lines)


def cpu_main(args, cases) -> None:
    status = cpu_kernel_status()
    if status is not None:
        raise SystemExit(f"the CPU kernel is not available: {status}")
    args.iters = args.iters or 10
    args.repeats = args.repeats or 3
    peak_flops = machine_rates.matmul_rate(args.matmul_n or 1024, args.dtype)
    peak_bw = machine_rates.memory_bandwidth(args.copy_mib or 512).read_bytes_per_s
    heads_list = [tuple(h) for h in args.cpu_heads]
    print(f"device: {jax.devices()[0].device_kind} (cpu); dtype {args.dtype}; block_size {args.block_size}")
    print(f"measured: matmul {peak_flops / 1e9:.4g} GFLOP/s ({args.dtype}), read bandwidth {peak_bw / 1e9:.4g} GB/s")
    rng = np.random.default_rng(args.seed)
    baseline = None
    if args.baseline_library:
        baseline = kernel_of_library(args.baseline_library, "sarathi_ragged_paged_attention_baseline")
        print(f"baseline build: {args.baseline_library} (timed in alternating rounds with this one)")
    records = []
    for heads in heads_list:
        for case in cases:
            r = run_cpu_case(case, heads, args, peak_flops=peak_flops, peak_bw=peak_bw, rng=rng, baseline=baseline)
            records.append(r)
            xla = f", xla {r['xla_us']:.0f} us" if "xla_us" in r else ""
            print(f"  {heads} {case.name}: cpu {r['cpu_us']:.1f} us ({r['cpu_over_floor']:.3g}x floor){xla}",
                  flush=True)
    print()
    print(format_cpu_table(records))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=jax.devices()[0].device_kind, backend="cpu", dtype=args.dtype,
                           block_size=args.block_size, matmul_gflops=peak_flops / 1e9, read_gbps=peak_bw / 1e9,
                           cases=records), f, indent=1)
        print(f"wrote {args.out}")
    if not all(r.get("ok", True) for r in records):
        raise SystemExit(1)
