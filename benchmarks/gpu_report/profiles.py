"""The `profile_large` and `profile_small` parts of `python -m benchmarks.gpu_report`: an engine in steady
decode (then, for the large model, with a prompt chunk filling each step's budget), a few steps traced by
`benchmarks.probes.profile_steps`, and per section the wall and device-busy time per step against the roofline floor of the
steps' work, and the busiest kernels.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from benchmarks.gpu_report.run import ReportConfig
from benchmarks.gpu_report.result import Result, floor_of, get_rates


def _profile_engine(cfg: ReportConfig, model: str, prompt_len: int, steps: int):
    """An engine sized for `profile_batch` decodes that take `steps` steps at most, beside mixed prompts of
    `prompt_len` tokens; its KV cache is exactly that big (no sizing from free memory)."""
    from sarathi_jax import EngineConfig, LLMEngine

    bs = 16
    max_len = max(cfg.profile_context + steps + 16, prompt_len + 16)
    blocks = cfg.profile_batch * -(-max_len // bs) + 3 * -(-prompt_len // bs) + 16
    return LLMEngine(EngineConfig(
        model=model, dtype=cfg.dtype, token_budget=cfg.token_budget, max_num_seqs=cfg.profile_batch + 2,
        block_size=bs, num_blocks=int(blocks * 1.05) + 1, max_model_len=max_len,
        enable_prefix_caching=False,  # the mixed steps re-send one prompt: a cache hit would change the steps
        background_compile=False), warmup=False)  # buckets compile as the untraced steps first use them


def add_section(res: Result, label: str, s: dict, works: list, rates: Any, extra: dict) -> None:
    """Figures of one traced section from its `trace_summary.summarize` dict `s` and the `roofline.Work` of the
    steps dispatched meanwhile: wall and device busy per step against their floor, the busy fraction, and the
    busiest kernels with their share of the device's busy time."""
    flops, nbytes = statistics.fmean(w.flops for w in works), statistics.fmean(w.bytes for w in works)
    floor, basis, compute, memory = floor_of(flops, nbytes, rates)
    res.figure(f"{label}: wall per step", s["wall_us_per_step"] * 1e-6, "s", floor, basis)
    res.figure(f"{label}: bytes per step (weights, KV read and written)", nbytes, "B")
    res.figure(f"{label}: FLOPs per step", flops, "FLOP")
    res.figure(f"{label}: tokens per step", statistics.fmean(w.num_tokens for w in works), "count")
    res.doc.setdefault("sections", {})[label] = {
        **s, **extra, "tokens_per_step": statistics.fmean(w.num_tokens for w in works),
        "flops_per_step": flops, "bytes_per_step": nbytes, "weight_bytes": works[0].weight_bytes,
        "kv_read_bytes_per_step": statistics.fmean(w.kv_read_bytes for w in works),
        "compute_floor_s": compute, "memory_floor_s": memory}
    if not s["kernels_per_step"]:  # XLA:CPU runs on host threads: its trace has no /device: lanes
        res.doc["info"]["device_events"] = "none in the trace (no device busy time to report)"
        return
    busy = s["device_busy_us_per_step"]
    res.figure(f"{label}: device busy per step", busy * 1e-6, "s", floor, basis)
    res.figure(f"{label}: device busy fraction", s["device_busy_fraction"], "fraction")
    res.figure(f"{label}: kernels per step", s["kernels_per_step"], "count")
    res.table(f"{label}: busiest kernels (device time per step; share of the device's busy time)",
              ["kernel", "us per step", "launches per step", "share of busy"],
              [[name[:100], t, n, t / busy] for name, t, n in s["top_kernels"]])


