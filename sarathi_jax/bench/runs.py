"""The bench's runs: the workload from the options, one engine per configuration (or a running server with
--endpoint), each run or capacity search on the same requests; `run_all` returns what `report` prints."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from sarathi_jax.bench.args import (DEFAULT_NUM_REQUESTS, DEFAULT_QPS, BenchError, constraint_of, default_model,
                                   engine_config_kwargs, goodput_target_of, kv_link_of, run_configs, slo_mix_of)
from sarathi_jax.bench.capacity import CapacityResult, find_capacity
from sarathi_jax.bench.driver import RunResult, engine_vocab_size, measure_decode_iteration_time, run_workload
from sarathi_jax.bench.endpoint import EndpointError, run_endpoint
from sarathi_jax.factory import build_engine, build_simulated_engine
from sarathi_jax.bench.metrics import fmt_seconds, summarize
from sarathi_jax.bench.slo_mix import SloMix, request_slos
from sarathi_jax.bench.structured import constrained_cell, constrained_rows, constrained_summary, request_constraints
from sarathi_jax.bench.workload import (Workload, as_conversations, synthetic_workload, trace_workload,
                                        with_shared_prefix)
from sarathi_jax.config.engine_config import EngineConfig
from sarathi_jax.config.disaggregation import KVLink
from sarathi_jax.core.engine_api import Engine
from sarathi_jax.engine.gc_heap import startup_heap_frozen
from sarathi_jax.models.presets import LLAMA2_VOCAB_SIZE


def default_engine_factory(simulate: bool, cost_model_path: str | None = None, *, link: KVLink | None = None,
                           serial_fraction: float = 0.0, num_devices: int | None = None) -> Callable[[dict], Engine]:
    cost_model = None
    if cost_model_path:
        from sarathi_jax.sim.cost_model import BucketCostModel

        try:
            cost_model = BucketCostModel.load(cost_model_path)
        except (OSError, KeyError, TypeError, json.JSONDecodeError) as e:
            raise BenchError(f"--cost-model {cost_model_path}: {type(e).__name__}: {e}") from None

    def make(kwargs: dict) -> Engine:
        config = EngineConfig(**kwargs)
        if simulate:
            return build_simulated_engine(config, cost_model, link=link, serial_fraction=serial_fraction,
                                          num_devices=num_devices)
        engine = build_engine(config)
        engine.wait_until_compiled()  # nothing is timed while background threads still compile
        return engine

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


def engine_description(engine: Engine, kwargs: dict, simulate: bool) -> dict:
    d = dict(kwargs)
    d["engine"] = type(engine).__name__
    d["simulate"] = simulate
    d["max_model_len"] = engine.max_model_len
    if engine.config is not None:
        d["engine_config"] = dataclasses.asdict(engine.config)
    startup = engine.startup_stats()
    if startup is not None:
        d["startup"] = startup
    d["num_total_blocks"] = engine.stats()["num_total_blocks"]
    if engine.budget_setup is not None:
        d["token_budget_setup"] = {**engine.budget_setup.as_dict(), "words": engine.budget_setup.describe()}
    return d


def text_prompts(engine: Engine, workload: Workload, path: str, max_model_len: int | None
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
        model = repr(engine.config.model) if engine.config is not None else "the simulated engine"
        raise BenchError(f"--prompts-file needs a model folder with a tokenizer; {model} has none")
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


def _ready_line(engine: Engine, seconds: float) -> str:
    startup = engine.startup_stats()
    if startup is not None:  # LLMEngine: the start-up in parts
        from sarathi_jax.engine.llm_engine import format_startup

        return format_startup(startup)  # its token budget words included
    setup = engine.budget_setup
    return f"engine ready in {seconds:.1f} s" + (f"; {setup.describe()}" if setup is not None else "")


def _log(quiet: bool, msg: str) -> None:
    if not quiet:
        print(msg, file=sys.stderr, flush=True)


@dataclass
class BenchRuns:
    """What the runs produced, for `report.print_report`."""

    runs: list[RunResult] = field(default_factory=list)
    capacities: dict[str, CapacityResult] = field(default_factory=dict)  # label -> capacity search (--capacity)
    fitted: Workload | None = None  # the requests the runs saw (fitted to the engines' max_model_len)
    workload_info: dict[str, dict] = field(default_factory=dict)  # label -> the requests that run saw
    slo_tbt: float | None = None
    decode_time: float | None = None  # decode-only iteration time (--slo-tbt-multiple)


def run_all(args: argparse.Namespace, engine_factory: Callable[[dict], Engine] | None = None) -> BenchRuns:
    """Every configuration's run (or capacity search) on the same requests; `args` as checked by `check_args`."""
    progress = not args.quiet and sys.stderr.isatty()
    quiet = args.quiet
    if args.model is None and not args.endpoint:
        import jax

        args.model = default_model(jax.default_backend())
        _log(quiet, f"model: {args.model} (the default on {jax.default_backend()} [{jax.devices()[0].device_kind}])")
    workload = build_workload(args)
    configs = run_configs(args)
    factory = engine_factory or default_engine_factory(
        args.simulate, args.cost_model, link=kv_link_of(args), serial_fraction=args.tp_serial_fraction,
        num_devices=args.devices)

    runs: list[RunResult] = []
    capacities: dict[str, CapacityResult] = {}
    slo_tbt = args.slo_tbt
    decode_time = None
    fitted: Workload | None = None
    prompts: list[list[int]] | None = None
    fitted_len = None
    workload_info: dict[str, dict] = {}
    mix = slo_mix_of(args)
    goodput_target = goodput_target_of(args, mix)

    if args.endpoint:
        if args.max_model_len:
            workload = workload.fit(args.max_model_len)
        prompts = workload.prompts(LLAMA2_VOCAB_SIZE, args.seed)  # folded into the server's vocabulary
        _log(quiet, f"workload: {workload.describe()}")
        for note in workload.notes:
            _log(quiet, f"  note: {note}")
        try:
            run = run_endpoint(args.endpoint, workload, prompts, args.temperature)
        except EndpointError as e:
            raise BenchError(f"--endpoint {args.endpoint}: {e} (is the server running there?)") from None
        run.summary = summarize(run.records, run.iterations, slo_ttft=args.slo_ttft, slo_tbt=slo_tbt,
                                stall_factor=args.stall_factor, num_preemptions=run.num_preemptions,
                                **_slo_classes(mix, len(workload), args.seed))
        runs.append(run)
        fitted = workload
        workload_info[run.label] = workload.summary()
    engine: Engine | None = None
    engine_kwargs: dict | None = None
    # The engine in use has its start-up heap frozen out of the GC (gc_heap.py); closing unfreezes and collects.
    with contextlib.ExitStack() as frozen_heap:
        for cfg in configs if not args.endpoint else []:
            kwargs = engine_config_kwargs(args, cfg)
            if kwargs != engine_kwargs:  # configurations that differ only in --structured-share share an engine
                engine = engine_kwargs = None
                frozen_heap.close()  # the previous engine's memory goes before the next is built
                kind = {(False, False): "LLMEngine", (False, True): "DisaggregatedEngine",
                        (True, False): "SimulatedEngine", (True, True): "DisaggregatedSimEngine"}[
                    (bool(args.simulate), bool(kwargs.get("disaggregation")))]
                _log(quiet, f"[{cfg['label']}] building {kind} "
                            f"({', '.join(f'{k}={v}' for k, v in kwargs.items())}) ...")
                t0 = time.monotonic()
                engine, engine_kwargs = factory(kwargs), kwargs
                frozen_heap.enter_context(startup_heap_frozen())
                _log(quiet, f"[{cfg['label']}] {_ready_line(engine, time.monotonic() - t0)}")
            else:
                _log(quiet, f"[{cfg['label']}] on the engine of the run before (the same configuration)")
            assert engine is not None
            max_len = engine.max_model_len or None
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
                decode_time = measure_decode_iteration_time(engine, batch_size=args.decode_probe_batch,
                                                            prompt_len=args.decode_probe_context)
                slo_tbt = args.slo_tbt_multiple * decode_time
                _log(quiet, f"decode-only iteration time (batch {args.decode_probe_batch}, context about "
                            f"{args.decode_probe_context}): {fmt_seconds(decode_time)}"
                            f" -> TBT SLO {args.slo_tbt_multiple:g}x = {fmt_seconds(slo_tbt)}")
            summ_kw = {"slo_ttft": args.slo_ttft, "slo_tbt": slo_tbt, "stall_factor": args.stall_factor,
                       **_slo_classes(mix, len(fitted), args.seed)}
            classes = None if mix is None else mix.assign(len(fitted), args.seed)  # priority and SLO targets
            share = cfg.get("structured_share")
            constrained = None if share is None else constrained_rows(len(fitted), share, args.seed)
            constraints = None if constrained is None else request_constraints(constrained, constraint_of(args))
            desc = engine_description(engine, kwargs, args.simulate)
            if args.capacity:
                def on_probe(p, label=cfg["label"]):
                    good = "" if p.good_fraction is None else f", {p.good_fraction:.0%} within their SLO"
                    _log(quiet, f"[{label}] {p.qps:8.3g} req/s: {'pass' if p.passed else 'FAIL'}  "
                                f"P99 TBT {fmt_seconds(p.p99_tbt)}, P50 sched delay {fmt_seconds(p.p50_sched_delay)}"
                                f"{good}{' (stopped early)' if p.stopped_early else ''}")

                cap = find_capacity(
                    engine, fitted, prompts, slo_tbt=slo_tbt, max_sched_delay=args.max_sched_delay,
                    start_qps=args.capacity_start_qps, max_probes=args.capacity_probes, rel_tol=args.capacity_tol,
                    label=cfg["label"], progress=progress, summarize_kwargs=summ_kw, on_probe=on_probe,
                    goodput_target=goodput_target, request_classes=classes, constraints=constraints,
                )
                capacities[cfg["label"]] = cap
                _log(quiet, f"[{cfg['label']}] capacity {cap.capacity_qps:.3g} req/s {cap.note}")
                shown = cap.best or min(cap.probes, key=lambda p: p.qps)
                run = shown.result
                run.label = cfg["label"]
                desc["capacity_probe_qps"] = shown.qps
            else:
                run = run_workload(engine, fitted, prompts, label=cfg["label"], id_prefix=f"{cfg['label']}-",
                                   temperature=args.temperature, stop_at_eos=bool(args.prompts_file), progress=progress,
                                   request_classes=classes, constraints=constraints)
                run.summary = summarize(run.records, run.iterations, num_preemptions=run.num_preemptions, **summ_kw)
                _log(quiet, f"[{cfg['label']}] {run.summary['num_completed']}/{run.summary['num_requests']} requests "
                            f"in {run.wall_time:.1f} s wall")
            if constrained is not None:
                run.summary["structured_outputs"] = constrained_summary(run.records, constrained, share)
                _log(quiet, f"[{cfg['label']}] constrained requests: "
                            f"{constrained_cell(run.summary['structured_outputs'])}")
            run.config = desc
            runs.append(run)
            workload_info[run.label] = fitted.summary()
        del engine

    return BenchRuns(runs, capacities, fitted, workload_info, slo_tbt, decode_time)


def _slo_classes(mix: SloMix | None, num_requests: int, seed: int) -> dict:
    """`summarize`'s keyword for the requests' SLO classes (--slo-mix), drawn as the runs send them."""
    return {} if mix is None else {"request_slos": request_slos(mix.assign(num_requests, seed))}
