"""Drive a scheduler through the real engine core and check its invariants on every batch.

`run_trace` feeds requests by step into `EngineCore` (the one serving loop of the engine and the simulator)
with the simulator's `CostModelExecutor` as the executor. The core calls the scheduler through
`CheckedScheduler`, which checks every batch `schedule()` hands out, and through a tracking executor, which
knows the batches dispatched and not yet retired. All three loop modes: synchronous and overlapped
(pipeline depth 1), and pipeline parallel (depth > 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sarathi_jax.core.admission import Admission, AdmissionError, KVCapacity
from sarathi_jax.scheduler.block_manager import BlockManager
from sarathi_jax.core.engine_core import EngineCore, LoopConfig, RequestState
from sarathi_jax.request.outputs import RequestOutput
from sarathi_jax.request.sampling_params import SamplingParams
from sarathi_jax.scheduler import Scheduler, SchedulerConfig, SchedulerOutput, make_scheduler
from sarathi_jax.request.sequence import PENDING_TOKEN, Sequence, SequenceStatus
from sarathi_jax.sim.simulator import CostModel, CostModelExecutor
from sarathi_jax.request.tokenizer import StopStringChecker


@dataclass(frozen=True)
class Req:
    arrival_step: int
    prompt_len: int
    max_tokens: int
    family: int = 0  # prompts of one family share their tokens up to the shorter one's length (prefix caching)
    priority: int = 0  # served first when lower, under scheduling_policy="priority"


@dataclass
class RunResult:
    seqs: list[Sequence]
    first_scheduled: dict[str, int] = field(default_factory=dict)  # seq_id -> step
    refused: dict[str, AdmissionError] = field(default_factory=dict)  # seq_id -> why admission refused it
    num_steps: int = 0
    num_preemptions: int = 0
    outputs: list[SchedulerOutput] = field(default_factory=list)  # one per step (schedule() call), in order
    final: dict[str, RequestOutput] = field(default_factory=dict)  # the core's last output of each request
    max_in_flight: int = 0  # most batches dispatched and not yet retired when schedule() was called
    num_overlapped_chunks: int = 0  # chunks of a sequence whose previous batch was still in flight


# ------------------------------------------------------------------------------------------ executor


class _TrackedStep:
    def __init__(self, executor: TrackingExecutor, batch: _Batch, handle: Any) -> None:
        self._executor, self._batch, self._handle = executor, batch, handle
        self.num_padded_tokens = handle.num_padded_tokens

    def result(self) -> Any:
        sampled = self._handle.result()
        self._executor.retired(self._batch, sampled)
        return sampled


@dataclass(eq=False)
class _Batch:
    chunks: tuple
    retired: bool = False


class TrackingExecutor:
    """Wraps an `engine_api.Executor`: knows which batches are in flight (dispatched, result not fetched)
    and which token each retired batch sampled for each (sequence, position)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.in_flight: list[_Batch] = []
        self.sampled: dict[tuple[str, int], int] = {}  # (seq_id, token index) -> sampled token id

    def submit(self, chunks, sampling_of, token_bitmask=None) -> _TrackedStep:
        batch = _Batch(tuple(chunks))
        self.in_flight.append(batch)
        return _TrackedStep(self, batch, self.inner.submit(chunks, sampling_of, token_bitmask))

    def retired(self, batch: _Batch, sampled: Any) -> None:
        if batch.retired:
            return
        assert self.in_flight[0] is batch, "batches must retire in dispatch order"
        self.in_flight.pop(0)
        batch.retired = True
        for i, c in enumerate(batch.chunks):
            if c.needs_sample:
                self.sampled[(c.seq.seq_id, c.start_position + c.num_new_tokens)] = int(sampled.token_ids[i])

    def in_flight_seq_ids(self) -> set[str]:
        return {c.seq.seq_id for b in self.in_flight for c in b.chunks}

    def now(self) -> float:
        return self.inner.now()


# ------------------------------------------------------------------------------------------ checks


