"""Every policy on random traces: limits, stall-freedom (sarathi), FCFS, completion, block conservation,
refusal at admission and the pipeline-parallel rule (checked on every batch by the harness), driven by the engine core
in each loop mode: synchronous, overlapped (async scheduling) and pipeline parallel."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sarathi_jax.scheduler import SCHEDULER_POLICIES, SchedulerConfig
from sarathi_jax.scheduler.registry import WHOLE_PROMPT_POLICIES
from scheduler_harness import Req, run_trace

MAX_MODEL_LEN = 192

# (pipeline depth, async_scheduling): the engine core's loop modes.
SYNC, OVERLAPPED, PP2, PP3 = (1, False), (1, True), (2, False), (3, True)
LOOP_MODES = {"sync": SYNC, "overlapped": OVERLAPPED, "pp2": PP2, "pp3": PP3}
# The step-by-step expectations below hold in both depth-1 loops: the overlapped one schedules the same batches
# (the scheduler hears of a batch at dispatch); it only learns the sampled tokens one step later.
depth_1_loops = pytest.mark.parametrize("mode", [SYNC, OVERLAPPED], ids=["sync", "overlapped"])


@st.composite
def scenarios(draw, policy: str):
    block_size = draw(st.sampled_from([1, 4, 16]))
    max_num_seqs = draw(st.integers(1, 8))
    token_budget = draw(st.sampled_from([8, 16, 32, 64]))
    token_budget = max(token_budget, max_num_seqs)
    mnbt = None
    if policy in WHOLE_PROMPT_POLICIES:
        mnbt = draw(st.sampled_from([None, MAX_MODEL_LEN, 2 * MAX_MODEL_LEN]))
    tile = draw(st.sampled_from([None, 4, 16])) if policy == "sarathi" else None
    cfg = SchedulerConfig(
        policy=policy, token_budget=token_budget, max_num_seqs=max_num_seqs, max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=mnbt, tile_size=tile, watermark=draw(st.sampled_from([0.0, 0.01, 0.1])),
    )
    # From "barely one request" to "plenty": small caches force preemptions (and some rejections).
    low, tight, high = (-(-n // block_size) for n in (64, 2 * MAX_MODEL_LEN, 4 * MAX_MODEL_LEN))
    num_blocks = draw(st.one_of(st.integers(low, tight), st.integers(low, high)))
    arrivals = draw(st.lists(st.integers(0, 30), min_size=1, max_size=12))
    reqs = [
        Req(a, draw(st.integers(1, 120)), draw(st.integers(1, 60)), draw(st.integers(0, 2)))
        for a in sorted(arrivals)
    ]
    mode = draw(st.sampled_from([SYNC, OVERLAPPED, OVERLAPPED, PP2, PP3]))
    return cfg, num_blocks, block_size, reqs, mode, draw(st.booleans())


def _check_run(cfg, num_blocks, block_size, reqs, mode=SYNC, prefix_caching=False):
    pp_depth, async_scheduling = mode
    res = run_trace(cfg, num_blocks, block_size, reqs, pp_depth=pp_depth, async_scheduling=async_scheduling,
                    prefix_caching=prefix_caching)
    usable = num_blocks - max(int(cfg.watermark * num_blocks), 0)
    for seq, req in zip(res.seqs, reqs):
        total = req.prompt_len + req.max_tokens
        fits = total <= MAX_MODEL_LEN and -(-total // block_size) <= usable
        if fits:
            assert seq.seq_id not in res.refused and seq.finish_reason == "length", seq
            assert seq.num_output_tokens == req.max_tokens
        else:  # refused by admission, naming max_tokens (the prompt alone always fits here), never run
            assert res.refused[seq.seq_id].param == "max_tokens", seq
            assert seq.seq_id not in res.first_scheduled
    # FCFS: first scheduled steps follow arrival order (preemption only re-queues already-started ones).
    started = [res.first_scheduled[s.seq_id] for s in res.seqs if s.seq_id in res.first_scheduled]
    assert started == sorted(started), started
    return res


@pytest.mark.parametrize("policy", SCHEDULER_POLICIES)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_traces(policy, data):
    _check_run(*data.draw(scenarios(policy)))


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["", "prefix"])
@pytest.mark.parametrize("mode", LOOP_MODES.values(), ids=LOOP_MODES.keys())
@pytest.mark.parametrize("policy", SCHEDULER_POLICIES)
def test_memory_pressure_preempts_and_still_finishes(policy, mode, prefix_caching):
    # 8 requests of 60 + 60 tokens, room for ~2.5 of them: decodes outgrow memory. With prefix caching they
    # share their prompts' first 3 blocks (one family), and preemption releases blocks others still hold.
    cfg = SchedulerConfig(policy=policy, token_budget=64, max_num_seqs=8, max_model_len=128, watermark=0.0)
    reqs = [Req(0, 60, 60) for _ in range(8)]
    res = _check_run(cfg, 20, 16, reqs, mode, prefix_caching)
    if policy in ("orca", "faster_transformer"):
        assert res.num_preemptions == 0  # they reserve prompt + max_tokens at admission
    else:
        assert res.num_preemptions > 0
        assert sum(s.metrics.num_preemptions for s in res.seqs) == res.num_preemptions
    assert all(s.num_output_tokens == 60 for s in res.seqs)


def test_overlapped_loop_never_preempts_a_sequence_holding_all_its_outputs():
    # In the overlapped loop a sequence whose pending token is its last output only waits for the host to
    # finish it. Evicting it for a decode that needs a block would re-queue it, to be re-admitted and
    # re-prefilled for nothing (the harness asserts on every preemption). This trace leads there.
    cfg = SchedulerConfig(policy="sarathi", token_budget=16, max_num_seqs=8, max_model_len=80, watermark=0.0,
                          tile_size=4)
    reqs = [Req(1, 17, 18), Req(1, 5, 29), Req(2, 19, 5), Req(4, 31, 12), Req(6, 3, 9), Req(8, 32, 13),
            Req(9, 14, 17), Req(9, 10, 10)]
    res = run_trace(cfg, 48, 2, reqs, async_scheduling=True)
    assert res.num_preemptions > 0  # memory is tight enough that preemption still happens
    assert all(s.num_output_tokens == r.max_tokens for s, r in zip(res.seqs, reqs))


@pytest.mark.parametrize("mode", LOOP_MODES.values(), ids=LOOP_MODES.keys())
@pytest.mark.parametrize("policy", SCHEDULER_POLICIES)
def test_batches_in_flight_per_loop_mode(policy, mode):
    cfg = SchedulerConfig(policy=policy, token_budget=32, max_num_seqs=4, max_model_len=128)
    reqs = [Req(i, 20 + 7 * i, 10) for i in range(6)]
    res = _check_run(cfg, 64, 4, reqs, mode)
    # The harness asserts the pipeline rule (depth > 1: no sequence in two batches in flight) on every batch;
    # check that each mode really had batches in flight when it scheduled.
    pp_depth, async_scheduling = mode
    if pp_depth > 1:
        assert res.max_in_flight == pp_depth - 1 and res.num_overlapped_chunks == 0
    elif async_scheduling:  # sequences run again while their previous batch is in flight: the point
        assert res.max_in_flight == 1 and res.num_overlapped_chunks > 0
    else:
        assert res.max_in_flight == 0


@depth_1_loops
def test_sarathi_chunks_long_prompt_and_piggybacks_decodes(mode):
    cfg = SchedulerConfig(policy="sarathi", token_budget=32, max_num_seqs=4, max_model_len=256)
    res = _check_run(cfg, 100, 4, [Req(0, 10, 30), Req(2, 150, 5)], mode)
    hybrid = [o for o in res.outputs if o.num_prefill_tokens and o.num_decode_tokens]
    assert hybrid, "the long prompt's chunks should share batches with the first request's decodes"
    assert max(o.num_batched_tokens for o in res.outputs) == 32
    long_chunks = [c.num_new_tokens for o in res.outputs for c in o.chunks if c.seq.seq_id == "s1" and not c.is_decode]
    assert sum(long_chunks) == 150 and len(long_chunks) > 1


@depth_1_loops
def test_sarathi_tile_alignment(mode):
    cfg = SchedulerConfig(policy="sarathi", token_budget=64, max_num_seqs=8, max_model_len=256, tile_size=16)
    reqs = [Req(i, 37 + 11 * i, 9) for i in range(6)]
    res = _check_run(cfg, 200, 4, reqs, mode)
    for out in res.outputs:
        excess = out.num_batched_tokens % 16
        prefills = [c for c in out.chunks if not c.is_decode]
        if excess and prefills:
            assert prefills[-1].num_new_tokens <= excess  # shrinking it would have made it 0
    assert any(o.num_batched_tokens == 64 for o in res.outputs)


@depth_1_loops
def test_vllm_batches_are_prefill_only_or_decode_only_and_prefill_first(mode):
    cfg = SchedulerConfig(policy="vllm", token_budget=64, max_num_seqs=4, max_model_len=256)
    res = _check_run(cfg, 100, 4, [Req(0, 20, 10), Req(3, 50, 5)], mode)
    # Step 3: s1 arrives while s0 decodes; vLLM runs s1's whole prompt alone, stalling s0.
    out = res.outputs[3]
    assert [(c.seq.seq_id, c.num_new_tokens) for c in out.chunks] == [("s1", 50)]


@depth_1_loops
def test_orca_hybrid_whole_prompts_with_decodes(mode):
    cfg = SchedulerConfig(policy="orca", token_budget=64, max_num_seqs=4, max_model_len=256)
    res = _check_run(cfg, 100, 4, [Req(0, 20, 10), Req(3, 50, 5)], mode)
    out = res.outputs[3]
    assert {(c.seq.seq_id, c.num_new_tokens, c.is_decode) for c in out.chunks} == {("s0", 1, True), ("s1", 50, False)}
    # Reservation at admission: s0 holds blocks for prompt + max_tokens from its first step.
    assert len(res.outputs[0].chunks[0].seq.block_table) == 0  # freed at the end
    assert res.num_preemptions == 0


@depth_1_loops
def test_faster_transformer_waits_for_the_whole_batch(mode):
    cfg = SchedulerConfig(policy="faster_transformer", token_budget=64, max_num_seqs=4, max_model_len=256)
    res = _check_run(cfg, 100, 4, [Req(0, 20, 10), Req(0, 10, 3), Req(2, 30, 2)], mode)
    # s2 arrives at step 2 but is admitted only after s0 (10 tokens) and s1 finished.
    assert res.first_scheduled["s2"] > res.first_scheduled["s0"] + 9


@depth_1_loops
def test_simple_chunking_alternates(mode):
    cfg = SchedulerConfig(policy="simple_chunking", token_budget=16, max_num_seqs=4, max_model_len=256)
    res = _check_run(cfg, 100, 4, [Req(0, 8, 20), Req(1, 100, 3)], mode)
    kinds = ["P" if o.num_prefill_tokens else "D" for o in res.outputs if not o.is_empty]
    assert "PDPD" in "".join(kinds)


@depth_1_loops
def test_chunked_prefills_only_prioritizes_prefill_chunks(mode):
    cfg = SchedulerConfig(policy="chunked_prefills_only", token_budget=16, max_num_seqs=4, max_model_len=256)
    res = _check_run(cfg, 100, 4, [Req(0, 8, 20), Req(2, 100, 3)], mode)
    kinds = "".join("P" if o.num_prefill_tokens else "D" for o in res.outputs if not o.is_empty)
    assert "P" * 7 in kinds  # s1's 100-token prompt: 7 consecutive chunk batches, s0's decodes wait


@depth_1_loops
def test_hybrid_batching_only_runs_an_over_budget_prompt_alone(mode):
    cfg = SchedulerConfig(policy="hybrid_batching_only", token_budget=32, max_num_seqs=4, max_model_len=256)
    res = _check_run(cfg, 100, 4, [Req(0, 8, 20), Req(2, 20, 3), Req(4, 100, 3)], mode)
    alone = [o for o in res.outputs if o.num_batched_tokens > 32]
    assert len(alone) == 1 and [(c.seq.seq_id, c.num_new_tokens) for c in alone[0].chunks] == [("s2", 100)]
    hybrid = res.outputs[2]  # s1's whole prompt rides along with s0's decode
    assert {(c.seq.seq_id, c.num_new_tokens) for c in hybrid.chunks} == {("s0", 1), ("s1", 20)}
