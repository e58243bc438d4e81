"""`python -m sarathi_jax.bench.loop_cost`: the synchronous and the overlapped engine loop, side by side.

It drives the real engine (`LLMEngine`, sarathi scheduler, the model runner) twice in one process: one engine
with `EngineConfig(async_scheduling=False)` (dispatch, wait, postprocess) and one with `async_scheduling=True`
(batch N+1 is scheduled and dispatched before batch N's tokens are fetched; see sarathi_jax/engine_core.py).
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

Device time: the runner's `submit` and `_dispatch` are wrapped (on the instance) to keep the packed int32
inputs, the sampler variant and the chunk layout of the last K dispatched steps. Right after the timed blocks
of a round, each engine replays its block's K steps with the runner's own `_dispatch(packed, variant,
timed=False)`: `--replays` M dispatches back to back (cycling over the K steps), one wait at the end; device
ms per step = time / M, median over the rounds. Measured in the same round as the wall times it is compared
with, so that drifting background load hits both. A plain replay would write stale K/V into live sequences'
slots and feed its own samples to the next real step's pending tokens, so the replays are shadowed
(`ShadowReplayer`): the copies' K/V writes go to scratch blocks reserved from the engine's block manager
(the attention still reads the real block tables, so the work is the same) and the runner's previous sampled
tokens are restored afterwards. `decode_tokens_agree` in the JSON checks it: greedy decodes of both loops
must produce the same tokens. On a CPU "device" means XLA:CPU's threads, which share the cores with the host
thread. Between batch sizes every request is aborted and drained; the engines are reused (compiled once).

Derived: device busy fraction = device / wall mean, per round, median over rounds; host ms exposed = wall
mean - device; host ms per step hidden by the overlap = sync wall mean - async wall mean. Also the host CPU
time per step: `time.thread_time()` of the thread calling `engine.step()` (what the overlap can hide at
most; unlike wall differences it barely moves with background load, which on a shared machine swamps
differences of a few ms).

Floors (reusing `sarathi_jax.bench.step_cost`): this machine's matmul rate and memory bandwidth (best of
`--rate-repeats`, measured before and after the timed phases, the better kept), and for each replayed step
`step_cost.work` (FLOPs: 2 x matmul params x tokens + LM head x sampled rows + attention; bytes: weights +
KV read + KV written): compute floor = FLOPs / matmul rate, memory floor = bytes / bandwidth, averaged over
the K steps; `x floor` = wall / max(floors).

Checks recorded in the JSON: `engine.core.num_in_flight` after every timed step (overlapped: 1, sync: 0),
compilations during the timed phases (0: every bucket was compiled by warm-up), decodes per timed step (= B).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from sarathi_jax.bench.step_cost import Chunk, ModelShape, Rates, floors, fmt_ms, measure_rates, work

LOOPS: dict[str, bool] = {"sync": False, "async": True}  # loop name -> EngineConfig.async_scheduling
WORKLOADS = ("decode", "mixed")
_MODEL_LIMIT_MARGIN = 32  # extra tokens of max_model_len beyond the steps a decode can possibly take


# ----------------------------------------------------------------------------------------------- config


@dataclass(frozen=True)
class LoopBenchConfig:
    """One run: the engine both loops share (model .. block_size), the workloads, and the timing plan (K =
    `steps` timed steps per loop per round, R = `rounds`, M = `replays` dispatches per device replay)."""

    model: str = "tiny-llama"
    dtype: str = "float32"
    token_budget: int = 256
    max_num_seqs: int = 64  # raised to max(batches) + 2 (a prefill and its successor next to the decodes)
    batches: tuple[int, ...] = (1, 8, 32)
    workloads: tuple[str, ...] = WORKLOADS
    context: int = 256
    prompt_len: int = 1024
    steps: int = 8
    rounds: int = 5
    replays: int | None = None  # dispatches per replay round; None: `steps`
    attention_backend: str = "xla"
    block_size: int = 16
    seed: int = 0
    matmul_rate: float | None = None  # FLOP/s, instead of measuring
    bandwidth: float | None = None  # bytes/s, instead of measuring
    matmul_n: int = 2048
    bandwidth_mb: int = 256
    rate_repeats: int = 3

    def __post_init__(self) -> None:
        for name in ("token_budget", "context", "prompt_len", "steps", "rounds", "block_size", "rate_repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not self.batches or min(self.batches) < 1:
            raise ValueError(f"batches must be positive, got {self.batches}")
        if max(self.batches) >= self.token_budget:
            raise ValueError(f"the mixed workload needs token_budget > the largest batch ({max(self.batches)})")
        if not self.workloads or set(self.workloads) - set(WORKLOADS):
            raise ValueError(f"workloads must be some of {WORKLOADS}, got {self.workloads}")
        if self.replays is not None and self.replays < 1:
            raise ValueError(f"replays must be positive, got {self.replays}")

    @property
    def num_replays(self) -> int:
        return self.replays or self.steps

    @property
    def num_seqs(self) -> int:
        return max(self.max_num_seqs, max(self.batches) + 2)


@dataclass(frozen=True)
class EngineSize:
    """max_model_len and KV blocks for the largest batch, every phase included."""

    max_model_len: int
    num_blocks: int
    decode_max_tokens: int


def engine_size(cfg: LoopBenchConfig) -> EngineSize:
    """Enough room that no decode finishes or is preempted during a run: a decode grows by at most one token
    per step, and a batch size runs (prefill steps + 2) + 2 phases x rounds x (steps + 1) + mixed warm-up."""
    b = max(cfg.batches)
    prefill_steps = -(-b * cfg.context // cfg.token_budget) + b + 2
    mixed_warmup = -(-cfg.prompt_len // (cfg.token_budget - b)) + 2
    growth = prefill_steps + mixed_warmup + 2 * cfg.rounds * (cfg.steps + 1) + _MODEL_LIMIT_MARGIN
    max_len = max(cfg.context + growth, cfg.prompt_len + 1)
    per_seq = -(-max_len // cfg.block_size)
    scratch = -(-cfg.token_budget // cfg.block_size)  # ShadowReplayer's
    blocks = b * per_seq + 3 * (-(-cfg.prompt_len // cfg.block_size)) + scratch + 8
    blocks = int(blocks * 1.05) + 1  # the scheduler's 1% watermark
    return EngineSize(max_len, blocks, max_len - cfg.context)


# ----------------------------------------------------------------------------------------------- step capture


@dataclass(frozen=True)
class CapturedStep:
    """One dispatched step, enough to replay it (`packed`, `variant`) and to count its work (`chunks`)."""

    packed: Any  # step_inputs.PackedStep (host arrays)
    variant: Any  # sampling.SamplerVariant
    chunks: tuple[Chunk, ...]

    @property
    def num_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)

    @property
    def num_decodes(self) -> int:
        return sum(1 for c in self.chunks if c.num_new_tokens == 1 and c.start > 0 and c.sample)

    @property
    def prefill_tokens(self) -> int:
        return self.num_tokens - self.num_decodes


class StepRecorder:
    """Wraps `runner.submit` and `runner._dispatch` on the instance and keeps the last `keep` steps."""

    def __init__(self, runner: Any, keep: int) -> None:
        self.runner = runner
        self.steps: deque[CapturedStep] = deque(maxlen=keep)
        self.dispatch = runner._dispatch  # the runner's own, unwrapped
        self._submit = runner.submit
        self._last: tuple[np.ndarray, Any] | None = None
        runner._dispatch = self._wrapped_dispatch
        runner.submit = self._wrapped_submit

    def _wrapped_dispatch(self, packed: Any, variant: Any, *, timed: bool = True) -> Any:
        self._last = (packed, variant)
        return self.dispatch(packed, variant, timed=timed)

    def _wrapped_submit(self, chunks: Sequence[Any], rows: Sequence[tuple]) -> Any:
        pending = self._submit(chunks, rows)
        assert self._last is not None
        layout = tuple(Chunk(c.start_position, c.num_new_tokens, None if c.needs_sample else c.seq.num_tokens)
                       for c in chunks)
        self.steps.append(CapturedStep(self._last[0], self._last[1], layout))
        return pending

    def snapshot(self) -> list[CapturedStep]:
        return list(self.steps)


class ShadowReplayer:
    """Replays captured steps on a live engine without disturbing it: each replayed step's K/V writes go to
    scratch KV blocks reserved from the engine's block manager (the reads, the attention over the real
    block tables, are unchanged), and the runner's previous sampled tokens, which a pending input token
    reads, are restored afterwards. So the work per step is the captured step's, and the engine can go on."""

    def __init__(self, engine: Any, recorder: StepRecorder, num_tokens: int) -> None:
        from sarathi_jax.sampling_params import SamplingParams
        from sarathi_jax.sequence import Sequence as Seq

        self.runner = engine.runner
        self.dispatch = recorder.dispatch
        bm = engine.block_manager
        self._scratch = Seq("loop-cost-scratch", [0] * num_tokens, SamplingParams(max_tokens=1), 0.0)
        if not bm.can_allocate(bm.blocks_needed(self._scratch, num_tokens), use_watermark=False):
            raise RuntimeError("no KV blocks left for the replay scratch area")
        bm.allocate(self._scratch, num_tokens)  # never freed: the scratch blocks live as long as the engine
        bs = bm.block_size
        self.slots = np.asarray([b * bs + j for b in self._scratch.block_table for j in range(bs)], np.int32)

    def shadow(self, packed: Any) -> Any:
        """A copy of `packed` (a `PackedStep`) whose real tokens write their K/V to distinct scratch slots."""
        from sarathi_jax.step_inputs import BatchLayout

        r = self.runner
        batch = packed.batch.copy()
        slot_mapping = BatchLayout.of_packed(batch.size, r.max_num_seqs, r.max_blocks_per_seq).host_views(batch)[
            "slot_mapping"]
        real = slot_mapping >= 0
        slot_mapping[real] = self.slots[: int(real.sum())]
        return packed._replace(batch=batch)

    def replay(self, steps: Sequence[CapturedStep], count: int) -> float:
        """Seconds for `count` back-to-back dispatches cycling over `steps`, one wait at the end. The work
        already queued is waited for first, so it is not counted."""
        import jax

        shadows = [(self.shadow(s.packed), s.variant) for s in steps]
        prev_tokens = self.runner._prev_tokens
        jax.block_until_ready(self.runner.kv_caches)
        start = time.perf_counter()
        pending = None
        for i in range(count):
            packed, variant = shadows[i % len(shadows)]
            pending = self.dispatch(packed, variant, timed=False)
        assert pending is not None
        pending.result()
        jax.block_until_ready(self.runner.kv_caches)
        elapsed = time.perf_counter() - start
        self.runner._prev_tokens = prev_tokens
        return elapsed


