"""The step timer behind `python -m sarathi_jax.bench.step_cost`: what to time (`Composition`s of `Chunk`s
per mode) and timing it on the real model runner (`StepTimer`, `measure`).

`measure` builds the real engine (`LLMEngine(EngineConfig(...), warmup=False)`), makes fake sequences whose KV
blocks come from the engine's own `block_manager`, and drives `engine.runner.execute(chunks, sampling_of)`
with synthetic `ScheduledChunk`s: the same jitted step, bucket padding and host-side batch building as
serving (the scheduler and the engine's bookkeeping are not timed). Every composition is run `--warmup`
times untimed (the first compiles its bucket), then the timed repeats go round-robin over all compositions
of the run, so that load from other processes falls on all of them alike; the median is reported. The
machine rates (`bench.roofline.measure_rates`) are measured before and after the timed rounds, the better
kept; per batch, `bench.roofline.work` and `floors` give the compute and memory floors, and
`x floor` = time / max(floors). Calibration compositions are fitted to `sarathi_jax.sim.cost_model.BucketCostModel`.
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sarathi_jax.bench.args import DEFAULT_TOKEN_BUDGETS
from sarathi_jax.bench.roofline import (
    Chunk,
    ModelShape,
    best_rates,
    decode_chunks,
    floors,
    measure_rates_and_log,
    num_params,
    work,
)
from sarathi_jax.sim.cost_model import BucketCostModel
from sarathi_jax.config.sizing import SMALLEST_BUCKET

MODES = ("decode", "prefill", "hybrid", "chunking", "calibrate")
DEFAULT_TOKEN_BUDGET = int(DEFAULT_TOKEN_BUDGETS)  # the bench's


# ----------------------------------------------------------------------------------------------- compositions


@dataclass
class Composition:
    """A named thing to time: one iteration (`steps` has one batch) or several in a row (a chunked prefill)."""

    mode: str
    label: str
    steps: list[list[Chunk]]
    x: float  # the plotted quantity (batch size, tokens, chunk size, ...)
    info: dict = field(default_factory=dict)


def _prefill_steps(prompt_len: int, chunk: int) -> list[list[Chunk]]:
    steps, start = [], 0
    while start < prompt_len:
        n = min(chunk, prompt_len - start)
        steps.append([Chunk(start, n, prompt_len)])
        start += n
    return steps


def compositions(mode: str, args: argparse.Namespace) -> list[Composition]:
    if mode == "decode":
        return [Composition("decode", f"decode x{b} @ctx {args.context}", [decode_chunks(b, args.context)], b,
                            {"batch_size": b, "context": args.context}) for b in args.batch_sizes]
    if mode == "prefill":
        return [Composition("prefill", f"prefill {n}", [[Chunk(0, n)]], n, {"tokens": n}) for n in args.tokens]
    if mode == "hybrid":
        d, ctx = args.decodes, args.context
        out = [Composition("hybrid", f"{d} decodes alone", [decode_chunks(d, ctx)], 0, {"added": "none", "prefill_tokens": 0})]
        for c in args.hybrid_chunks:
            out.append(Composition("hybrid", f"{d} decodes + chunk {c}", [decode_chunks(d, ctx) + [Chunk(0, c, max(c, args.whole_prompt))]],
                                   c, {"added": "chunk", "prefill_tokens": c}))
        p = args.whole_prompt
        out.append(Composition("hybrid", f"{d} decodes + whole prompt {p}", [decode_chunks(d, ctx) + [Chunk(0, p)]],
                               p, {"added": "whole prompt", "prefill_tokens": p}))
        return out
    if mode == "chunking":
        p = args.prompt_len
        out = []
        for c in args.chunking_chunks:
            c = min(c, p)
            label = f"prompt {p} unchunked" if c == p else f"prompt {p} in chunks of {c}"
            out.append(Composition("chunking", label, _prefill_steps(p, c), c,
                                   {"chunk": c, "prompt_len": p, "probe": False}))
        if args.tile_probe:
            t = args.tile_probe
            for c in (t, t + 1):
                if c < p:
                    out.append(Composition("chunking", f"probe: prompt {p} in chunks of {c}", _prefill_steps(p, c), c,
                                           {"chunk": c, "prompt_len": p, "probe": "prompt"}))
            for c in (t, t + 1):
                out.append(Composition("chunking", f"probe: one chunk of {c}", [[Chunk(0, c)]], c,
                                       {"chunk": c, "probe": "iteration"}))
        return out
    if mode == "calibrate":
        return calibration_compositions(args.calib_buckets, args.calib_contexts, args.calib_decodes,
                                        max_len=args.max_model_len)
    raise ValueError(f"unknown mode {mode!r}; modes: {', '.join(MODES)}")


def calibration_compositions(buckets: Sequence[int], contexts: Sequence[int], max_decodes: int,
                             max_len: int | None = None) -> list[Composition]:
    """Single iterations that fill each bucket in different ways, for fitting `BucketCostModel`: a fresh
    prefill, a chunk late in a prompt, and decodes at each context (alone when they fill the bucket, else
    with a prompt chunk making up the rest). Sequences stay within `max_len` tokens when it is given."""
    out = []
    for b in buckets:
        out.append(Composition("calibrate", f"b{b}: prefill {b}", [[Chunk(0, b)]], b, {"bucket": b}))
        late = min(max(contexts), max_len - b) if max_len else max(contexts)
        if late > 0:
            out.append(Composition("calibrate", f"b{b}: chunk {b} @ {late}", [[Chunk(late, b)]], b, {"bucket": b}))
        d = min(max_decodes, b)
        for ctx in contexts:
            if max_len and ctx >= max_len:
                continue
            rest = b - d
            chunks = decode_chunks(d, ctx) + ([Chunk(0, rest)] if rest else [])
            label = f"b{b}: {d} decodes @ {ctx}" + (f" + prefill {rest}" if rest else "")
            out.append(Composition("calibrate", label, [chunks], b, {"bucket": b}))
        if d > 1:  # one decode instead of d: a decode group costs its longest row, not its row count
            ctx = max(c for c in contexts if not max_len or c < max_len)
            out.append(Composition("calibrate", f"b{b}: 1 decode @ {ctx} + prefill {b - 1}",
                                   [decode_chunks(1, ctx) + [Chunk(0, b - 1)]], b, {"bucket": b}))
    return out


def engine_needs(comps: Sequence[Composition]) -> dict:
    """Largest batch (tokens and sequences) and longest sequence the compositions need."""
    max_tokens = max(sum(c.num_new_tokens for c in step) for comp in comps for step in comp.steps)
    max_seqs = max(len(step) for comp in comps for step in comp.steps)
    max_len = max(c.length for comp in comps for step in comp.steps for c in step)
    return {"max_tokens": max_tokens, "max_seqs": max_seqs, "max_len": max_len}


# ----------------------------------------------------------------------------------------------- the timer


class StepTimer:
    """Times batches on a real LLMEngine's model runner, with fake sequences holding real KV blocks."""

    def __init__(self, engine: Any, seed: int = 0) -> None:
        from sarathi_jax.request.sampling_params import SamplingParams

        self.engine = engine
        self.runner = engine.runner
        self._rng = np.random.default_rng(seed)
        self._params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        self._decode_pool: dict[int, list] = {}  # context -> sequences with context + 1 tokens
        self._prompts: dict[tuple[int, int], Any] = {}  # (length, index) -> sequence
        self._n = 0

    def _new_seq(self, num_tokens: int):
        from sarathi_jax.request.sequence import Sequence

        vocab = self.engine.model_config.vocab_size
        ids = self._rng.integers(3, vocab, size=num_tokens).tolist()
        self._n += 1
        seq = Sequence(f"step-cost-{self._n}", ids, self._params, 0.0)
        bm = self.engine.block_manager
        if not bm.can_allocate(bm.blocks_needed(seq, num_tokens), use_watermark=False):
            raise RuntimeError(f"out of KV blocks ({bm.num_free_blocks} free) for a {num_tokens}-token sequence: "
                               "pass a larger --num-blocks / --kv-cache-bytes")
        bm.allocate(seq, num_tokens)
        return seq

    def scheduled(self, step: Sequence[Chunk]) -> list:
        """ScheduledChunks for one batch. Decodes at the same context share a pool of sequences; prefill
        chunks of one batch get distinct sequences (reused across batches)."""
        from sarathi_jax.scheduler import ScheduledChunk

        out = []
        used_decode: dict[int, int] = {}
        used_prompt: dict[int, int] = {}
        for c in step:
            if c.num_new_tokens == 1 and c.sample and c.start > 0:
                k = used_decode.get(c.start, 0)
                pool = self._decode_pool.setdefault(c.start, [])
                while len(pool) <= k:
                    pool.append(self._new_seq(c.start + 1))
                used_decode[c.start] = k + 1
                seq = pool[k]
            else:
                length = c.length  # the chunk samples iff it reaches the end of its sequence
                k = used_prompt.get(length, 0)
                key = (length, k)
                if key not in self._prompts:
                    self._prompts[key] = self._new_seq(length)
                used_prompt[length] = k + 1
                seq = self._prompts[key]
            out.append(ScheduledChunk(seq, c.num_new_tokens, c.start))
        return out

    def prepare(self, steps: Sequence[Sequence[Chunk]]) -> list[list]:
        return [self.scheduled(step) for step in steps]

    def run(self, prepared: Sequence[list]) -> float:
        sampling_of = lambda seq: (self._params, 0, ())  # noqa: E731
        t0 = time.perf_counter()
        for sc in prepared:
            self.runner.execute(sc, sampling_of)  # waits for the sampled tokens on the host
        return time.perf_counter() - t0


