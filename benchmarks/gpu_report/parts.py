"""The parts of `python -m benchmarks.gpu_report`, one per process:
`python -m benchmarks.gpu_report.parts PART --out DIR --result PATH --config JSON`.

Each part measures by calling the benchmark modules that already exist (`bench.roofline`,
`pallas_kernels.tune`, `benchmarks.kernels`, `benchmarks.probes.profile_steps` and `benchmarks.probes.trace_summary`,
`benchmarks.probes.startup`, `benchmarks.probes.loop_cost`) and saves a result to PATH after every piece it finishes (so
a part stopped half-way keeps what it had):

    {"figures": [{"name", "value", "unit", "floor", "floor_basis", "ratio"}], "tables": [{"title", "columns",
     "rows"}], "info": {...}, ...}

A figure's `floor` is in its own unit (a time's floor in seconds) or None where no floor applies (a start-up
time, a fraction, a rate), and `ratio` = value / floor. Floors come from `bench.roofline`: bytes over the
measured bandwidth and FLOPs over the measured matmul rate (both from the `machine` part, passed in as
`rates`; measured here when that part did not deliver them).

`Result` and the floors are in result.py, the two profile parts in profiles.py; this
module holds the other parts and the command line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from benchmarks.gpu_report.run import ReportConfig
from benchmarks.gpu_report.profiles import part_profile_large, part_profile_small
from benchmarks.gpu_report.result import Result, floor_of, get_rates

# ----------------------------------------------------------------------------------------------- 1. machine


def part_machine(cfg: ReportConfig, res: Result, **_: Any) -> None:
    import jax

    from benchmarks.gpu_capacity import machine_info
    from sarathi_jax.bench.roofline import measure_rates

    info = machine_info()
    smi = (info.get("nvidia_smi") or "").splitlines()
    if smi:  # "name, memory.total, driver_version" of the first GPU
        fields = [x.strip() for x in smi[0].split(",")]
        info.update(gpu_name=fields[0], gpu_memory=fields[1] if len(fields) > 1 else None,
                    driver_version=fields[2] if len(fields) > 2 else None)
    info["device_kind"] = jax.devices()[0].device_kind
    res.doc["info"] = info
    res.save()
    rates = measure_rates(cfg.dtype, cfg.matmul_n, cfg.bandwidth_mb, repeats=cfg.rate_repeats)
    res.doc["rates"] = {"matmul_flops_per_s": rates.matmul_flops, "bandwidth_bytes_per_s": rates.bandwidth,
                        "details": rates.details}
    res.figure(f"matmul {cfg.matmul_n}^3 {cfg.dtype}", rates.matmul_flops, "FLOP/s")
    if "matmul_bf16_flops_per_s" in rates.details:
        res.figure(f"matmul {cfg.matmul_n}^3 bfloat16", rates.details["matmul_bf16_flops_per_s"], "FLOP/s")
    bw = rates.details["bandwidth"]
    res.figure(f"bandwidth, reduction of {bw['array_mbytes']} MiB float32", bw["read_bytes_per_s"], "B/s")
    res.figure(f"bandwidth, scaled copy of {bw['array_mbytes']} MiB float32", bw["copy_bytes_per_s"], "B/s")
    print(f"matmul {rates.matmul_flops / 1e12:.4g} TFLOP/s, bandwidth {rates.bandwidth / 1e9:.4g} GB/s")


# ----------------------------------------------------------------------------------------------- 2. tuning


def part_tune(cfg: ReportConfig, res: Result, out: str, rates: dict | None, **_: Any) -> None:
    from pallas_kernels import tune
    from pallas_kernels.cases import count_work

    rates = get_rates(cfg, rates, res)
    path = os.path.join(out, "tuning_table.json")
    argv = ["--out", path, "--budget-s", f"{cfg.tune_budget_s:g}"]
    if cfg.tune_interpret:
        argv.append("--interpret-smoke")
    res.doc["info"]["command"] = "python -m pallas_kernels.tune " + " ".join(argv)
    tune.main(argv)
    with open(path) as f:
        table = json.load(f)
    res.doc["info"].update(table_path=path, tuned=table["tuned"], device=table["device"], note=table["note"],
                           entries=len(table["entries"]),
                           commit_with=f"cp {path} pallas_kernels/tuning_table.json")
    cases = {c.name: c for c in tune.default_cases() + tune.interpret_smoke_cases()}
    rows = []
    for e in table["entries"]:
        c, t = e["config"], e["time_us"]
        floor = basis = None
        case = cases.get(e["case"])
        if case is not None and t is not None:
            hq, hkv, d = tune.HEAD_SHAPES[case.heads]
            flops, nbytes = count_work(list(case.seqs), num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                                       itemsize=2 if case.dtype == "bfloat16" else 4)
            floor, basis, _, _ = floor_of(flops, nbytes, rates)
            res.figure(f"tuned kernel: {e['case']}", t * 1e-6, "s", floor, basis)
        rows.append([e["kind"], e["case"], c["block_q"], c["kv_pages_per_block"], c.get("num_warps"),
                     c.get("num_stages"), c.get("max_splits"), t, None if floor is None else floor * 1e6,
                     None if floor is None or t is None else t / (floor * 1e6)])
    res.table("tuning table entries", ["kind", "case", "block_q", "kv pages", "warps", "stages", "max splits",
                                       "us", "floor us", "x floor"], rows)


# ----------------------------------------------------------------------------------------------- 3. attention


def attention_cases(indices: tuple[int, ...], scale: int) -> list:
    """`pallas_kernels.cases.SUITE[i]` for each index, every size divided by `scale` (1: the suite's own cases),
    renamed to match."""
    from pallas_kernels.cases import SUITE, Case

    if scale == 1:
        return [SUITE[i] for i in indices]
    out = []
    for c in (SUITE[i] for i in indices):
        d, dc = (max(1, c.decodes // scale), c.decode_ctx // scale) if c.decodes else (0, 0)
        chunks = tuple(max(1, x // scale) for x in c.chunks)
        ctxs = tuple(x // scale for x in c.chunk_ctx)
        parts = [f"{d} decode{'s' * (d > 1)} x ctx {dc}"] if d else []
        parts += [f"prefill {n} tokens" if x == 0 else f"{n}-token chunk at ctx {x}" for n, x in zip(chunks, ctxs)]
        out.append(Case(" + ".join(parts), decodes=d, decode_ctx=dc, chunks=chunks, chunk_ctx=ctxs))
    return out


def part_attention(cfg: ReportConfig, res: Result, rates: dict | None, **_: Any) -> None:
    import jax
    import numpy as np

    from benchmarks import kernels as kb
    from pallas_kernels.tuning import current_table_path

    rates = get_rates(cfg, rates, res)
    args = kb.build_parser().parse_args(["--dtype", cfg.dtype, "--iters", str(cfg.attention_iters),
                                         "--repeats", str(cfg.attention_repeats)])
    args.heads = tuple(cfg.attention_heads)
    interpret = jax.default_backend() == "cpu"
    torch, torch_msg = kb.torch_status()
    res.doc["info"].update(flash_attention=torch_msg, interpret=interpret, tuning_table=current_table_path(),
                           heads=list(args.heads), dtype=cfg.dtype)
    if interpret:
        res.doc["info"]["note"] = "interpret mode: the Pallas times measure the interpreter, not the kernel"
    res.save()
    rng = np.random.default_rng(args.seed)
    rows = []
    for case in attention_cases(cfg.attention_cases, cfg.attention_scale):
        r = kb.run_case(case, args, peak_flops=rates.matmul_flops, peak_bw=rates.bandwidth, interpret=interpret,
                        torch=torch, rng=rng)
        floor_s, basis, compute, memory = floor_of(r["gflop"] * 1e9, r["min_mb"] * 1e6, rates)
        for impl, label in (("pallas", "Pallas"), ("xla", "jnp (XLA)"), ("flash", "torch SDPA")):
            if f"{impl}_us" in r:
                res.figure(f"{label}: {case.name}", r[f"{impl}_us"] * 1e-6, "s", floor_s, basis)
        rows.append([case.name, r["pallas_us"], r.get("xla_us"), r.get("flash_us"), memory * 1e6, compute * 1e6,
                     basis, r["pallas_us"] / (floor_s * 1e6), r.get("pallas_over_flash"), r.get("ok"),
                     r["config_source"]])
        res.doc.setdefault("cases", []).append(r)
        res.save()
    res.table("per mix (floor: bytes for decodes, FLOPs for prefills; x floor is Pallas over the larger)",
              ["mix", "Pallas us", "jnp us", "SDPA us", "bytes floor us", "FLOP floor us", "floor", "x floor",
               "Pallas / SDPA", "matches jnp", "kernel config"], rows)
    if not all(r.get("ok", True) for r in res.doc["cases"]):
        raise RuntimeError("the Pallas kernel's output differs from the jnp path's (see the cases)")


# ----------------------------------------------------------------------------------------------- 5. start-up


def _startup(cfg: ReportConfig, res: Result, model: str) -> None:
    from benchmarks.probes import startup

    with tempfile.TemporaryDirectory(prefix="gpu-report-startup-") as tmp:
        path = os.path.join(tmp, "startup.json")
        argv = ["--model", model, "--dtype", cfg.dtype, "--runs", "2", "--cache-dir", os.path.join(tmp, "cache"),
                "--json", path]
        for flag, value in (("--token-budget", cfg.startup_token_budget),
                            ("--max-num-seqs", cfg.startup_max_num_seqs), ("--num-blocks", cfg.startup_num_blocks)):
            if value is not None:
                argv += [flag, str(value)]
        res.doc["info"]["command"] = "python -m benchmarks.probes.startup " + " ".join(argv)
        rc = startup.main(argv)
        if rc != 0:
            raise RuntimeError(f"benchmarks.probes.startup exited with status {rc}")
        with open(path) as f:
            runs = json.load(f)["runs"]
    res.doc["runs"] = runs
    rows = []
    for label, r in zip(("cold", "warm"), runs):
        res.figure(f"{model} {label}: engine ready", r["total_s"], "s")
        res.figure(f"{model} {label}: process (interpreter, imports, engine, probe request)", r["process_wall_s"], "s")
        res.figure(f"{model} {label}: compile", r["compile_s"], "s")
        peak = r.get("peak_bytes_in_use")
        rows.append([label, r["total_s"], r["process_wall_s"], r["load_s"], r["init_s"], r["compile_s"],
                     r["warmup_s"], r["executables"], r["cache_hits"], r.get("background_compile_s"),
                     r["probe_first_token_s"], None if peak is None else peak / 2**30])
    res.table(f"{model} start-up (benchmarks.probes.startup: two fresh processes, one compilation cache, empty before "
              "the first)",
              ["run", "ready s", "process s", "load s", "init s", "compile s", "warm-up s", "executables",
               "cache hits", "background s", "first token s", "peak GiB"], rows)


def part_startup_small(cfg: ReportConfig, res: Result, **_: Any) -> None:
    _startup(cfg, res, cfg.small_model)


def part_startup_large(cfg: ReportConfig, res: Result, **_: Any) -> None:
    _startup(cfg, res, cfg.large_model)


# ----------------------------------------------------------------------------------------------- 6. engine loop


def part_loop(cfg: ReportConfig, res: Result, rates: dict | None, **_: Any) -> None:
    from benchmarks.probes.loop_cost import measure
    from benchmarks.probes.loop_timing import LoopBenchConfig

    rates = get_rates(cfg, rates, res)
    lc = LoopBenchConfig(model=cfg.small_model, dtype=cfg.dtype, token_budget=cfg.loop_token_budget,
                         max_num_seqs=max(cfg.loop_batches) + 2, batches=tuple(cfg.loop_batches),
                         workloads=("decode",), context=cfg.loop_context, prompt_len=cfg.loop_context,
                         steps=cfg.loop_steps, rounds=cfg.loop_rounds, attention_backend="auto",
                         matmul_rate=rates.matmul_flops, bandwidth=rates.bandwidth)
    doc = measure(lc, log=lambda m: print(m, flush=True))
    res.doc["info"].update(engine=doc["engine"], platform=doc["platform"],
                           decode_tokens_agree=doc["decode_tokens_agree"])
    rows = []
    for r in doc["rows"]:
        floor, basis = max(r["compute_floor_s"], r["memory_floor_s"]), (
            "bytes" if r["memory_floor_s"] >= r["compute_floor_s"] else "FLOPs")
        name = f"{r['batch']} decodes, {r['loop']} loop"
        res.figure(f"{name}: wall per step", r["wall_mean_s"], "s", floor, basis)
        res.figure(f"{name}: device per step", r["device_s"], "s", floor, basis)
        res.figure(f"{name}: device busy fraction", r["device_busy_fraction"], "fraction")
        rows.append([r["batch"], r["loop"], r["wall_mean_s"] * 1e3, r["device_s"] * 1e3, r["device_busy_fraction"],
                     r["host_exposed_s"] * 1e3, r["host_cpu_s"] * 1e3, r["memory_floor_s"] * 1e3,
                     r["compute_floor_s"] * 1e3, r["x_floor"], r.get("ratio_mean"), r["compilations_during_timing"]])
    res.doc["rows"] = doc["rows"]
    res.table(f"decode steps at ctx {cfg.loop_context} (benchmarks.probes.loop_cost; busy = replayed device time / wall)",
              ["decodes", "loop", "wall ms", "device ms", "busy", "host ms", "host CPU ms", "bytes floor ms",
               "FLOP floor ms", "x floor", "async / sync", "compiles while timed"], rows)


# ----------------------------------------------------------------------------------------------- 7. quantized weights


def part_quantized(cfg: ReportConfig, res: Result, rates: dict | None, **_: Any) -> None:
    """Decode steps of the large model with its layer weights in `cfg.dtype`, int8 and fp8 (each its own engine,
    timed in alternation by `benchmarks.probes.out_major_steps.alternate`); fp8 where the GPU has FP8 matmul,
    else its refusal is recorded."""
    import statistics

    from benchmarks.probes.out_major_steps import _with, alternate
    from sarathi_jax.bench.roofline import ModelShape, work
    from sarathi_jax.bench.step_cost import parse_args
    from sarathi_jax.bench.step_timer import build_engine, compositions, engine_needs

    rates = get_rates(cfg, rates, res)
    b, ctx = cfg.profile_batch, cfg.profile_context
    blocks = b * (-(-(ctx + 1) // 16)) + 16  # the fake sequences' blocks, and no more: three engines share the device
    args = parse_args(["--model", cfg.large_model, "--dtype", cfg.dtype, "--mode", "decode", "--batch-sizes", str(b),
                       "--context", str(ctx), "--repeats", str(cfg.quant_repeats), "--num-blocks", str(blocks)])
    comps = compositions("decode", args)
    needs = engine_needs(comps)
    engines = {}
    for quantization in (None, "int8", "fp8"):
        try:
            engines[quantization or cfg.dtype] = build_engine(_with(args, quantization=quantization), needs)
        except ValueError as e:  # fp8 off FP8 GPUs
            res.doc["info"][f"{quantization} refused"] = str(e)
            print(f"{quantization}: {e}", flush=True)
    times = alternate(engines, comps, args)
    base = statistics.median(times[(cfg.dtype, 0)])
    rows = []
    for name, engine in engines.items():
        step = statistics.median(times[(name, 0)])
        w = work(ModelShape.from_model_config(engine.model_config, cfg.dtype), comps[0].steps[0])
        floor, basis, _, _ = floor_of(w.flops, w.bytes, rates)
        res.figure(f"{name} weights: decode x{b} at ctx {ctx}, step", step, "s", floor, basis)
        res.figure(f"{name} weights: step / {cfg.dtype} step", step / base, "ratio")
        rows.append([name, engine.startup_stats()["weight_bytes"] / 2**30, step * 1e3, min(times[(name, 0)]) * 1e3,
                     floor * 1e3, step / floor, step / base])
        res.save()
    res.table(f"{cfg.large_model} decode x{b} at ctx {ctx}, median and best of {cfg.quant_repeats} alternated repeats",
              ["weights", "weight GiB", "median ms", "best ms", "floor ms", "x floor", f"/ {cfg.dtype}"], rows)


def part_cost_model(cfg: ReportConfig, res: Result, out: str, rates: dict | None, **_: Any) -> None:
    """The simulator's cost model of the large model on this device (`step_cost --mode calibrate` at the paper's
    larger token budget) into `DIR/cost_model.json`: `python -m benchmarks.gpu_capacity --simulate --cost-model
    DIR/cost_model.json` runs the paper's capacity grid on it on any machine. Beside it, the fit's error over
    the calibration batches and the decode iteration behind the paper's SLOs (batch 32 at context 4096) with its
    floor."""
    import statistics

    from sarathi_jax.bench.roofline import ModelShape, work
    from sarathi_jax.bench.step_cost import main as step_cost
    from sarathi_jax.models import load_model_config
    from sarathi_jax.sim.cost_model import BucketCostModel, Chunk

    rates = get_rates(cfg, rates, res)
    path, doc_path = os.path.join(out, "cost_model.json"), os.path.join(out, "cost_model_calibration.json")
    argv = ["--mode", "calibrate", "--model", cfg.large_model, "--dtype", cfg.dtype, "--token-budget",
            str(cfg.grid_token_budget), "--max-num-seqs", str(cfg.grid_max_num_seqs), "--max-model-len",
            str(2 * cfg.grid_decode_context), "--calib-contexts", f"128,512,{cfg.grid_decode_context}",
            "--cost-model-out", path,
            "--json", doc_path, "--quiet"]
    res.doc["info"]["command"] = "python -m sarathi_jax.bench.step_cost " + " ".join(argv)
    if step_cost(argv) != 0:
        raise RuntimeError("step_cost --mode calibrate failed")
    model = BucketCostModel.load(path)
    res.doc["info"]["cost_model"] = model.to_dict()
    with open(doc_path) as f:
        rows = [r for r in json.load(f)["rows"] if "fit_s" in r]
    errors = [abs(r["fit_s"] / r["time_s"] - 1) for r in rows]
    res.figure("cost model fit: median |error| over the calibration batches", statistics.median(errors), "ratio")
    res.figure("cost model fit: largest |error|", max(errors), "ratio")
    batch, ctx = cfg.grid_decode_batch, cfg.grid_decode_context
    decode = [Chunk(ctx, 1)] * batch
    shape = ModelShape.from_model_config(load_model_config(cfg.large_model), cfg.dtype)
    w = work(shape, decode)
    floor, basis, _, _ = floor_of(w.flops, w.bytes, rates)
    res.figure(f"cost model: decode x{batch} at ctx {ctx} (the SLOs' reference)", model.chunks_time(decode), "s",
               floor, basis)
    res.save()


PARTS: dict[str, Callable[..., None]] = {
    "machine": part_machine, "tune": part_tune, "attention": part_attention, "profile_large": part_profile_large,
    "profile_small": part_profile_small, "startup_small": part_startup_small, "startup_large": part_startup_large,
    "loop": part_loop, "quantized": part_quantized, "cost_model": part_cost_model,
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("part", choices=sorted(PARTS))
    p.add_argument("--out", required=True)
    p.add_argument("--result", required=True)
    p.add_argument("--config", required=True, help="JSON: {'config': ReportConfig fields, 'rates': {...} or null}")
    p.add_argument("--inject", choices=("fail", "hang"), default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    given = json.loads(args.config)
    cfg = ReportConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in given["config"].items()})
    res = Result(args.result)
    res.save()
    if args.inject == "fail":
        raise RuntimeError(f"injected failure in part {args.part!r} (--inject)")
    if args.inject == "hang":
        time.sleep(3600)
    PARTS[args.part](cfg, res, out=args.out, rates=given.get("rates"))
    res.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