# ----------------------------------------------------------------------------------------------- the engines


@dataclass
class Driven:
    """One engine under test, its step recorder and replayer, and the requests it holds."""

    loop: str
    engine: Any
    recorder: StepRecorder
    replayer: ShadowReplayer
    request_ids: list[str] = field(default_factory=list)
    decode_ids: list[str] = field(default_factory=list)
    next_id: int = 0

    def add(self, prompt: list[int], params: Any, *, decode: bool = False) -> None:
        rid = f"{self.loop}-{self.next_id}"
        self.next_id += 1
        self.engine.add_request(rid, prompt, params)
        self.request_ids.append(rid)
        if decode:
            self.decode_ids.append(rid)

    def decode_outputs(self) -> list[list[int]]:
        """The tokens the decode requests have generated so far (resolved ones), in the order they were added."""
        by_id = {s.seq_id: s for s in self.engine.scheduler.running}
        return [list(by_id[rid].output_token_ids) for rid in self.decode_ids]

    def reset(self) -> None:
        """Abort every request and step until nothing is in flight or pending."""
        for rid in self.request_ids:
            self.engine.abort(rid)
        self.request_ids.clear()
        self.decode_ids.clear()
        while self.engine.has_unfinished_requests():
            self.engine.step()


def build_engines(cfg: LoopBenchConfig, size: EngineSize, log: Callable[[str], None]) -> dict[str, Driven]:
    from sarathi_jax.config import EngineConfig
    from sarathi_jax.engine import LLMEngine

    out = {}
    for loop, async_scheduling in LOOPS.items():
        t0 = time.perf_counter()
        engine = LLMEngine(EngineConfig(
            model=cfg.model, dtype=cfg.dtype, token_budget=cfg.token_budget, max_num_seqs=cfg.num_seqs,
            block_size=cfg.block_size, num_blocks=size.num_blocks, max_model_len=size.max_model_len,
            scheduler="sarathi", attention_backend=cfg.attention_backend, seed=cfg.seed,
            async_scheduling=async_scheduling,
        ), warmup=False)
        assert engine.max_model_len == size.max_model_len, (engine.max_model_len, size)
        warm_up_greedy(engine.runner)
        log(f"built the {loop} engine (async_scheduling={async_scheduling}) with warm-up in "
            f"{time.perf_counter() - t0:.1f} s")
        recorder = StepRecorder(engine.runner, keep=cfg.steps)
        out[loop] = Driven(loop, engine, recorder, ShadowReplayer(engine, recorder, cfg.token_budget))
    return out


