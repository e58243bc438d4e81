"""A fake executor that drives a scheduler step by step and checks its invariants on every batch."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from sarathi_jax.block_manager import BlockManager
from sarathi_jax.sampling_params import SamplingParams
from sarathi_jax.scheduler import SchedulerConfig, SchedulerOutput, make_scheduler
from sarathi_jax.scheduler.config import TOKEN_BUDGET_POLICIES
from sarathi_jax.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class Req:
    arrival_step: int
    prompt_len: int
    max_tokens: int


@dataclass
class RunResult:
    seqs: list[Sequence]
    first_scheduled: dict[str, int] = field(default_factory=dict)  # seq_id -> step
    rejected_at: dict[str, int] = field(default_factory=dict)
    num_steps: int = 0
    num_preemptions: int = 0
    outputs: list[SchedulerOutput] = field(default_factory=list)


def check_output(out: SchedulerOutput, cfg: SchedulerConfig, sched, in_flight_ids: set[str]) -> None:
    n = out.num_batched_tokens
    assert n == sum(c.num_new_tokens for c in out.chunks)
    assert len(out.chunks) <= cfg.max_num_seqs
    assert sched.num_running <= cfg.max_num_seqs
    ids = [c.seq.seq_id for c in out.chunks]
    assert len(ids) == len(set(ids)), "a sequence twice in one batch"
    assert not set(ids) & in_flight_ids, "a sequence scheduled while in flight (pipeline rule)"
    if cfg.policy in TOKEN_BUDGET_POLICIES:
        lone_big_prompt = (
            cfg.policy == "hybrid_batching_only" and len(out.chunks) == 1 and n > cfg.token_budget
            and out.chunks[0].start_position == 0 and out.chunks[0].needs_sample
        )
        assert n <= cfg.token_budget or lone_big_prompt, (cfg.policy, n)
    else:
        assert n <= cfg.max_num_batched_tokens, (cfg.policy, n)
    chunking = cfg.policy in ("sarathi", "simple_chunking", "chunked_prefills_only")
    for c in out.chunks:
        seq = c.seq
        assert seq.status is SequenceStatus.RUNNING
        assert c.start_position == seq.num_computed_tokens
        assert len(seq.block_table) * sched.block_manager.block_size >= c.start_position + c.num_new_tokens
        if not chunking and not c.is_decode:  # whole-prompt policies never split a (re-)prefill
            assert c.start_position == 0 and c.needs_sample, (cfg.policy, c)
    kinds = {c.is_decode for c in out.chunks}
    if cfg.policy in ("vllm", "simple_chunking", "chunked_prefills_only", "faster_transformer"):
        assert len(kinds) <= 1, f"{cfg.policy} mixed prefills and decodes in one batch"


def run_trace(
    cfg: SchedulerConfig,
    num_blocks: int,
    block_size: int,
    reqs: list[Req],
    *,
    pp_depth: int = 1,
    max_steps: int | None = None,
) -> RunResult:
    """Run `reqs` (sorted by arrival_step) to completion with `pp_depth` outputs in flight at once."""
    bm = BlockManager(num_blocks, block_size)
    sched = make_scheduler(cfg, bm)
    seqs = [Sequence(f"s{i}", list(range(1, r.prompt_len + 1)), SamplingParams(max_tokens=r.max_tokens), float(r.arrival_step))
            for i, r in enumerate(reqs)]
    res = RunResult(seqs)
    if max_steps is None:
        max_steps = 200 + 20 * sum(r.prompt_len + r.max_tokens for r in reqs)
    in_flight: deque[SchedulerOutput] = deque()
    nxt, step = 0, 0
    while nxt < len(reqs) or sched.has_unfinished() or in_flight:
        assert step < max_steps, f"no completion after {max_steps} steps: {sched.running} {sched.waiting}"
        while nxt < len(reqs) and reqs[nxt].arrival_step <= step:
            sched.add_sequence(seqs[nxt])
            nxt += 1
        ready_decodes = [s for s in sched.running if s.is_decode and not sched.is_in_flight(s)]
        in_flight_ids = {c.seq.seq_id for o in in_flight for c in o.chunks}
        out = sched.schedule()
        check_output(out, cfg, sched, in_flight_ids)
        res.outputs.append(out)
        for seq in out.rejected:
            assert seq.status is SequenceStatus.FINISHED and seq.finish_reason == "error" and seq.error
            res.rejected_at[seq.seq_id] = step
        scheduled = {c.seq.seq_id for c in out.chunks}
        for c in out.chunks:
            res.first_scheduled.setdefault(c.seq.seq_id, step)
        if cfg.policy == "sarathi":  # stall-free: every ready decode runs unless preempted
            preempted = {s.seq_id for s in out.preempted}
            stalled = [s.seq_id for s in ready_decodes if s.seq_id not in scheduled | preempted]
            assert not stalled, f"decodes stalled: {stalled}"
        for s in out.preempted:
            assert s.status is SequenceStatus.WAITING and not s.block_table and s.num_computed_tokens == 0
        if not out.is_empty:
            in_flight.append(out)
        # The executor returns the oldest output when the pipeline is full or nothing new could be scheduled.
        if in_flight and (len(in_flight) >= pp_depth or out.is_empty):
            _complete(sched, in_flight.popleft())
        bm.check_invariants(list(sched.running) + list(sched.waiting))
        assert all(not s.block_table for s in sched.waiting)
        step += 1
    res.num_steps = step
    res.num_preemptions = sched.num_preemptions
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == num_blocks
    return res


def _complete(sched, out: SchedulerOutput) -> None:
    """The executor finished `out`: advance, append a dummy token where sampled, finish at max_tokens."""
    sched.on_step_done(out)
    for c in out.chunks:
        seq = c.seq
        if c.needs_sample and seq.status is SequenceStatus.RUNNING:
            seq.append_token(seq.num_tokens % 97)
            if seq.num_output_tokens >= seq.sampling_params.max_tokens:
                sched.finish_sequence(seq, "length")
