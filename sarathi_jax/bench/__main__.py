"""`python -m sarathi_jax.bench`: run scheduler configurations on the same requests and compare them.

With no arguments: the built-in tiny-llama preset under the sarathi scheduler, a short synthetic Poisson
workload, real time, printing TTFT, TBT and throughput (under a minute on a 2-core CPU, compile included).
Run `python -m sarathi_jax.bench --help` for the options.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from sarathi_jax.bench.capacity import DEFAULT_MAX_SCHED_DELAY, CapacityResult, find_capacity
from sarathi_jax.bench.driver import RunResult, engine_vocab_size, measure_decode_iteration_time, run_workload
from sarathi_jax.bench.engines import make_llm_engine, make_simulated_engine
from sarathi_jax.bench.metrics import DEFAULT_STALL_FACTOR, fmt_seconds, summarize
from sarathi_jax.bench.plots import write_plots  # matplotlib itself loads only when plotting
from sarathi_jax.bench.report import format_table, write_run, write_summary
from sarathi_jax.bench.workload import (ARRIVAL_PROCESSES, Workload, as_conversations, synthetic_workload,
                                        trace_workload, with_shared_prefix)
from sarathi_jax.config import ACCELERATOR_PLATFORMS, DTYPES, EngineConfig
from sarathi_jax.models.presets import LLAMA2_VOCAB_SIZE
from sarathi_jax.scheduler.registry import SCHEDULER_POLICIES, TOKEN_BUDGET_POLICIES, WHOLE_PROMPT_POLICIES

CPU_DEFAULT_MODEL = "tiny-llama"
ACCELERATOR_DEFAULT_MODEL = "llama-1b"  # a GPU-sized preset: tiny-llama would measure launch overhead only
DEFAULT_SCHEDULERS = "sarathi"
DEFAULT_TOKEN_BUDGETS = "128"
DEFAULT_NUM_REQUESTS = 24
DEFAULT_QPS = 2.0
# Engine settings the bench passes unless told otherwise: the engine's own defaults (128 sequences, the
# model's full 4096-token context) pad every step to far more attention work than a CPU run needs.
DEFAULT_MAX_NUM_SEQS = 32
DEFAULT_MAX_MODEL_LEN = 1024
DEFAULT_PROMPT_LEN = "uniform:64:384"
DEFAULT_OUTPUT_LEN = "uniform:16:64"


class BenchError(Exception):
    """A usage or setup problem, reported as one line without a traceback."""


def _csv_list(text: str, kind: Callable[[str], Any], name: str) -> list:
    items = [x.strip() for x in str(text).split(",") if x.strip()]
    if not items:
        raise BenchError(f"{name}: empty list")
    try:
        return [kind(x) for x in items]
    except ValueError:
        raise BenchError(f"{name}: could not parse {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m sarathi_jax.bench",
        description="Benchmark sarathi-jax schedulers on the same requests: latency (TTFT, TBT), throughput, "
                    "stalls, and optionally capacity under SLOs.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("engine configurations (every scheduler x token budget is one run)")
    g.add_argument("--model", default=None,
                   help=f"preset name or HF checkpoint folder (default: {ACCELERATOR_DEFAULT_MODEL} on a GPU or "
                        f"TPU, {CPU_DEFAULT_MODEL} elsewhere)")
    g.add_argument("--scheduler", default=DEFAULT_SCHEDULERS,
                   help=f"comma-separated policies from {', '.join(SCHEDULER_POLICIES)}")
    g.add_argument("--token-budget", default=DEFAULT_TOKEN_BUDGETS,
                   help="comma-separated token budgets; policies that never split prompts "
                        f"({', '.join(WHOLE_PROMPT_POLICIES)}) run once, with the largest")
    g.add_argument("--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS,
                   help="EngineConfig.max_num_seqs (0: the engine's default, min(128, the token budget))")
    g.add_argument("--max-model-len", type=int, default=DEFAULT_MAX_MODEL_LEN,
                   help="EngineConfig.max_model_len (0: the engine's default, the model's limit); "
                        "longer requests are scaled down to fit")
    g.add_argument("--block-size", type=int, default=None)
    g.add_argument("--num-blocks", type=int, default=None)
    g.add_argument("--kv-cache-bytes", type=int, default=None)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--tile-size", type=int, default=None)
    g.add_argument("--dtype", default=None, choices=DTYPES, help="EngineConfig.dtype (default auto: bfloat16 "
                   "on GPU and TPU, float32 on CPU)")
    g.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="F",
                   help="EngineConfig.gpu_memory_utilization: fraction of the device's memory the engine may use "
                        "(default 0.9, at most JAX's XLA_CLIENT_MEM_FRACTION); the KV cache gets the rest")
    g.add_argument("--attention-backend", default="auto", choices=("auto", "xla", "pallas"),
                   help="auto: pallas on GPU, xla elsewhere")
    g.add_argument("--compilation-cache-dir", default=None, metavar="PATH",
                   help="EngineConfig.compilation_cache_dir: JAX's persistent compilation cache, or 'off' "
                        "(default: $SARATHI_JAX_COMPILATION_CACHE, else ~/.cache/sarathi-jax/jax)")
    g.add_argument("--engine-seed", type=int, default=None, help="EngineConfig.seed (preset weights)")
    g.add_argument("--tensor-parallel-size", type=int, default=None, help="EngineConfig.tensor_parallel_size")
    g.add_argument("--pipeline-parallel-size", type=int, default=None,
                   help="EngineConfig.pipeline_parallel_size; the bubble fraction of each run is printed")
    g.add_argument("--async-scheduling", default=None, action=argparse.BooleanOptionalAction,
                   help="EngineConfig.async_scheduling: overlap host work with the device (default on)")
    g.add_argument("--prefix-caching", default="off",
                   help="EngineConfig.enable_prefix_caching: off, on, or off,on to compare both on the same "
                        "requests (off by default here, as in the paper's systems; the engine's default is on)")
    g.add_argument("--simulate", action="store_true",
                   help="use SimulatedEngine (real schedulers, cost model, virtual clock) instead of LLMEngine")
    g.add_argument("--cost-model", default=None, metavar="PATH",
                   help="--simulate: a cost model calibrated on the real runner (JSON written by "
                        "`python -m sarathi_jax.bench.step_cost --mode calibrate --cost-model-out PATH`) "
                        "instead of the simulator's default")
    g.add_argument("--endpoint", default=None, metavar="HOST:PORT",
                   help="drive a running server through server/loadgen.py instead of an in-process engine: "
                        "HOST:PORT (gRPC) or http://HOST:PORT (the OpenAI-compatible HTTP API)")

    w = p.add_argument_group("workload")
    w.add_argument("--trace", default=None, metavar="PATH",
                   help="CSV with num_prefill_tokens, num_decode_tokens and optionally arrived_at")
    w.add_argument("--sample", type=int, default=None, metavar="N",
                   help="use N trace rows (a contiguous window when the trace has arrival times, else random rows)")
    w.add_argument("--num-requests", type=int, default=None, metavar="N",
                   help=f"synthetic requests (default {DEFAULT_NUM_REQUESTS}); with --trace, same as --sample")
    w.add_argument("--qps", type=float, default=None,
                   help=f"arrival rate, req/s (synthetic default {DEFAULT_QPS}); with --trace it replaces "
                        "the trace's arrival times with --arrival")
    w.add_argument("--arrival", default=None, choices=[a for a in ARRIVAL_PROCESSES if a != "offline"],
                   help="arrival process (default: the trace's own times when it has them, else poisson)")
    w.add_argument("--cv", type=float, default=1.0, help="coefficient of variation of gamma inter-arrival gaps")
    w.add_argument("--prompt-len", default=DEFAULT_PROMPT_LEN,
                   help="N | uniform:LO:HI | zipf:THETA:LO:HI | trace:PATH")
    w.add_argument("--output-len", default=DEFAULT_OUTPUT_LEN,
                   help="N | uniform:LO:HI | zipf:THETA:LO:HI | trace:PATH")
    w.add_argument("--length-scale", type=float, default=1.0,
                   help="multiply prompt and output lengths (rounded, >= 1); requests that still exceed "
                        "max_model_len are scaled down proportionally to fit")
    w.add_argument("--rate-scale", type=float, default=1.0, help="multiply the arrival rate")
    w.add_argument("--offline", action="store_true", help="all requests at t=0 (throughput)")
    w.add_argument("--seed", type=int, default=0, help="workload seed (lengths, arrivals, sampled rows, prompts)")
    w.add_argument("--prompts-file", default=None, metavar="PATH",
                   help="real text prompts, one per line (request i sends line i mod the line count), rendered "
                        "with the model's chat template as a user turn when it has one; the model folder needs a "
                        "tokenizer. Requests stop at EOS (at most the workload's output length) and the first "
                        "completion is printed")
    w.add_argument("--shared-prefix-len", type=int, default=0, metavar="N",
                   help="every prompt starts with the same N tokens (a system prompt), then its own prompt length")
    w.add_argument("--multi-turn", type=int, default=1, metavar="K",
                   help="group requests into K-turn conversations: turn i re-sends turns 1..i-1 (prompts and "
                        "replies as long as their outputs) before its own prompt")
    w.add_argument("--temperature", type=float, default=0.0)

    s = p.add_argument_group("SLOs and capacity")
    s.add_argument("--slo-ttft", type=float, default=None, help="TTFT SLO (s) for goodput")
    s.add_argument("--slo-tbt", type=float, default=None, help="TBT SLO (s), for goodput and capacity")
    s.add_argument("--slo-tbt-multiple", type=float, default=None, metavar="M",
                   help="TBT SLO as M x the measured decode-only iteration time (paper: 5 strict, 25 relaxed)")
    s.add_argument("--decode-probe-batch", type=int, default=8,
                   help="decode batch size for measuring the decode-only iteration time")
    s.add_argument("--capacity", action="store_true",
                   help="binary-search the highest QPS with P99 TBT <= SLO and median scheduling delay <= limit")
    s.add_argument("--max-sched-delay", type=float, default=DEFAULT_MAX_SCHED_DELAY,
                   help="capacity: median scheduling delay limit (s)")
    s.add_argument("--capacity-probes", type=int, default=8, help="capacity: most runs per configuration")
    s.add_argument("--capacity-tol", type=float, default=0.05, help="capacity: relative tolerance")
    s.add_argument("--capacity-start-qps", type=float, default=None,
                   help="capacity: first rate probed (default: the workload's rate)")
    s.add_argument("--stall-factor", type=float, default=DEFAULT_STALL_FACTOR,
                   help="a stall is a TBT above this many times the run's median TBT")

    o = p.add_argument_group("output")
    o.add_argument("--out", default=None, metavar="DIR",
                   help="write JSON and CSV per run, summary.csv/json and PNG plots here")
    o.add_argument("--no-plots", action="store_true", help="skip the PNGs")
    o.add_argument("--quiet", action="store_true", help="no progress bars or progress lines")
    return p


# ----------------------------------------------------------------------------------------------- setup


def default_model(platform: str) -> str:
    """The bench's model when --model is not given, for `jax.default_backend()`'s platform."""
    return ACCELERATOR_DEFAULT_MODEL if platform in ACCELERATOR_PLATFORMS else CPU_DEFAULT_MODEL


def run_configs(args: argparse.Namespace) -> list[dict]:
    schedulers = _csv_list(args.scheduler, str, "--scheduler")
    budgets = _csv_list(args.token_budget, int, "--token-budget")
    for s_ in schedulers:
        if s_ not in SCHEDULER_POLICIES:
            raise BenchError(f"--scheduler: unknown policy {s_!r}; choose from {', '.join(SCHEDULER_POLICIES)}")
    caching = _csv_list(args.prefix_caching, str, "--prefix-caching")
    if any(c not in ("off", "on") for c in caching):
        raise BenchError(f"--prefix-caching: expected off, on or off,on, got {args.prefix_caching!r}")
    configs = []
    for s_ in dict.fromkeys(schedulers):
        runs = [(f"{s_}-{b}", b) for b in dict.fromkeys(budgets)] if s_ in TOKEN_BUDGET_POLICIES else [(s_, max(budgets))]
        for label, b in runs:
            for c in dict.fromkeys(caching):
                configs.append({"label": label + ("+prefix" if c == "on" else ""), "scheduler": s_,
                                "token_budget": b, "prefix_caching": c == "on"})
    return configs


def engine_config_kwargs(args: argparse.Namespace, cfg: dict) -> dict:
    kw = {"model": args.model, "scheduler": cfg["scheduler"], "token_budget": cfg["token_budget"],
          "enable_prefix_caching": cfg.get("prefix_caching", False)}
    for name in ("max_num_seqs", "max_model_len", "block_size", "num_blocks", "kv_cache_bytes", "gpu_memory_utilization",
                 "max_num_batched_tokens", "tile_size", "dtype", "attention_backend",
                 "tensor_parallel_size", "pipeline_parallel_size", "async_scheduling", "compilation_cache_dir"):
        v = getattr(args, name)
        if v is not None and not (name in ("max_num_seqs", "max_model_len") and v == 0):
            kw[name] = v
    if args.engine_seed is not None:
        kw["seed"] = args.engine_seed
    return kw


def default_engine_factory(simulate: bool, cost_model_path: str | None = None) -> Callable[[dict], Any]:
    cost_model = None
    if cost_model_path:
        from sarathi_jax.cost_model import BucketCostModel

        try:
            cost_model = BucketCostModel.load(cost_model_path)
        except (OSError, KeyError, TypeError, json.JSONDecodeError) as e:
            raise BenchError(f"--cost-model {cost_model_path}: {type(e).__name__}: {e}") from None

    def make(kwargs: dict) -> Any:
        config = EngineConfig(**kwargs)
        return make_simulated_engine(config, cost_model=cost_model) if simulate else make_llm_engine(config)

    return make


def build_workload(args: argparse.Namespace) -> Workload:
    offline = args.offline
    if offline and args.capacity:
        raise BenchError("--capacity needs arrivals over time; drop --offline")
    if args.trace:
        if args.num_requests is not None and args.sample is not None and args.num_requests != args.sample:
            raise BenchError("--num-requests and --sample disagree; with --trace use --sample")
        sample = args.sample if args.sample is not None else args.num_requests
        arrival = "offline" if offline else args.arrival
        from sarathi_jax.bench.traces import load_trace

        trace = load_trace(args.trace)
        qps = args.qps
        if args.capacity and qps is None and (trace.arrivals is None or arrival not in (None, "trace")):
            qps = 1.0  # any rate: the capacity search rescales it
        wl = trace_workload(trace, sample=sample, qps=qps, arrival=arrival, cv=args.cv, seed=args.seed)
    else:
        if args.sample is not None:
            raise BenchError("--sample needs --trace (use --num-requests for synthetic workloads)")
        n = args.num_requests if args.num_requests is not None else DEFAULT_NUM_REQUESTS
        qps = None if offline else (args.qps if args.qps is not None else DEFAULT_QPS)
        arrival = args.arrival or "poisson"
        if arrival == "trace":
            raise BenchError("--arrival trace needs --trace")
        wl = synthetic_workload(n, qps=qps, prompt_len=args.prompt_len, output_len=args.output_len,
                                arrival=arrival, cv=args.cv, seed=args.seed)
    return _scale(wl, args)


def _scale(wl: Workload, args: argparse.Namespace) -> Workload:
    if args.length_scale != 1.0:
        wl = wl.scale_lengths(args.length_scale)
    if args.rate_scale != 1.0:
        if not math.isfinite(wl.mean_rate):
            raise BenchError("--rate-scale has no effect on an offline workload")
        wl = wl.scale_rate(args.rate_scale)
    # After scaling: the lengths scaled are the requests' own; the shared parts are taken as given.
    return with_shared_prefix(as_conversations(wl, args.multi_turn), args.shared_prefix_len)


def engine_description(engine: Any, kwargs: dict, simulate: bool) -> dict:
    d = dict(kwargs)
    d["engine"] = type(engine).__name__
    d["simulate"] = simulate
    d["max_model_len"] = getattr(engine, "max_model_len", None)
    cfg = getattr(engine, "config", None)
    if dataclasses.is_dataclass(cfg):
        d["engine_config"] = dataclasses.asdict(cfg)
    if callable(getattr(engine, "startup_stats", None)):
        d["startup"] = engine.startup_stats()
    try:
        st = engine.stats()
        d["num_total_blocks"] = st.get("num_total_blocks")
    except Exception:  # noqa: BLE001
        pass
    return d


# ----------------------------------------------------------------------------------------------- endpoint


def run_endpoint(args: argparse.Namespace, workload: Workload, prompts: list[list[int]], progress: bool) -> RunResult:
    """LOADGEN HOOK (--endpoint): drive a running server through the server's load driver, `server/loadgen.py`.

    Contract: `server.loadgen.run_bench_workload(endpoint, workload, prompts, *, temperature, progress)` sends
    request i at `workload.arrivals[i]` with `prompts[i]`, max_tokens = `workload.output_lens[i]`, ignore_eos,
    and returns a `RunResult` whose RequestRecords hold times relative to the run start (no iteration records:
    a client cannot see the server's iterations). Imported lazily: the bench works without the server package.
    """
    import importlib

    try:
        loadgen = importlib.import_module("server.loadgen")
    except ImportError as e:
        raise BenchError(
            f"--endpoint needs the load driver server/loadgen.py, which is not importable ({e}); "
            "install the server extras or drop --endpoint to run an in-process engine"
        )
    runner = getattr(loadgen, "run_bench_workload", None)
    if runner is None:
        raise BenchError("--endpoint: server/loadgen.py has no run_bench_workload(); the bench hook is not wired")
    try:
        return runner(args.endpoint, workload, prompts, temperature=args.temperature, progress=progress)
    except Exception as e:  # noqa: BLE001 - connection failures etc.: one clear line
        raise BenchError(f"--endpoint {args.endpoint}: {type(e).__name__}: {e or 'no details'} "
                         "(is the server running there?)") from e


# ----------------------------------------------------------------------------------------------- main


def _ready_line(engine: Any, seconds: float) -> str:
    if callable(getattr(engine, "startup_stats", None)):  # LLMEngine: the start-up in parts
        from sarathi_jax.engine import format_startup

        return format_startup(engine.startup_stats())
    return f"engine ready in {seconds:.1f} s"


def _log(quiet: bool, msg: str) -> None:
    if not quiet:
        print(msg, file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None, *, engine_factory: Callable[[dict], Any] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return _main(args, engine_factory)
    except BenchError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:  # bad trace files, length specs, engine configs: one clear line
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2


def text_prompts(engine: Any, workload: Workload, path: str, max_model_len: int | None
                 ) -> tuple[Workload, list[list[int]]]:
    """`workload` with its prompts replaced by the lines of `path` (cycled), through the engine's own
    admission: chat-rendered as a user turn when the model has a chat template, else tokenised as is. Output
    lengths are capped so that prompt + output fits `max_model_len` (a prompt that alone does not fit is
    refused at admission and reported as an error)."""
    lines = [line.strip() for line in Path(path).read_text().splitlines() if line.strip()]
    if not lines:
        raise BenchError(f"--prompts-file {path}: no non-empty lines")
    admission = engine.admission
    if admission.tokenizer is None:
        raise BenchError(f"--prompts-file needs a model folder with a tokenizer; {engine.config.model!r} has none")
    if admission.chat_template is not None:
        ids = [admission.chat_prompt_ids([{"role": "user", "content": line}]) for line in lines]
    else:
        ids = [admission.prompt_ids(line) for line in lines]
    prompts = [ids[i % len(ids)] for i in range(len(workload))]
    note = f"prompts: {len(lines)} text prompts from {path}, cycled; requests stop at EOS"
    lens = np.array([len(p) for p in prompts])
    outputs = workload.output_lens if max_model_len is None else np.clip(
        np.minimum(workload.output_lens, max_model_len - lens), 1, None)
    return dataclasses.replace(workload, prompt_lens=lens, output_lens=outputs, notes=[note], segments=None), prompts


def check_args(args: argparse.Namespace) -> None:
    """Option combinations that cannot work, refused before anything is built."""
    if args.slo_tbt is not None and args.slo_tbt_multiple is not None:
        raise BenchError("give either --slo-tbt or --slo-tbt-multiple, not both")
    if args.capacity and args.slo_tbt is None and args.slo_tbt_multiple is None:
        raise BenchError("--capacity needs a TBT SLO: --slo-tbt SECONDS or --slo-tbt-multiple M (5 strict, 25 relaxed)")
    if args.cost_model and not args.simulate:
        raise BenchError("--cost-model is for the simulator: add --simulate")
    if args.prompts_file and (args.simulate or args.endpoint or args.capacity):
        raise BenchError("--prompts-file runs text prompts on the real engine: not with --simulate, --endpoint "
                         "or --capacity")


def report(args: argparse.Namespace, runs: list[RunResult], capacities: dict[str, CapacityResult],
           fitted: Workload, workload_info: dict[str, dict], slo_tbt: float | None, decode_time: float | None
           ) -> None:
    """The comparison table and notes on stdout; with --out, per-run JSON/CSV, the summary and plots."""
    print()
    print(f"workload: {fitted.describe()}")
    if slo_tbt is not None:
        extra = f" ({args.slo_tbt_multiple:g}x decode-only iteration {fmt_seconds(decode_time)})" if decode_time else ""
        print(f"TBT SLO: {fmt_seconds(slo_tbt)}{extra}")
    print(format_table(runs, capacities))
    for run in runs:
        if run.pipeline and run.pipeline.get("bubble_fraction") is not None:
            p = run.pipeline
            print(f"[{run.label}] pipeline: bubble fraction {p['bubble_fraction']:.2f} over {p['num_stages']} stages, "
                  f"max micro-batches in flight {p['max_in_flight']}")
    for run in runs:
        if args.prompts_file and run.first_completion is not None:
            print(f"[{run.label}] first completion: {run.first_completion!r}")
    print(f"stalls: TBTs above {args.stall_factor:g}x the run's median TBT"
          + ("; virtual time (simulator)" if args.simulate else ""))

    if args.out:
        meta = {
            "argv": sys.argv[1:] if sys.argv else [],
            "workload": fitted.summary(),
            "slo_tbt": slo_tbt,
            "slo_ttft": args.slo_ttft,
            "decode_only_iteration_time": decode_time,
            "simulate": args.simulate,
            "cost_model": args.cost_model,
        }
        paths = []
        for r in runs:
            paths += write_run(args.out, r, workload_info.get(r.label, fitted.summary()), capacities.get(r.label))
        paths += write_summary(args.out, runs, capacities, meta)
        if not args.no_plots:
            paths += write_plots(args.out, runs, capacities, slo_tbt, args.stall_factor)
        print(f"wrote {len(paths)} files to {args.out}/")
    else:
        print("(pass --out DIR to save JSON, CSV and PNG plots)")


def _main(args: argparse.Namespace, engine_factory: Callable[[dict], Any] | None) -> int:
    t_start = time.monotonic()
    check_args(args)
    progress = not args.quiet and sys.stderr.isatty()
    quiet = args.quiet
    if args.model is None and not args.endpoint:
        import jax

        args.model = default_model(jax.default_backend())
        _log(quiet, f"model: {args.model} (the default on {jax.default_backend()} [{jax.devices()[0].device_kind}])")
    workload = build_workload(args)
    configs = run_configs(args)
    factory = engine_factory or default_engine_factory(args.simulate, args.cost_model)

    runs: list[RunResult] = []
    capacities: dict[str, CapacityResult] = {}
    slo_tbt = args.slo_tbt
    decode_time = None
    fitted: Workload | None = None
    prompts: list[list[int]] | None = None
    fitted_len = None
    workload_info: dict[str, dict] = {}  # label -> the requests that run saw

    if args.endpoint:
        if args.max_model_len:
            workload = workload.fit(args.max_model_len)
        prompts = workload.prompts(LLAMA2_VOCAB_SIZE, args.seed)  # folded into the server's vocabulary
        _log(quiet, f"workload: {workload.describe()}")
        for note in workload.notes:
            _log(quiet, f"  note: {note}")
        run = run_endpoint(args, workload, prompts, progress)
        run.summary = summarize(run.records, run.iterations, slo_ttft=args.slo_ttft, slo_tbt=slo_tbt,
                                stall_factor=args.stall_factor, num_preemptions=run.num_preemptions)
        runs.append(run)
        fitted = workload
        workload_info[run.label] = workload.summary()
    for cfg in configs if not args.endpoint else []:
        kwargs = engine_config_kwargs(args, cfg)
        _log(quiet, f"[{cfg['label']}] building {'SimulatedEngine' if args.simulate else 'LLMEngine'} "
                    f"({', '.join(f'{k}={v}' for k, v in kwargs.items())}) ...")
        t0 = time.monotonic()
        engine = factory(kwargs)
        _log(quiet, f"[{cfg['label']}] {_ready_line(engine, time.monotonic() - t0)}")
        max_len = int(getattr(engine, "max_model_len", 0) or 0) or None
        if fitted is None or (max_len is not None and fitted_len is not None and max_len < fitted_len):
            if fitted is not None:
                _log(quiet, f"warning: [{cfg['label']}] has max_model_len={max_len} < {fitted_len}; "
                            "refitting the workload, so this run's requests differ from the previous runs'")
            fitted_len = max_len
            if args.prompts_file:  # the text sets the prompt lengths; outputs are capped to fit
                fitted, prompts = text_prompts(engine, workload, args.prompts_file, max_len)
            else:
                fitted = workload.fit(max_len) if max_len else workload
                prompts = fitted.prompts(engine_vocab_size(engine), args.seed)
            if len(runs) == 0:
                _log(quiet, f"workload: {fitted.describe()}")
                for note in fitted.notes:
                    _log(quiet, f"  note: {note}")
        if args.slo_tbt_multiple is not None and decode_time is None:
            decode_time = measure_decode_iteration_time(engine, batch_size=args.decode_probe_batch)
            slo_tbt = args.slo_tbt_multiple * decode_time
            _log(quiet, f"decode-only iteration time (batch {args.decode_probe_batch}): {fmt_seconds(decode_time)}"
                        f" -> TBT SLO {args.slo_tbt_multiple:g}x = {fmt_seconds(slo_tbt)}")
        summ_kw = {"slo_ttft": args.slo_ttft, "slo_tbt": slo_tbt, "stall_factor": args.stall_factor}
        desc = engine_description(engine, kwargs, args.simulate)
        if args.capacity:
            def on_probe(p, label=cfg["label"]):
                _log(quiet, f"[{label}] {p.qps:8.3g} req/s: {'pass' if p.passed else 'FAIL'}  "
                            f"P99 TBT {fmt_seconds(p.p99_tbt)}, P50 sched delay {fmt_seconds(p.p50_sched_delay)}"
                            f"{' (stopped early)' if p.stopped_early else ''}")

            cap = find_capacity(
                engine, fitted, prompts, slo_tbt=slo_tbt, max_sched_delay=args.max_sched_delay,
                start_qps=args.capacity_start_qps, max_probes=args.capacity_probes, rel_tol=args.capacity_tol,
                label=cfg["label"], progress=progress, summarize_kwargs=summ_kw, on_probe=on_probe,
            )
            capacities[cfg["label"]] = cap
            _log(quiet, f"[{cfg['label']}] capacity {cap.capacity_qps:.3g} req/s {cap.note}")
            shown = cap.best or min(cap.probes, key=lambda p: p.qps)
            run = shown.result
            run.label = cfg["label"]
            desc["capacity_probe_qps"] = shown.qps
        else:
            run = run_workload(engine, fitted, prompts, label=cfg["label"], id_prefix=f"{cfg['label']}-",
                               temperature=args.temperature, stop_at_eos=bool(args.prompts_file), progress=progress)
            run.summary = summarize(run.records, run.iterations, num_preemptions=run.num_preemptions, **summ_kw)
            _log(quiet, f"[{cfg['label']}] {run.summary['num_completed']}/{run.summary['num_requests']} requests "
                        f"in {run.wall_time:.1f} s wall")
        run.config = desc
        runs.append(run)
        workload_info[run.label] = fitted.summary()
        del engine
        gc.collect()

    report(args, runs, capacities, fitted, workload_info, slo_tbt, decode_time)
    _log(quiet, f"total {time.monotonic() - t_start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