def check_output(out: SchedulerOutput, cfg: SchedulerConfig, sched: Scheduler, in_flight_ids: set[str]) -> None:
    """Limits and shape of one batch. `in_flight_ids`: sequences that must not be in it (pipeline rule)."""
    n = out.num_batched_tokens
    assert n == sum(c.num_new_tokens for c in out.chunks)
    assert len(out.chunks) <= cfg.max_num_seqs
    assert sched.num_running <= cfg.max_num_seqs
    ids = [c.seq.seq_id for c in out.chunks]
    assert len(ids) == len(set(ids)), "a sequence twice in one batch"
    assert not set(ids) & in_flight_ids, "a sequence scheduled while in flight (pipeline rule)"
    if sched.uses_token_budget:
        lone_big_prompt = (
            cfg.policy == "hybrid_batching_only" and len(out.chunks) == 1 and n > cfg.token_budget
            and out.chunks[0].needs_sample
        )
        assert n <= cfg.token_budget or lone_big_prompt, (cfg.policy, n)
    else:
        assert n <= cfg.max_num_batched_tokens, (cfg.policy, n)
    bm = sched.block_manager
    bs = bm.block_size
    for c in out.chunks:
        seq = c.seq
        assert seq.status is SequenceStatus.RUNNING
        assert c.start_position == seq.num_computed_tokens
        assert len(seq.block_table) * bs >= c.start_position + c.num_new_tokens
        if not sched.chunks_prompts and not c.is_decode:  # whole-prompt policies never split
            # ... but start after a cached prefix (whole blocks, which prefix caching alone gives)
            prefix_ok = c.start_position == 0 or (bm.enable_prefix_caching and c.start_position % bs == 0)
            assert prefix_ok and c.needs_sample, (cfg.policy, c)
        # The blocks a chunk writes belong to it alone and hold no cached prefix: a shared or registered
        # block is never rewritten.
        for block in {seq.block_table[p // bs] for p in range(c.start_position, c.start_position + c.num_new_tokens)}:
            assert bm.ref_count(block) == 1 and not bm.is_cached(block), (seq, block, bm.ref_count(block))
    kinds = {c.is_decode for c in out.chunks}
    if cfg.policy in ("vllm", "simple_chunking", "chunked_prefills_only", "faster_transformer"):
        assert len(kinds) <= 1, f"{cfg.policy} mixed prefills and decodes in one batch"


class CheckedScheduler:
    """The scheduler as the core sees it: every call goes to `inner`; `schedule()` checks the batch it
    returns against the loop mode and the batches in flight, and records it in `result`."""

    def __init__(self, inner: Scheduler, cfg: SchedulerConfig, loop: LoopConfig, executor: TrackingExecutor,
                 result: RunResult) -> None:
        self.inner, self.cfg, self.loop, self.executor, self.result = inner, cfg, loop, executor, result
        self.step = 0
        self.slots: dict[int, tuple[Sequence, int]] = {}  # KV slot -> (sequence, position) whose K/V it holds

    def _check_and_record_kv(self, out: SchedulerOutput) -> None:
        """What each chunk reads (its positions before start_position) is what its own tokens there would
        write, whoever wrote it (a cached prefix); then record what it writes."""
        bs = self.inner.block_manager.block_size
        for c in out.chunks:
            seq = c.seq
            for p in range(c.start_position + c.num_new_tokens):
                slot = seq.block_table[p // bs] * bs + p % bs
                if p >= c.start_position:
                    self.slots[slot] = (seq, p)
                    continue
                writer, q = self.slots[slot]
                mine, theirs = seq.token_ids[p], writer.token_ids[q] if q < writer.num_tokens else None
                assert q == p and (PENDING_TOKEN in (mine, theirs) or mine == theirs), (seq, p, writer, q)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def schedule(self, now: float | None = None) -> SchedulerOutput:
        sched, cfg, res = self.inner, self.cfg, self.result
        in_flight = self.executor.in_flight
        # The core retires down to max_in_flight - 1 batches before it schedules again.
        assert len(in_flight) < self.loop.max_in_flight, (len(in_flight), self.loop)
        res.max_in_flight = max(res.max_in_flight, len(in_flight))
        in_flight_ids = self.executor.in_flight_seq_ids()
        pipelined = self.loop.pipeline_depth > 1
        for s in sched.running + sched.waiting:
            # Outputs on the host that reach max_tokens finish the sequence when they arrive.
            assert s.num_output_tokens < s.sampling_params.max_tokens, s
            # A sampled token is pending only while its batch is in flight, and a sequence is in at most one
            # batch in flight when the core schedules (the synchronous loop has none in flight by then).
            assert s.num_pending_tokens <= 1 and (not s.num_pending_tokens or s.seq_id in in_flight_ids), s

        def ready(s: Sequence) -> bool:
            """May run now: not in a micro-batch in flight (PP), and not already holding, pending tokens
            included, all its outputs (the overlapped loop: it only waits for the host to finish it)."""
            if pipelined and s.seq_id in in_flight_ids:
                return False
            return s.num_generated_tokens < s.sampling_params.max_tokens

        ready_decodes = [s for s in sched.running if s.is_decode and ready(s)]

        out = sched.schedule(now)

        # Depth 1 (overlapped loop): a sequence may run again while its previous batch is in flight; that is
        # the point. Depth > 1: never (its K/V are not written yet).
        check_output(out, cfg, sched, in_flight_ids if pipelined else set())
        self._check_and_record_kv(out)
        res.outputs.append(out)
        for c in out.chunks:
            res.first_scheduled.setdefault(c.seq.seq_id, self.step)
            assert ready(c.seq), f"{c.seq!r} scheduled though not ready"
            tokens = c.seq.token_ids[c.start_position : c.start_position + c.num_new_tokens]
            pending = [i for i, t in enumerate(tokens) if t == PENDING_TOKEN]
            # A pending token (sampled by the batch in flight) may only be the chunk's last input.
            assert pending in ([], [len(tokens) - 1]), (c, pending)
            if c.seq.seq_id in in_flight_ids:
                res.num_overlapped_chunks += 1
        scheduled = {c.seq.seq_id for c in out.chunks}
        preempted = {s.seq_id for s in out.preempted}
        if cfg.policy == "sarathi":  # stall-free: every ready decode runs unless preempted
            stalled = [s.seq_id for s in ready_decodes if s.seq_id not in scheduled | preempted]
            assert not stalled, f"decodes stalled: {stalled}"
        for s in out.preempted:
            # One that holds all its outputs frees its blocks once the host finishes it; evicting it would
            # only queue a recompute of tokens nobody will use.
            assert s.num_tokens < s.max_total_tokens, f"{s!r} preempted with all its outputs"
            if s.status is SequenceStatus.RUNNING:  # re-admitted at once after its cached prefix (in the batch)
                assert self.inner.block_manager.enable_prefix_caching and s.seq_id in scheduled, s
            else:
                assert s.status is SequenceStatus.WAITING and not s.block_table and s.num_computed_tokens == 0
            assert not (pipelined and s.seq_id in in_flight_ids), f"{s!r} preempted while in flight"
        return out


# ------------------------------------------------------------------------------------------ runs


def run_trace(
    cfg: SchedulerConfig,
    num_blocks: int,
    block_size: int,
    reqs: list[Req],
    *,
    pp_depth: int = 1,
    async_scheduling: bool = False,
    prefix_caching: bool = False,
    max_steps: int | None = None,
) -> RunResult:
    """Run `reqs` (sorted by arrival_step) to completion on an `EngineCore`: request i is added before step
    `reqs[i].arrival_step`, and each step is one `core.step()` (one `schedule()` call). Loop mode: pipeline
    depth `pp_depth`; at depth 1, `async_scheduling` picks the overlapped loop over the synchronous one.
    Prompts of one `Req.family` share their leading tokens, which `prefix_caching` reuses."""
    loop = LoopConfig(async_scheduling=async_scheduling, pipeline_depth=pp_depth)
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    sched = make_scheduler(cfg, bm)
    executor = TrackingExecutor(CostModelExecutor(CostModel()))
    seqs = [Sequence(f"s{i}", [1000 * r.family + t for t in range(1, r.prompt_len + 1)],
                     SamplingParams(max_tokens=r.max_tokens), float(r.arrival_step), r.priority)
            for i, r in enumerate(reqs)]
    res = RunResult(seqs)
    checked = CheckedScheduler(sched, cfg, loop, executor, res)
    core = EngineCore(checked, executor, loop=loop)
    # Requests reach the core through admission, as in the engines: one that could never run is refused there.
    admission = Admission(vocab_size=1 << 30, max_model_len=cfg.max_model_len, kv_cache=KVCapacity.of(bm))
    if max_steps is None:
        max_steps = 200 + 20 * sum(r.prompt_len + r.max_tokens for r in reqs)
    streamed: dict[str, list[int]] = {}
    nxt, step = 0, 0
    while nxt < len(reqs) or core.has_unfinished_requests():
        assert step < max_steps, f"no completion after {max_steps} steps: {sched.running} {sched.waiting}"
        while nxt < len(reqs) and reqs[nxt].arrival_step <= step:
            seq = seqs[nxt]
            nxt += 1
            try:
                admission.check(seq.prompt_token_ids, seq.sampling_params)
            except AdmissionError as e:
                res.refused[seq.seq_id] = e
                continue
            core.add(RequestState(seq, seed=0, banned_until_min_tokens=(), detokenizer=None,
                                  stop_checker=StopStringChecker(())))
            streamed[seq.seq_id] = []
        checked.step = step
        for out in core.step():
            assert out.request_id not in res.final, f"{out.request_id} got an output after it finished"
            streamed[out.request_id].extend(out.new_token_ids)
            assert tuple(streamed[out.request_id]) == out.token_ids
            if out.finished:
                res.final[out.request_id] = out
        bm.check_invariants(list(sched.running) + list(sched.waiting))
        assert all(not s.block_table for s in sched.waiting)
        step += 1
    res.num_steps = step
    res.num_preemptions = sched.num_preemptions
    assert not executor.in_flight and not sched.has_unfinished()
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == num_blocks
    for seq in seqs:
        if seq.seq_id in res.refused:
            assert seq.seq_id not in res.final and seq.seq_id not in res.first_scheduled
            continue
        out = res.final[seq.seq_id]
        assert out.finish_reason == seq.finish_reason and list(out.token_ids) == seq.output_token_ids
        assert seq.num_pending_tokens == 0 and not seq.block_table
        # Each output token is the one the executor sampled at its position.
        P = seq.num_prompt_tokens
        assert seq.output_token_ids == [executor.sampled[(seq.seq_id, P + i)] for i in range(seq.num_output_tokens)]
    return res


def complete(sched: Scheduler, out: SchedulerOutput) -> None:
    """For scheduler unit tests that call `schedule()` by hand, without a core: what the synchronous core does
    when `out` retires (on_step_done, a dummy token where sampled, finish at max_tokens)."""
    sched.on_step_done(out)
    for c in out.chunks:
        seq = c.seq
        if c.needs_sample and seq.status is SequenceStatus.RUNNING:
            seq.append_token(seq.num_tokens % 97)
            if seq.num_output_tokens >= seq.sampling_params.max_tokens:
                sched.finish_sequence(seq, "length")