def _traced_section(res: Result, cfg: ReportConfig, label: str, engine: Any, recorder: Any, rates: Any,
                    steps: int, out: str, part: str, feed: Callable[[], None] | None = None) -> None:
    """Trace `steps` engine steps (`feed` before each) and add their section; the trace is kept under out/traces."""
    from benchmarks.probes.profile_steps import trace_steps
    from sarathi_jax.bench.roofline import ModelShape, work

    before = engine.runner.num_compilations
    with tempfile.TemporaryDirectory(prefix="gpu-report-trace-") as tmp:
        s, trace = trace_steps(engine, steps, tmp, before_step=feed)
        os.makedirs(os.path.join(out, "traces"), exist_ok=True)
        kept = os.path.join(out, "traces", f"{part}-{label.split()[0]}.perfetto_trace.json.gz")
        shutil.copy(trace, kept)
    shape = ModelShape.from_model_config(engine.model_config, cfg.dtype)
    captured = recorder.snapshot()
    compiled = engine.runner.num_compilations - before
    res.doc["info"][f"{label.split()[0]} steps: compilations during the trace"] = compiled
    add_section(res, label, s, [work(shape, c.chunks) for c in captured], rates, {
        "trace": os.path.relpath(kept, out), "compilations_during_trace": compiled,
        "decodes_per_step": statistics.fmean(c.num_decodes for c in captured)})
    res.save()
    print(f"{label}: wall {s['wall_us_per_step'] / 1e3:.3f} ms, device busy {s['device_busy_us_per_step'] / 1e3:.3f} "
          f"ms ({s['device_busy_fraction']:.0%})", flush=True)


def _profile(cfg: ReportConfig, res: Result, out: str, part: str, model: str, mixed: bool, rates: dict | None):
    from sarathi_jax import SamplingParams
    from benchmarks.probes.profile_steps import prefill_steps, steady_decode
    from benchmarks.probes.step_replay import StepRecorder
    from sarathi_jax.engine.llm_engine import format_startup

    rates = get_rates(cfg, rates, res)
    settle = 4
    prompt_len = 4 * cfg.token_budget if mixed else 0
    b = cfg.profile_batch
    steps = (prefill_steps(b, cfg.profile_context, cfg.token_budget) + 2 * settle + cfg.profile_steps
             + (cfg.mixed_steps if mixed else 0) + 16)  # none may finish before the traced steps
    t0 = time.perf_counter()
    engine = _profile_engine(cfg, model, prompt_len, steps)
    res.doc["info"].update(startup=format_startup(engine.startup_stats()), model=model,
                           batch=cfg.profile_batch, context=cfg.profile_context, token_budget=cfg.token_budget)
    recorder = StepRecorder(engine.runner, keep=cfg.profile_steps)
    steady_decode(engine, cfg.profile_batch, cfg.profile_context, max_tokens=steps)
    for _ in range(settle):  # every sequence decoding; the decode bucket compiled and warm
        engine.step()
    res.doc["info"]["seconds_to_steady_decode"] = time.perf_counter() - t0
    _traced_section(res, cfg, f"decode x{cfg.profile_batch} at ctx {cfg.profile_context}", engine, recorder, rates,
                    cfg.profile_steps, out, part)
    if not mixed:
        return
    recorder.steps = deque(maxlen=cfg.mixed_steps)  # the mixed steps only
    prompt = list(range(3, 3 + prompt_len))
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def feed() -> None:  # a prompt always waiting: every step is the decodes plus a chunk filling the budget
        if engine.scheduler.num_waiting == 0:
            engine.add_request(f"mixed-{time.monotonic_ns()}", prompt, params)

    for _ in range(settle):
        feed()
        engine.step()
    _traced_section(res, cfg, f"mixed {cfg.token_budget}-token step ({cfg.profile_batch} decodes + a chunk)",
                    engine, recorder, rates, cfg.mixed_steps, out, part, feed=feed)


def part_profile_large(cfg: ReportConfig, res: Result, out: str, rates: dict | None, **_: Any) -> None:
    _profile(cfg, res, out, "profile_large", cfg.large_model, True, rates)


def part_profile_small(cfg: ReportConfig, res: Result, out: str, rates: dict | None, **_: Any) -> None:
    _profile(cfg, res, out, "profile_small", cfg.small_model, False, rates)