def warm_up_greedy(runner: Any) -> None:
    """Compile every bucket with the one sampler variant this benchmark uses (greedy), not all of them like
    `ModelRunner.warmup`; `compilations_during_timing` in the JSON checks that nothing else was needed."""
    from sarathi_jax.sampling import sampler_variant
    from sarathi_jax.sampling_params import SamplingParams

    variant = sampler_variant([(SamplingParams(temperature=0.0), 0, 0, ())])
    for bucket in runner.buckets:
        runner._dispatch(runner._layout(bucket).empty(), variant, timed=False).result()


def all_decoding(engine: Any, batch: int) -> bool:
    running = engine.scheduler.running
    return (engine.scheduler.num_waiting == 0 and len(running) == batch
            and all(s.num_generated_tokens >= 1 for s in running))


# ----------------------------------------------------------------------------------------------- timing


@dataclass
class LoopTimes:
    """Timed steps of one loop in one (batch, workload) cell."""

    wall_s: list[float] = field(default_factory=list)
    thread_s: list[float] = field(default_factory=list)  # the calling thread's CPU time in each timed step
    round_means_s: list[float] = field(default_factory=list)
    device_s: list[float] = field(default_factory=list)  # replayed seconds per step, per round
    in_flight: list[int] = field(default_factory=list)  # engine.core.num_in_flight after each timed step
    compilations: int = 0  # runner compilations during the timed steps
    captured: list[CapturedStep] = field(default_factory=list)  # the last round's steps


