"""`python -m benchmarks.probes.loop_cost`: the synchronous and the overlapped engine loop, side by side.

It drives the real engine (`LLMEngine`, sarathi scheduler, the model runner) twice in one process: one engine
with `EngineConfig(async_scheduling=False)` (dispatch, wait, postprocess) and one with `async_scheduling=True`
(batch N+1 is scheduled and dispatched before batch N's tokens are fetched; see sarathi_jax/core/engine_core.py).
Both get the same requests.

Workloads, per `--batch` size B:
  decode  B greedy requests (ignore_eos, max_tokens up to max_model_len) with `--context`-token prompts,
          stepped until every one is decoding; then every timed step is B decodes.
  mixed   the same decodes, plus a stream of `--prompt-len`-token prompts (max_tokens=1): one is added before
          a step whenever the waiting queue is empty, so every timed step carries B decodes and a prefill
          chunk that fills the token budget (checked: `prefill_tokens_per_step` in the JSON).

Timing. Wall: `time.perf_counter()` around each `engine.step()` call; request admission happens outside it.
Rounds are interleaved so that load from other processes hits both loops alike: each of `--rounds` rounds
runs a block of `--steps` K timed steps on each engine (the order alternates every round: sync-async,
async-sync, ...). Each block starts with one untimed lead-in step: the overlapped engine still holds a batch
that completed on the device while the other engine ran, and retiring it would cost nothing, which would
flatter the first step of the block. Reported: mean and p50 over the R x K steps, and the median over
rounds of the per-round ratio overlapped / synchronous (paired, so less noisy than the ratio of the means).

Device time: the runner's steps are observed (`ModelRunner.observe_steps`) to keep the packed int32 inputs,
the sampler variant and the chunk layout of the last K dispatched steps. Right after the timed blocks of a
round, each engine replays its block's K steps (`ModelRunner.dispatch_outside_loop`, off the pipeline
timeline): `--replays` M dispatches back to back (cycling over the K steps), one wait at the end; device
ms per step = time / M, median over the rounds. Measured in the same round as the wall times it is compared
with, so that drifting background load hits both. A plain replay would write stale K/V into live sequences'
slots and feed its own samples to the next real step's pending tokens, so the replays are shadowed
(`benchmarks.probes.step_replay.ShadowReplayer`): the copies' K/V writes go to scratch blocks reserved from the engine's
block manager (the attention still reads the real block tables, so the work is the same) and the runner's previous
sampled tokens are restored afterwards. `decode_tokens_agree` in the JSON checks it: greedy decodes of both loops
must produce the same tokens. On a CPU "device" means XLA:CPU's threads, which share the cores with the host
thread. Between batch sizes every request is aborted and drained; the engines are reused (compiled once).

Derived: device busy fraction = device / wall mean, per round, median over rounds; host ms exposed = wall
mean - device; host ms per step hidden by the overlap = sync wall mean - async wall mean. Also the host CPU
time per step: `time.thread_time()` of the thread calling `engine.step()` (what the overlap can hide at
most; unlike wall differences it barely moves with background load, which on a shared machine swamps
differences of a few ms).

Floors (`sarathi_jax.bench.roofline`): this machine's matmul rate and memory bandwidth (best of
`--rate-repeats`, measured before and after the timed phases, the better kept), and for each replayed step
`roofline.work` (FLOPs: 2 x matmul params x tokens + LM head x sampled rows + attention; bytes: weights +
KV read + KV written): compute floor = FLOPs / matmul rate, memory floor = bytes / bandwidth, averaged over
the K steps; `x floor` = wall / max(floors).

Checks recorded in the JSON: `engine.core.num_in_flight` after every timed step (overlapped: 1, sync: 0),
compilations during the timed phases (0: every bucket was compiled by warm-up), decodes per timed step (= B).

The engines, workloads and timed rounds are in `benchmarks.probes.loop_timing`, the step capture and shadowed replay in
`benchmarks.probes.step_replay`; this module turns the timings into the rows, the table and the JSON document.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict

import numpy as np

from benchmarks.probes.loop_timing import (
    LOOPS,
    WORKLOADS,
    LoopBenchConfig,
    LoopTimes,
    build_engines,
    engine_size,
    run_batch,
)
from sarathi_jax.bench.roofline import (ModelShape, Rates, best_rates, floors, measure_rates_and_log, num_params,
                                               work)
from sarathi_jax.bench.step_cost import fmt_ms, positive_ints
from sarathi_jax.utils.paths import cli_path


# ----------------------------------------------------------------------------------------------- results


def _pct(xs: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q))


def cell_row(workload: str, batch: int, loop: str, t: LoopTimes, shape: ModelShape, rates: Rates,
             replays: int) -> dict:
    works = [work(shape, s.chunks) for s in t.captured]
    fl = [floors(w, rates) for w in works]
    wall = statistics.fmean(t.wall_s)
    device = statistics.median(t.device_s)
    busy = [dev / w for dev, w in zip(t.device_s, t.round_means_s)]  # paired within each round
    compute_floor = statistics.fmean(f[0] for f in fl)
    memory_floor = statistics.fmean(f[1] for f in fl)
    return {
        "workload": workload, "batch": batch, "loop": loop,
        "num_timed_steps": len(t.wall_s),
        "wall_mean_s": wall, "wall_p50_s": statistics.median(t.wall_s), "wall_p90_s": _pct(t.wall_s, 90),
        "wall_min_s": min(t.wall_s), "wall_s": t.wall_s, "round_means_s": t.round_means_s,
        "device_s": device, "device_per_round_s": t.device_s, "replays_per_round": replays,
        "device_busy_fraction": statistics.median(busy), "device_busy_per_round": busy,
        "host_exposed_s": wall - device,
        "host_cpu_s": statistics.fmean(t.thread_s), "host_cpu_per_step_s": t.thread_s,
        "tokens_per_step": statistics.fmean(s.num_tokens for s in t.captured),
        "decodes_per_step": statistics.fmean(s.num_decodes for s in t.captured),
        "prefill_tokens_per_step": [s.prefill_tokens for s in t.captured],
        "flops_per_step": statistics.fmean(w.flops for w in works),
        "bytes_per_step": statistics.fmean(w.bytes for w in works),
        "weight_bytes": works[0].weight_bytes,
        "kv_read_bytes_per_step": statistics.fmean(w.kv_read_bytes for w in works),
        "compute_floor_s": compute_floor, "memory_floor_s": memory_floor,
        "x_floor": wall / max(compute_floor, memory_floor),
        "in_flight_after_step": sorted(set(t.in_flight)),
        "in_flight_ok": set(t.in_flight) == {1 if LOOPS[loop] else 0},
        "compilations_during_timing": t.compilations,
    }


def add_comparison(rows: list[dict]) -> None:
    """On each async row: the host time hidden by the overlap and the async / sync ratios."""
    by_key = {(r["workload"], r["batch"], r["loop"]): r for r in rows}
    for r in rows:
        if r["loop"] != "async":
            continue
        s = by_key[(r["workload"], r["batch"], "sync")]
        r["hidden_host_s"] = s["wall_mean_s"] - r["wall_mean_s"]
        r["ratio_mean"] = r["wall_mean_s"] / s["wall_mean_s"]
        r["ratio_p50"] = r["wall_p50_s"] / s["wall_p50_s"]
        per_round = [a / b for a, b in zip(r["round_means_s"], s["round_means_s"])]
        r["ratio_per_round"] = per_round
        r["ratio_round_median"] = statistics.median(per_round)
        r["ratio_round_median_ci95"] = bootstrap_ci(per_round, statistics.median)


def bootstrap_ci(xs: Sequence[float], stat: Callable[[Sequence[float]], float], n: int = 2000,
                 seed: int = 0) -> list[float]:
    """A 95% percentile-bootstrap interval of `stat` over `xs` (rounds resampled with replacement)."""
    rng = np.random.default_rng(seed)
    arr = np.asarray(xs, dtype=np.float64)
    boots = [stat(list(arr[rng.integers(0, len(arr), len(arr))])) for _ in range(n)]
    return [float(np.percentile(boots, 2.5)), float(np.percentile(boots, 97.5))]


def platform_info() -> dict:
    import jax

    dev = jax.devices()[0]
    return {"jax": jax.__version__, "backend": jax.default_backend(), "device": str(dev),
            "device_kind": dev.device_kind, "num_devices": jax.device_count(), "cpu_count": os.cpu_count()}


def measure(cfg: LoopBenchConfig, log: Callable[[str], None] = print) -> dict:
    """Run every batch size on one pair of engines; returns the JSON document."""
    info = platform_info()
    log(f"JAX {info['jax']} on {info['backend']}: {info['device']} ({info['device_kind']}), "
        f"{info['cpu_count']} CPUs")
    size = engine_size(cfg)

    rates_now = functools.partial(measure_rates_and_log, log, cfg.dtype, cfg.matmul_n, cfg.bandwidth_mb,
                                  cfg.rate_repeats, cfg.matmul_rate, cfg.bandwidth)

    before = rates_now()
    engines = build_engines(cfg, size, log)
    any_engine = engines["sync"].engine
    shape = ModelShape.from_model_config(any_engine.model_config, cfg.dtype)
    cells, checks = {}, {}
    for b in cfg.batches:
        cells[b], checks[b] = run_batch(engines, cfg, size, b, log)
    rates = best_rates(before, rates_now())

    rows = [cell_row(w, b, loop, t, shape, rates, cfg.num_replays)
            for b, by_workload in cells.items() for w, by_loop in by_workload.items() for loop, t in by_loop.items()]
    add_comparison(rows)
    rows.sort(key=lambda r: (WORKLOADS.index(r["workload"]), r["batch"], list(LOOPS).index(r["loop"])))
    return {
        "tool": "benchmarks.probes.loop_cost",
        "config": {**asdict(cfg), "batches": list(cfg.batches)},
        "platform": info,
        "engine": {"model": cfg.model, "dtype": cfg.dtype, "num_params": num_params(any_engine.runner.params),
                   "token_budget": cfg.token_budget, "buckets": list(any_engine.runner.buckets),
                   "max_num_seqs": cfg.num_seqs, "max_model_len": size.max_model_len,
                   "num_blocks": size.num_blocks, "block_size": cfg.block_size,
                   "attention_backend": cfg.attention_backend},
        "rates": {"matmul_flops_per_s": rates.matmul_flops, "bandwidth_bytes_per_s": rates.bandwidth,
                  **rates.details},
        "rows": rows,
        "decode_tokens_agree": {str(b): c for b, c in checks.items()},
    }


# ----------------------------------------------------------------------------------------------- output


def _table(header: list[str], rows: list[list[str]], left: int = 3) -> str:
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    lines = [header, ["-" * w for w in widths], *rows]
    return "\n".join("  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
                     for line in lines)


def format_table(doc: dict) -> str:
    e, r_ = doc["engine"], doc["rates"]
    c = doc["config"]
    head = (f"{e['model']} ({e['num_params'] / 1e6:.1f}M params, {e['dtype']}), token budget {e['token_budget']}, "
            f"max_num_seqs {e['max_num_seqs']}, context {c['context']}, mixed prompts {c['prompt_len']} tokens; "
            f"{c['rounds']} interleaved rounds x {c['steps']} steps per loop; matmul "
            f"{r_['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s, bandwidth {r_['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s")
    header = ["workload", "batch", "loop", "tok/step", "wall mean ms", "wall p50 ms", "device ms", "busy",
              "host ms", "host CPU ms", "hidden ms", "async/sync", "per round [95% CI]", "compute floor ms",
              "memory floor ms", "x floor", "in flight"]
    table = []
    for r in doc["rows"]:
        is_async = r["loop"] == "async"
        table.append([
            r["workload"], str(r["batch"]), r["loop"], f"{r['tokens_per_step']:.0f}",
            fmt_ms(r["wall_mean_s"]), fmt_ms(r["wall_p50_s"]), fmt_ms(r["device_s"]),
            f"{r['device_busy_fraction']:.0%}", fmt_ms(r["host_exposed_s"]), fmt_ms(r["host_cpu_s"]),
            fmt_ms(r["hidden_host_s"]) if is_async else "",
            f"{r['ratio_mean']:.3f}" if is_async else "",
            (f"{r['ratio_round_median']:.3f} [{r['ratio_round_median_ci95'][0]:.2f}, "
             f"{r['ratio_round_median_ci95'][1]:.2f}]") if is_async else "",
            f"{r['compute_floor_s'] * 1e3:.3g}", f"{r['memory_floor_s'] * 1e3:.3g}", f"{r['x_floor']:.1f}",
            ",".join(map(str, r["in_flight_after_step"])),
        ])
    notes = "\n".join([
        "busy = device / wall mean (per round, median); host ms = wall mean - device; "
        "host CPU ms = CPU time of the thread calling engine.step() (time.thread_time);",
        "hidden ms = sync wall mean - async wall mean; async/sync = ratio of wall means; per round = median over "
        "rounds of the",
        "async / sync ratio of the round's wall means (bootstrap 95% interval); in flight = "
        "engine.core.num_in_flight after the timed steps",
    ])
    return "\n".join([head, _table(header, table), notes])


# ----------------------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    d = LoopBenchConfig()
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.probes.loop_cost",
        description="Wall time per engine.step() of the synchronous and the overlapped engine loop, side by "
                    "side, with the device time of the same steps and the machine's compute and memory floors.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", default=d.model, help="preset (tiny-llama, llama-50m) or an HF checkpoint folder")
    p.add_argument("--dtype", default=d.dtype, choices=("float32", "bfloat16"))
    p.add_argument("--token-budget", type=int, default=d.token_budget)
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="raised to the largest batch + 2")
    p.add_argument("--batch", type=positive_ints, default=d.batches, help="comma-separated decode batch sizes")
    p.add_argument("--workloads", default=",".join(d.workloads), help=f"comma-separated, from {', '.join(WORKLOADS)}")
    p.add_argument("--context", type=int, default=d.context, help="prompt tokens of each decode request")
    p.add_argument("--prompt-len", type=int, default=d.prompt_len, help="mixed workload: new prompts' length")
    p.add_argument("--steps", type=int, default=d.steps, help="K: timed steps per loop per round")
    p.add_argument("--rounds", type=int, default=d.rounds, help="R: interleaved rounds")
    p.add_argument("--replays", type=int, default=None, help="M: dispatches per device replay round (default K)")
    p.add_argument("--attention-backend", default=d.attention_backend, choices=("auto", "xla", "pallas", "cpu"))
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--matmul-rate", type=float, default=None, help="FLOP/s to use instead of measuring")
    p.add_argument("--bandwidth", type=float, default=None, help="bytes/s to use instead of measuring")
    p.add_argument("--rate-repeats", type=int, default=d.rate_repeats)
    p.add_argument("--json", type=cli_path, default=None, metavar="PATH")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return p


def config_from_args(args: argparse.Namespace) -> LoopBenchConfig:
    return LoopBenchConfig(
        model=args.model, dtype=args.dtype, token_budget=args.token_budget, max_num_seqs=args.max_num_seqs,
        batches=tuple(args.batch), workloads=tuple(w.strip() for w in args.workloads.split(",") if w.strip()),
        context=args.context, prompt_len=args.prompt_len, steps=args.steps,
        rounds=args.rounds, replays=args.replays, attention_backend=args.attention_backend, seed=args.seed,
        matmul_rate=args.matmul_rate, bandwidth=args.bandwidth, rate_repeats=args.rate_repeats,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg = config_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    log: Callable[[str], None] = ((lambda msg: None) if args.quiet
                                  else (lambda msg: print(msg, file=sys.stderr, flush=True)))
    info = platform_info()
    print(f"JAX platform: {info['backend']}, device: {info['device']} ({info['device_kind']})", flush=True)
    doc = measure(cfg, log)
    doc["argv"] = list(argv) if argv is not None else sys.argv[1:]
    print(format_table(doc))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
