"""The priority scheduling policy (the request order of sarathi_jax/scheduler/base.py) on the plain-Python schedulers: admission
in (priority, arrival) order, the aging bound, preemption victims in the stated order, running decodes never
displaced by prefills (sarathi), and FCFS unchanged. Random traces under hypothesis; the clock is the step."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sarathi_jax.core.admission import Admission, AdmissionError, KVCapacity
from sarathi_jax.scheduler.block_manager import BlockManager
from sarathi_jax.request.sampling_params import SamplingParams
from sarathi_jax.scheduler import SCHEDULER_POLICIES, SchedulerConfig
from sarathi_jax.scheduler.registry import SCHEDULERS, WHOLE_PROMPT_POLICIES
from sarathi_jax.request.sequence import PRIORITY_MIN, Sequence, SequenceStatus
from scheduler_harness import Req, complete, run_trace

MAX_MODEL_LEN = 128


@dataclass(frozen=True)
class PReq:
    arrival_step: int
    prompt_len: int
    max_tokens: int
    priority: int


def _recording(cls: type) -> type:
    """`cls` noting every preemption made while a running prefill grows (`prefill_victims`: was it a decode)."""

    class Recording(cls):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.growing_prefill = False
            self.prefill_victims: list[bool] = []

        def _grow_prefill(self, *args, **kwargs) -> int:
            self.growing_prefill = True
            try:
                return super()._grow_prefill(*args, **kwargs)
            finally:
                self.growing_prefill = False

        def _preempt(self, seq: Sequence) -> None:
            if self.growing_prefill:
                self.prefill_victims.append(seq.is_decode)
            super()._preempt(seq)

    return Recording


def drive(cfg: SchedulerConfig, num_blocks: int, block_size: int, reqs: list[PReq]) -> dict:
    """Run `reqs` on the synchronous loop (clock = step number) and check every `schedule()` call:
    - admission: every request admitted in the call has a smaller order key than every request left waiting;
      without aging, that is (priority, arrival) itself;
    - aging: no request is admitted while an earlier arrival that has waited priority_max_wait_s still waits;
    - preemption: a victim's order key is larger than that of every running sequence not in the batch that
      could have been evicted instead (the lowest priority, latest arrival first);
    - sarathi: every ready decode runs or is preempted, and a prefill never evicts a decode."""
    bm = BlockManager(num_blocks, block_size)
    sched = _recording(SCHEDULERS[cfg.policy])(cfg, bm)
    admission = Admission(vocab_size=1 << 20, max_model_len=cfg.max_model_len, kv_cache=KVCapacity.of(bm))
    seqs = [Sequence(f"s{i}", list(range(1, r.prompt_len + 1)), SamplingParams(max_tokens=r.max_tokens),
                     float(r.arrival_step), r.priority) for i, r in enumerate(reqs)]
    rank = {s.seq_id: i for i, s in enumerate(seqs)}  # added in this order
    wait = cfg.priority_max_wait_s
    admitted_order: list[str] = []
    preempted_ids: list[str] = []
    nxt = step = 0
    while nxt < len(seqs) or sched.has_unfinished():
        assert step < 20_000
        while nxt < len(seqs) and reqs[nxt].arrival_step <= step:
            try:
                admission.check(seqs[nxt].prompt_token_ids, seqs[nxt].sampling_params, reqs[nxt].priority)
                sched.add_sequence(seqs[nxt])
            except AdmissionError:
                pass
            nxt += 1
        waiting_before = {s.seq_id for s in sched.waiting}
        ready_decodes = [s for s in sched.running if s.is_decode and s.num_tokens < s.max_total_tokens]
        out = sched.schedule(now=float(step))
        keys = sched._keys
        batch = {c.seq.seq_id for c in out.chunks}
        preempted = {s.seq_id for s in out.preempted}
        admitted = [s for s in sched.running if s.seq_id in waiting_before | preempted]
        admitted_order += [s.seq_id for s in admitted if s.seq_id in waiting_before]
        preempted_ids += [s.seq_id for s in out.preempted]
        for x in admitted:
            for w in sched.waiting:
                assert keys[w.seq_id] > keys[x.seq_id], (x, w)
                if wait is None and cfg.scheduling_policy == "priority":
                    assert (w.priority, rank[w.seq_id]) > (x.priority, rank[x.seq_id])
                if wait is not None and cfg.scheduling_policy == "priority":
                    aged = w.metrics.arrival_time + wait <= step
                    assert not (aged and rank[w.seq_id] < rank[x.seq_id]), (x, w, step)
        for p in out.preempted:
            for r in sched.running:
                could_evict = r.seq_id not in batch and r.num_tokens < r.max_total_tokens
                assert not (could_evict and keys[r.seq_id] > keys[p.seq_id]), (p, r)
        if cfg.policy == "sarathi":
            assert all(s.seq_id in batch | preempted for s in ready_decodes)
            assert not any(sched.prefill_victims)
        complete(sched, out)
        step += 1
    assert bm.num_free_blocks == num_blocks
    return {"admitted_order": admitted_order, "preempted": preempted_ids}


@st.composite
def priority_scenarios(draw, policy: str, aging: bool):
    block_size = draw(st.sampled_from([4, 16]))
    max_num_seqs = draw(st.integers(1, 6))
    token_budget = max(draw(st.sampled_from([16, 32, 64])), max_num_seqs)
    cfg = SchedulerConfig(
        policy=policy, token_budget=token_budget, max_num_seqs=max_num_seqs, max_model_len=MAX_MODEL_LEN,
        watermark=0.0, scheduling_policy="priority",
        priority_max_wait_s=float(draw(st.integers(1, 40))) if aging else None,
    )
    num_blocks = draw(st.integers(-(-MAX_MODEL_LEN // block_size), -(-4 * MAX_MODEL_LEN // block_size)))
    arrivals = sorted(draw(st.lists(st.integers(0, 20), min_size=1, max_size=12)))
    reqs = [PReq(a, draw(st.integers(1, 80)), draw(st.integers(1, 40)),
                 draw(st.sampled_from([PRIORITY_MIN, -1, 0, 0, 1, 5]))) for a in arrivals]
    return cfg, num_blocks, block_size, reqs


@pytest.mark.parametrize("aging", [False, True], ids=["strict", "aging"])
@pytest.mark.parametrize("policy", SCHEDULER_POLICIES)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_priority_properties_on_random_traces(policy, aging, data):
    drive(*data.draw(priority_scenarios(policy, aging)))


def test_high_priority_request_is_admitted_first_and_preempts_the_lowest():
    # One sequence slot: the queue holds three requests; the urgent one (priority -1) goes first, then the
    # two priority-0 ones by arrival, then the priority-5 one, though it arrived first.
    cfg = SchedulerConfig(policy="sarathi", token_budget=16, max_num_seqs=1, max_model_len=64,
                          scheduling_policy="priority", priority_max_wait_s=None)
    res = drive(cfg, 64, 4, [PReq(0, 8, 2, 5), PReq(0, 8, 2, 0), PReq(0, 8, 2, -1), PReq(0, 8, 2, 0)])
    assert res["admitted_order"] == ["s2", "s1", "s3", "s0"]
    # Two decodes that cannot both grow: the lower-priority one (s1, though it arrived first) is evicted.
    cfg = SchedulerConfig(policy="sarathi", token_budget=32, max_num_seqs=2, max_model_len=64, watermark=0.0,
                          scheduling_policy="priority", priority_max_wait_s=None)
    res = drive(cfg, 4, 4, [PReq(0, 7, 6, 3), PReq(0, 7, 6, 1)])
    assert res["admitted_order"][:2] == ["s1", "s0"]
    assert res["preempted"] and set(res["preempted"]) == {"s0"}


def test_aging_bounds_the_wait_of_a_low_priority_request():
    # A stream of urgent requests keeps one slot busy; without aging the priority-9 request waits for all of
    # them, with a 5 s bound it is admitted as soon as the running one finishes after it has waited 5 s.
    urgent = [PReq(t, 4, 3, 0) for t in range(0, 40, 2)]
    reqs = sorted([PReq(0, 4, 3, 9), *urgent], key=lambda r: r.arrival_step)
    order = {}
    for wait in (None, 5.0):
        cfg = SchedulerConfig(policy="sarathi", token_budget=16, max_num_seqs=1, max_model_len=64,
                              scheduling_policy="priority", priority_max_wait_s=wait)
        order[wait] = drive(cfg, 64, 4, reqs)["admitted_order"]
    low = "s0"
    assert order[None][-1] == low
    assert order[5.0].index(low) <= 3  # a request takes 3 steps: at most 5 s + one request's time


def test_fcfs_ignores_priorities():
    cfg = SchedulerConfig(policy="sarathi", token_budget=16, max_num_seqs=1, max_model_len=64)
    res = drive(cfg, 64, 4, [PReq(0, 8, 2, 5), PReq(0, 8, 2, 0), PReq(0, 8, 2, -1)])
    assert res["admitted_order"] == ["s0", "s1", "s2"]


def test_request_order_keys_and_aging():
    cfg = SchedulerConfig(policy="sarathi", token_budget=16, max_num_seqs=1, max_model_len=64,
                          scheduling_policy="priority", priority_max_wait_s=10.0)
    sched = SCHEDULERS["sarathi"](cfg, BlockManager(64, 4))
    seqs = [Sequence(f"s{i}", [1], SamplingParams(max_tokens=1), arrival, prio)
            for i, (arrival, prio) in enumerate([(0.0, 3), (1.0, 0), (2.0, 3)])]
    for s in seqs:
        sched.add_sequence(s)
    assert [s.seq_id for s in sched.waiting] == ["s1", "s0", "s2"]
    assert not sched._age(9.9)
    assert sched._age(10.0)  # s0 waited 10 s: the most urgent from now on
    assert sched._keys["s0"] == (PRIORITY_MIN, 0)
    sched.abort_sequence("s2")
    out = sched.schedule(now=100.0)  # ages s1 too; the queue is re-sorted: s0 (rank 0) first
    assert [c.seq.seq_id for c in out.chunks] == ["s0"]
    assert sched._keys == {"s0": (PRIORITY_MIN, 0), "s1": (PRIORITY_MIN, 1)}


@pytest.mark.parametrize("bad", ["lifo", ""])
def test_unknown_scheduling_policy_is_refused(bad):
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        SchedulerConfig(scheduling_policy=bad)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), True, "5"])
def test_bad_max_wait_is_refused(bad):
    with pytest.raises(ValueError, match="priority_max_wait_s"):
        SchedulerConfig(scheduling_policy="priority", priority_max_wait_s=bad)


@pytest.mark.parametrize("policy", SCHEDULER_POLICIES)
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_priority_runs_keep_every_invariant_of_the_engine_core(policy, data):
    """The harness's checks (limits, stall-freedom, KV contents, completion, tokens) on the engine core in
    every loop mode, with random priorities."""
    mnbt = 2 * MAX_MODEL_LEN if policy in WHOLE_PROMPT_POLICIES else None
    cfg = SchedulerConfig(policy=policy, token_budget=32, max_num_seqs=4, max_model_len=MAX_MODEL_LEN,
                          max_num_batched_tokens=mnbt, scheduling_policy="priority",
                          priority_max_wait_s=data.draw(st.sampled_from([None, 0.001])))
    arrivals = sorted(data.draw(st.lists(st.integers(0, 20), min_size=1, max_size=10)))
    reqs = [Req(a, data.draw(st.integers(1, 80)), data.draw(st.integers(1, 30)), 0,
                data.draw(st.integers(-2, 2))) for a in arrivals]
    pp_depth, async_scheduling = data.draw(st.sampled_from([(1, False), (1, True), (2, False)]))
    res = run_trace(cfg, data.draw(st.integers(12, 40)), 16, reqs, pp_depth=pp_depth,
                    async_scheduling=async_scheduling)
    assert all(s.status is SequenceStatus.FINISHED or s.seq_id in res.refused for s in res.seqs)
