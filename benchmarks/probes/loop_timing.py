"""The two engine loops of `python -m benchmarks.probes.loop_cost` under test: the run's configuration and
engine size, building and warming the engines, the workloads, and the interleaved timed rounds (wall and
thread CPU time per `engine.step()`, then a shadowed replay of the same steps for their device time).
The module docstring of `benchmarks.probes.loop_cost` describes the method.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from benchmarks.probes.step_replay import CapturedStep, ShadowReplayer, StepRecorder

if TYPE_CHECKING:
    from sarathi_jax.engine.llm_engine import LLMEngine
    from sarathi_jax.runner.model_runner import ModelRunner
    from sarathi_jax.request.sampling_params import SamplingParams

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


# ----------------------------------------------------------------------------------------------- the engines


@dataclass
class Driven:
    """One engine under test, its step recorder and replayer, and the requests it holds."""

    loop: str
    engine: LLMEngine
    recorder: StepRecorder
    replayer: ShadowReplayer
    request_ids: list[str] = field(default_factory=list)
    decode_ids: list[str] = field(default_factory=list)
    next_id: int = 0

    def add(self, prompt: list[int], params: SamplingParams, *, decode: bool = False) -> None:
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
    from sarathi_jax.config.engine_config import EngineConfig
    from sarathi_jax.engine.llm_engine import LLMEngine

    out = {}
    for loop, async_scheduling in LOOPS.items():
        t0 = time.perf_counter()
        engine = LLMEngine(EngineConfig(
            model=cfg.model, dtype=cfg.dtype, token_budget=cfg.token_budget, max_num_seqs=cfg.num_seqs,
            block_size=cfg.block_size, num_blocks=size.num_blocks, max_model_len=size.max_model_len,
            scheduler="sarathi", attention_backend=cfg.attention_backend, seed=cfg.seed,
            async_scheduling=async_scheduling,
            enable_prefix_caching=False,  # the rounds re-send the same prompts: a cache hit would change the steps
        ), warmup=False)
        assert engine.max_model_len == size.max_model_len, (engine.max_model_len, size)
        warm_up_greedy(engine.runner)
        log(f"built the {loop} engine (async_scheduling={async_scheduling}) with warm-up in "
            f"{time.perf_counter() - t0:.1f} s")
        recorder = StepRecorder(engine.runner, keep=cfg.steps)
        out[loop] = Driven(loop, engine, recorder, ShadowReplayer(engine, cfg.token_budget))
    return out


def warm_up_greedy(runner: ModelRunner) -> None:
    """Compile every bucket with the one sampler variant this benchmark uses (greedy), not all of them like
    `ModelRunner.warmup`; `compilations_during_timing` in the JSON checks that nothing else was needed."""
    from sarathi_jax.runner.input_batch import sampler_variant
    from sarathi_jax.request.sampling_params import SamplingParams
    from sarathi_jax.runner.step_inputs import BatchLayout

    variant = sampler_variant([(SamplingParams(temperature=0.0), 0, 0, ())])
    with runner.dispatch_outside_loop() as dispatch:
        for bucket in runner.buckets:  # each bucket's step, and the greedy sampler at each bucket's rows
            packed = runner.padding_step(bucket)
            rows = BatchLayout.of_packed(packed.batch.size, runner.max_num_seqs, runner.max_blocks_per_seq).num_rows
            dispatch(packed, variant, rows=rows).result()


def all_decoding(engine: LLMEngine, batch: int) -> bool:
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
    from sarathi_jax.request.sampling_params import SamplingParams

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