def timed_block(d: Driven, steps: int, feed: Callable[[Driven], None], times: LoopTimes) -> None:
    """One untimed lead-in step, then `steps` timed `engine.step()` calls (`feed` runs before each, untimed)."""
    gc.collect()
    feed(d)
    d.engine.step()
    before = d.engine.runner.num_compilations
    walls = []
    for _ in range(steps):
        feed(d)
        c0, t0 = time.thread_time(), time.perf_counter()
        d.engine.step()
        walls.append(time.perf_counter() - t0)
        times.thread_s.append(time.thread_time() - c0)
        times.in_flight.append(d.engine.core.num_in_flight)
    times.compilations += d.engine.runner.num_compilations - before
    times.wall_s.extend(walls)
    times.round_means_s.append(statistics.fmean(walls))
    times.captured = d.recorder.snapshot()


def interleaved_rounds(engines: dict[str, Driven], cfg: LoopBenchConfig,
                       feed: Callable[[Driven], None]) -> dict[str, LoopTimes]:
    """R rounds; in each, a timed block on every engine, then a replay of each block's steps (the order
    of the engines alternates from round to round)."""
    out = {loop: LoopTimes() for loop in engines}
    order = list(engines)
    for r in range(cfg.rounds):
        this_round = order if r % 2 == 0 else order[::-1]
        for loop in this_round:
            timed_block(engines[loop], cfg.steps, feed, out[loop])
        for loop in this_round:
            t = engines[loop].replayer.replay(out[loop].captured, cfg.num_replays)
            out[loop].device_s.append(t / cfg.num_replays)
    return out