def build_engine(args: argparse.Namespace, needs: dict) -> Any:
    from sarathi_jax.config.engine_config import EngineConfig
    from sarathi_jax.engine.llm_engine import LLMEngine

    budget = args.token_budget or DEFAULT_TOKEN_BUDGET
    budget = max(budget, -(-needs["max_tokens"] // SMALLEST_BUCKET) * SMALLEST_BUCKET)
    max_seqs = max(args.max_num_seqs, needs["max_seqs"])
    max_len = max(args.max_model_len, needs["max_len"] + 1)
    kw = dict(model=args.model, dtype=args.dtype, token_budget=budget, max_num_seqs=max_seqs,
              max_model_len=max_len, scheduler="sarathi", attention_backend=args.attention_backend,
              block_size=args.block_size, seed=args.engine_seed, scan_layers=args.scan_layers,
              quantization=args.quantization, enable_prefix_caching=False)  # fake sequences fill the blocks; nothing is looked up
    if args.num_blocks:
        kw["num_blocks"] = args.num_blocks
    if args.kv_cache_bytes:
        kw["kv_cache_bytes"] = args.kv_cache_bytes
    return LLMEngine(EngineConfig(**kw), warmup=False)


def measure(args: argparse.Namespace, log=print) -> dict:
    """Run every requested mode's compositions on one engine, side by side; returns the JSON document."""
    modes = args.modes
    comps = [c for m in modes for c in compositions(m, args)]
    needs = engine_needs(comps)
    t_build = time.perf_counter()
    engine = build_engine(args, needs)
    runner = engine.runner
    cfg = engine.config
    log(f"engine: {cfg.model} {cfg.dtype}, token_budget {cfg.token_budget} (buckets {list(runner.buckets)}), "
        f"max_num_seqs {cfg.max_num_seqs}, max_model_len {engine.max_model_len}, "
        f"{engine.block_manager.num_total_blocks} KV blocks of {cfg.block_size}, {cfg.attention_backend} attention "
        f"(built in {time.perf_counter() - t_build:.1f} s)")
    shape = ModelShape.from_model_config(engine.model_config, cfg.dtype)

    timer = StepTimer(engine, seed=args.seed)
    prepared = [timer.prepare(c.steps) for c in comps]
    t_warm = time.perf_counter()
    for p in prepared:
        for _ in range(max(1, args.warmup)):
            timer.run(p)
    log(f"warm-up (compiling {runner.num_compilations} buckets): {time.perf_counter() - t_warm:.1f} s")

    rates_now = functools.partial(measure_rates_and_log, log, cfg.dtype, args.matmul_n, args.bandwidth_mb,
                                  args.repeats, args.matmul_rate, args.bandwidth)

    log("measuring machine rates (before and after the timed rounds; the best is kept) ...")
    before = rates_now()

    times: list[list[float]] = [[] for _ in comps]
    t_meas = time.perf_counter()
    for _ in range(args.repeats):
        for i, p in enumerate(prepared):  # round-robin: background load hits every composition alike
            times[i].append(timer.run(p))
    log(f"timed {args.repeats} rounds of {len(comps)} compositions: {time.perf_counter() - t_meas:.1f} s")
    after = rates_now()
    rates = best_rates(before, after)

    rows = []
    for comp, ts in zip(comps, times):
        step_work = [work(shape, s) for s in comp.steps]
        step_floors = [floors(w, rates) for w in step_work]
        t = statistics.median(ts)
        cf = sum(f[0] for f in step_floors)
        mf = sum(f[1] for f in step_floors)
        bound = sum(max(f) for f in step_floors)
        tokens = sum(w.num_tokens for w in step_work)
        rows.append({
            "mode": comp.mode,
            "label": comp.label,
            "x": comp.x,
            **comp.info,
            "num_steps": len(comp.steps),
            "num_seqs": max(len(s) for s in comp.steps),
            "num_tokens": tokens,
            "buckets": [runner.bucket_for(w.num_tokens) for w in step_work],
            "time_s": t,
            "min_time_s": min(ts),
            "times_s": ts,
            "per_token_s": t / tokens,
            "flops": sum(w.flops for w in step_work),
            "attention_flops": sum(w.attention_flops for w in step_work),
            "bytes": sum(w.bytes for w in step_work),
            "compute_floor_s": cf,
            "memory_floor_s": mf,
            "floor_s": bound,
            "x_floor": t / bound if bound > 0 else math.inf,
            "achieved_flops_per_s": sum(w.flops for w in step_work) / t,
        })
    _add_relative(rows)
    doc_fit = None
    calib = [(c, r) for c, r in zip(comps, rows) if c.mode == "calibrate"]
    if calib:
        stats = engine.startup_stats()
        model = BucketCostModel.fit([c.steps[0] for c, _ in calib], [r["time_s"] for _, r in calib],
                                    runner.buckets, source={"model": cfg.model, "dtype": cfg.dtype,
                                                            "max_num_seqs": cfg.max_num_seqs,
                                                            "attention_backend": cfg.attention_backend,
                                                            "platform": stats["platform"],
                                                            "device": stats["device"],
                                                            "kv_cache_bytes": stats.get("kv_cache_bytes")})
        for (c, r) in calib:
            r["fit_s"] = model.chunks_time(c.steps[0])
        doc_fit = model.to_dict()
    return {
        "tool": "sarathi_jax.bench.step_cost",
        "argv": list(args.argv) if args.argv is not None else sys.argv[1:],
        "engine": {"model": cfg.model, "dtype": cfg.dtype, "token_budget": cfg.token_budget,
                   "buckets": list(runner.buckets), "max_num_seqs": cfg.max_num_seqs,
                   "max_model_len": engine.max_model_len, "block_size": cfg.block_size,
                   "num_blocks": engine.block_manager.num_total_blocks,
                   "attention_backend": cfg.attention_backend, "num_params": num_params(runner.params),
                   "layer_matmul_params": shape.layer_matmul_params, "head_params": shape.head_params},
        "rates": {"matmul_flops_per_s": rates.matmul_flops, "bandwidth_bytes_per_s": rates.bandwidth,
                  **rates.details},
        "repeats": args.repeats,
        "timing": "median of the repeats, round-robin over all compositions in one process",
        "rows": rows,
        **({"cost_model": doc_fit} if doc_fit else {}),
    }


def _add_relative(rows: list[dict]) -> None:
    """Hybrid: slowdown over the decode batch alone; chunking: overhead over the unchunked prefill."""
    base = next((r for r in rows if r["mode"] == "hybrid" and r.get("added") == "none"), None)
    for r in rows:
        if r["mode"] == "hybrid" and base is not None:
            r["vs_decode_alone"] = r["time_s"] / base["time_s"]
    for r in rows:
        if r["mode"] != "chunking" or r.get("probe") == "iteration":
            continue
        ref = next((u for u in rows if u["mode"] == "chunking" and not u.get("probe")
                    and u.get("chunk") == u.get("prompt_len") == r.get("prompt_len")), None)
        if ref is not None:
            r["overhead"] = r["time_s"] / ref["time_s"] - 1.0
