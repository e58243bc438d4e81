"""The deadline scheduling policy (sarathi_jax/scheduler/base.py): earliest TTFT deadline first, priority then
arrival among equal deadlines, requests without a TTFT target last, and relegation of a request that reaches its
deadline without a token; every policy's batches under it through the engine core's invariant checks."""

from __future__ import annotations

import pytest

from sarathi_jax.request.sampling_params import SamplingParams
from sarathi_jax.request.sequence import Sequence
from sarathi_jax.scheduler import SchedulerConfig, make_scheduler
from sarathi_jax.scheduler.block_manager import BlockManager

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def scheduler(policy: str = "sarathi", *, max_num_seqs: int = 1, token_budget: int = 64):
    cfg = SchedulerConfig(policy=policy, token_budget=token_budget, max_num_seqs=max_num_seqs, max_model_len=256,
                          max_num_batched_tokens=256, scheduling_policy="deadline")
    return make_scheduler(cfg, BlockManager(64, 16))


def seq(seq_id: str, arrival: float, ttft: float | None, priority: int = 0, prompt_len: int = 8) -> Sequence:
    return Sequence(seq_id, list(range(1, prompt_len + 1)), PARAMS, arrival, priority=priority, slo_ttft_s=ttft)


def admitted_order(sched, now: float) -> list[str]:
    """Ids in the order the scheduler admits them, one per step (max_num_seqs 1), each finished after its step."""
    order = []
    while sched.has_unfinished():
        out = sched.schedule(now)
        (chunk,) = out.chunks
        order.append(chunk.seq.seq_id)
        sched.on_step_done(out)
        sched.finish_sequence(chunk.seq, "stop")
    return order


def test_earliest_deadline_first_then_priority_then_arrival_and_no_target_last():
    sched = scheduler()
    for s in (seq("none", 0.0, None), seq("late", 0.0, 10.0), seq("soon", 1.0, 2.0),
              seq("tie-arrived-first", 0.0, 5.0), seq("tie-urgent", 2.0, 3.0, priority=-1),
              seq("tie-later", 1.0, 4.0)):
        sched.add_sequence(s)
    # deadlines: late 10, soon 3, tie-arrived-first 5, tie-urgent 5 (priority -1), tie-later 5, none inf
    assert admitted_order(sched, now=0.0) == ["soon", "tie-urgent", "tie-arrived-first", "tie-later", "late", "none"]
    assert sched.stats()["num_relegations"] == 0


def test_a_request_past_its_deadline_without_a_token_is_relegated_behind_those_that_can_still_meet_theirs():
    sched = scheduler()
    sched.add_sequence(seq("missed", 0.0, 1.0))  # deadline 1
    sched.add_sequence(seq("on-time", 0.5, 5.0))  # deadline 5.5
    sched.add_sequence(seq("no-target", 0.0, None))
    # At t=2 "missed" can no longer meet its TTFT: it goes behind every request that still can, "on-time" and
    # "no-target" (which has no TTFT to miss), and is still served (relegation is not a refusal).
    assert admitted_order(sched, now=2.0) == ["on-time", "no-target", "missed"]
    assert sched.stats()["num_relegations"] == 1


def test_without_a_clock_nothing_is_relegated():
    sched = scheduler()
    sched.add_sequence(seq("missed", 0.0, 1.0))
    sched.add_sequence(seq("on-time", 0.5, 5.0))
    assert admitted_order(sched, now=None) == ["missed", "on-time"]


def test_a_preempted_request_with_tokens_keeps_its_key():
    """Relegation is for a request without its first token; one that was preempted after producing tokens has
    its TTFT behind it and keeps its early deadline (it resumes first)."""
    sched = scheduler(max_num_seqs=2)
    a, b = seq("a", 0.0, 1.0), seq("b", 0.5, 5.0)
    sched.add_sequence(a)
    sched.add_sequence(b)
    out = sched.schedule(0.0)
    sched.on_step_done(out)
    a.append_token(7)
    sched._preempt(a)  # as memory pressure would
    sched._preempted = []
    assert sched.schedule(3.0).chunks[0].seq is a  # past its deadline, not relegated: it has a token
    assert sched.stats()["num_relegations"] == 0


@pytest.mark.parametrize("policy", ["sarathi", "vllm", "orca"])
def test_relegation_under_overload_keeps_on_time_requests_on_time(policy):
    """Overload: one request served per 0.25 s step, six with a 0.3 s TTFT arriving 0.1 s apart. Earliest
    deadline first alone serves the late ones first and meets 3 (r0, r1, r2; then r3, r4, r5 each finds the
    one before it made it late); with relegation r2 and r4, past their deadlines when their turn would come,
    move behind r3 and r5, and 4 meet."""
    sched = scheduler(policy)
    for i in range(6):
        sched.add_sequence(seq(f"r{i}", float(i) * 0.1, 0.3))  # deadlines 0.3 .. 0.8
    now, met = 0.0, []
    while sched.has_unfinished():
        out = sched.schedule(now)
        (chunk,) = out.chunks
        met.append(now <= chunk.seq.metrics.arrival_time + chunk.seq.metrics.slo_ttft_s)
        sched.on_step_done(out)
        sched.finish_sequence(chunk.seq, "stop")
        now += 0.25
    # t=0: r0 (deadline .3); t=.25: r1 (.4); t=.5: r2 (.5) relegated, r3 (.6) met; t=.75: r4 (.7) relegated,
    # r5 (.8) met; then r2 and r4, late.
    assert met == [True, True, True, True, False, False]


def share_scheduler(share: float | None):
    cfg = SchedulerConfig(policy="sarathi", token_budget=64, max_num_seqs=4, max_model_len=1024,
                          max_prefill_share=share)
    return make_scheduler(cfg, BlockManager(256, 16))


@pytest.mark.parametrize("share", [None, 0.5, 0.25])
def test_max_prefill_share_caps_one_prompt_while_others_wait(share):
    """A 600-token prompt running and a 20-token one arriving: with no cap the long one takes the whole budget and
    the short one waits; with a share, the long prompt's chunk is at most share x 64 and the short one is
    admitted beside it. Alone, the long prompt takes the whole budget either way."""
    sched = share_scheduler(share)
    long = Sequence("long", list(range(1, 601)), PARAMS, 0.0)
    sched.add_sequence(long)
    out = sched.schedule()
    assert [(c.seq.seq_id, c.num_new_tokens) for c in out.chunks] == [("long", 64)]  # alone: no cap
    sched.on_step_done(out)
    sched.add_sequence(Sequence("short", list(range(1, 21)), PARAMS, 1.0))
    chunks = {c.seq.seq_id: c.num_new_tokens for c in sched.schedule().chunks}
    if share is None:
        assert chunks == {"long": 64}
    else:
        cap = int(share * 64)
        assert chunks == {"long": cap, "short": min(20, cap)}


def test_max_prefill_share_is_checked():
    for bad in (0.0, 1.5, -1, "half", True):
        with pytest.raises(ValueError, match="max_prefill_share"):
            share_scheduler(bad)