def run_batch(engines: dict[str, Driven], cfg: LoopBenchConfig, size: EngineSize, batch: int,
              log: Callable[[str], None]) -> tuple[dict[str, dict[str, LoopTimes]], dict]:
    """Both workloads at one batch size; returns the timings and a check that both loops generated the same
    tokens for the decode requests (greedy: they must, unless the replays disturbed an engine)."""
    from sarathi_jax.sampling_params import SamplingParams

    rng = np.random.default_rng(cfg.seed + batch)
    vocab = next(iter(engines.values())).engine.model_config.vocab_size
    prompts = [rng.integers(3, vocab, size=cfg.context).tolist() for _ in range(batch)]
    decode_params = SamplingParams(temperature=0.0, max_tokens=size.decode_max_tokens, ignore_eos=True)
    long_params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    long_prompt = rng.integers(3, vocab, size=cfg.prompt_len).tolist()

    t0 = time.perf_counter()
    for d in engines.values():
        for p in prompts:
            d.add(p, decode_params, decode=True)
        n = 0
        while not all_decoding(d.engine, batch):
            d.engine.step()
            n += 1
            if n > 10 * (batch * cfg.context // cfg.token_budget + batch + 10):
                raise RuntimeError(f"{d.loop}: {batch} prompts of {cfg.context} tokens never all started decoding")
        d.engine.step()
        d.engine.step()
    log(f"batch {batch}: prompts prefilled in {time.perf_counter() - t0:.1f} s")

    cells: dict[str, dict[str, LoopTimes]] = {}
    if "decode" in cfg.workloads:
        t0 = time.perf_counter()
        cells["decode"] = interleaved_rounds(engines, cfg, lambda d: None)
        log(f"batch {batch}: decode rounds in {time.perf_counter() - t0:.1f} s")

    def feed(d: Driven) -> None:
        if d.engine.scheduler.num_waiting == 0:
            d.add(long_prompt, long_params)

    if "mixed" in cfg.workloads:
        t0 = time.perf_counter()
        for d in engines.values():
            for _ in range(-(-cfg.prompt_len // (cfg.token_budget - batch)) + 2):
                feed(d)
                d.engine.step()
        cells["mixed"] = interleaved_rounds(engines, cfg, feed)
        log(f"batch {batch}: mixed rounds in {time.perf_counter() - t0:.1f} s")

    outputs = {loop: d.decode_outputs() for loop, d in engines.items()}
    check = tokens_agree(outputs["sync"], outputs["async"])
    for d in engines.values():
        d.reset()
    return cells, check


def tokens_agree(a: list[list[int]], b: list[list[int]]) -> dict:
    """Compare two loops' decode outputs over their common length."""
    common = [min(len(x), len(y)) for x, y in zip(a, b)]
    same = [x[:n] == y[:n] for x, y, n in zip(a, b, common)]
    return {"num_requests": len(a), "tokens_compared": sum(common), "all_equal": all(same) and len(a) == len(b),
            "num_equal": sum(same)}


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


def best_rates(a: Rates, b: Rates) -> Rates:
    return Rates(max(a.matmul_flops, b.matmul_flops), max(a.bandwidth, b.bandwidth),
                 {"before": a.details, "after": b.details, "rule": "best of repeats, before and after timing"})


def measure(cfg: LoopBenchConfig, log: Callable[[str], None] = print) -> dict:
    """Run every batch size on one pair of engines; returns the JSON document."""
    info = platform_info()
    log(f"JAX {info['jax']} on {info['backend']}: {info['device']} ({info['device_kind']}), "
        f"{info['cpu_count']} CPUs")
    size = engine_size(cfg)

    def rates_now() -> Rates:
        r = measure_rates(cfg.dtype, cfg.matmul_n, cfg.bandwidth_mb, repeats=cfg.rate_repeats,
                          matmul_rate=cfg.matmul_rate, bandwidth=cfg.bandwidth)
        log(f"matmul {r.matmul_flops / 1e9:.1f} GFLOP/s ({cfg.dtype}), bandwidth {r.bandwidth / 1e9:.2f} GB/s")
        return r

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
    num_params = sum(int(x.size) for x in _leaves(any_engine.runner.params))
    return {
        "tool": "sarathi_jax.bench.loop_cost",
        "config": {**asdict(cfg), "batches": list(cfg.batches)},
        "platform": info,
        "engine": {"model": cfg.model, "dtype": cfg.dtype, "num_params": num_params,
                   "token_budget": cfg.token_budget, "buckets": list(any_engine.runner.buckets),
                   "max_num_seqs": cfg.num_seqs, "max_model_len": size.max_model_len,
                   "num_blocks": size.num_blocks, "block_size": cfg.block_size,
                   "attention_backend": cfg.attention_backend},
        "rates": {"matmul_flops_per_s": rates.matmul_flops, "bandwidth_bytes_per_s": rates.bandwidth,
                  **rates.details},
        "rows": rows,
        "decode_tokens_agree": {str(b): c for b, c in checks.items()},
    }


def _leaves(tree: Any) -> list:
    import jax

    return jax.tree_util.tree_leaves(tree)


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


def _ints(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in str(text).split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def build_parser() -> argparse.ArgumentParser:
    d = LoopBenchConfig()
    p = argparse.ArgumentParser(
        prog="python -m sarathi_jax.bench.loop_cost",
        description="Wall time per engine.step() of the synchronous and the overlapped engine loop, side by "
                    "side, with the device time of the same steps and the machine's compute and memory floors.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", default=d.model, help="preset (tiny-llama, llama-50m) or an HF checkpoint folder")
    p.add_argument("--dtype", default=d.dtype, choices=("float32", "bfloat16"))
    p.add_argument("--token-budget", type=int, default=d.token_budget)
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="raised to the largest batch + 2")
    p.add_argument("--batch", type=_ints, default=d.batches, help="comma-separated decode batch sizes")
    p.add_argument("--workloads", default=",".join(d.workloads), help=f"comma-separated, from {', '.join(WORKLOADS)}")
    p.add_argument("--context", type=int, default=d.context, help="prompt tokens of each decode request")
    p.add_argument("--prompt-len", type=int, default=d.prompt_len, help="mixed workload: new prompts' length")
    p.add_argument("--steps", type=int, default=d.steps, help="K: timed steps per loop per round")
    p.add_argument("--rounds", type=int, default=d.rounds, help="R: interleaved rounds")
    p.add_argument("--replays", type=int, default=None, help="M: dispatches per device replay round (default K)")
    p.add_argument("--attention-backend", default=d.attention_backend, choices=("xla", "pallas"))
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--matmul-rate", type=float, default=None, help="FLOP/s to use instead of measuring")
    p.add_argument("--bandwidth", type=float, default=None, help="bytes/s to use instead of measuring")
    p.add_argument("--rate-repeats", type=int, default=d.rate_repeats)
    p.add_argument("--json", default=None, metavar="PATH")
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
