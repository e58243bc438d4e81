"""Prefill/decode disaggregation in the simulator: the timeline against hand-computed times,
back-pressure, aborts at every stage, and the configuration's errors."""

import pytest

from sarathi_jax.core.admission import AdmissionError
from sarathi_jax.core.arrival_loop import Arrival, drive
from sarathi_jax.config.engine_config import EngineConfig
from sarathi_jax.disagg.sim_engine import DisaggregatedSimEngine
from sarathi_jax.config.disaggregation import KV_LINKS, DisaggregationSplit, InstanceGroup, KVLink, parse_kv_link
from sarathi_jax.request.sampling_params import SamplingParams
from sarathi_jax.scheduler import SchedulerConfig
from sarathi_jax.sim.simulator import CostModel, SimulatedEngine
from sarathi_jax.sim.tp_cost import TensorParallelCost


class StepCost:
    """A hand-checkable cost model: an iteration with prefill tokens takes 0.5 s + 1 ms per prefill token, a
    decode-only one 0.1 s."""

    def padded(self, num_tokens):
        return num_tokens

    def iteration_time(self, output):
        p = output.num_prefill_tokens
        return 0.5 + 0.001 * p if p else 0.1


SLOW_LINK = KVLink("test", bandwidth=1000.0, latency_s=0.05, source="test")  # 1000 bytes/s


def _engine(split="1:1", *, budget=256, blocks=64, link=SLOW_LINK, kv_bytes=10, max_num_seqs=8, cost=None,
            prefix_caching=False):
    cfg = SchedulerConfig(policy="sarathi", token_budget=budget, max_num_seqs=max_num_seqs, max_model_len=512,
                          watermark=0.0)
    return DisaggregatedSimEngine(DisaggregationSplit.parse(split), cfg, blocks, lambda tp: cost or StepCost(),
                                  link=link, kv_bytes_per_token=kv_bytes, block_size=16,
                                  enable_prefix_caching=prefix_caching)


def _run(engine, arrivals):
    return drive(engine, [Arrival(rid, t, engine.dummy_prompt(n), SamplingParams(max_tokens=m, ignore_eos=True))
                          for rid, t, n, m in arrivals], raise_refused=True, max_idle_steps=1000)


def _no_blocks_held(engine):
    return {i.name: i.block_manager.num_used_blocks for i in engine.instances} == {
        i.name: 0 for i in engine.instances}


def test_timeline_matches_hand_computed_times():
    """Two 100-token prompts, prefill 0.6 s each, transfer 0.05 + 100 x 10 B / 1000 B/s = 1.05 s on one link,
    decodes 0.1 s:
      prefill0: A 0.0-0.6 (A's first token 0.6); B (arrived 0.2, waits for A's iteration) 0.6-1.2
      link:     A 0.6-1.65; B ready 1.2, waits for the link, 1.65-2.70
      decode0:  A lands 1.65: 1.65-1.75, 1.75-1.85 (done); B lands 2.70: 2.70-2.80 (done)."""
    eng = _engine()
    loop = _run(eng, [("A", 0.0, 100, 3), ("B", 0.2, 100, 2)])
    a, b = loop.finished["A"].metrics, loop.finished["B"].metrics
    assert a.token_times == pytest.approx([0.6, 1.75, 1.85]) and a.finished_time == pytest.approx(1.85)
    assert a.ttft == pytest.approx(0.6) and a.tbts == pytest.approx([1.15, 0.1])
    assert b.token_times == pytest.approx([1.2, 2.8]) and b.ttft == pytest.approx(1.0)
    assert b.finished_time == pytest.approx(2.8) and b.first_scheduled_time == pytest.approx(0.6)
    assert [len(loop.finished[r].token_ids) for r in "AB"] == [3, 2]
    log = [(r.instance, round(r.start_time, 9), round(r.duration, 9), r.num_prefill_tokens, r.num_decode_tokens)
           for r in eng.iteration_log]
    assert sorted(log, key=lambda r: (r[1], r[0])) == [
        ("prefill0", 0.0, 0.6, 100, 0), ("prefill0", 0.6, 0.6, 100, 0),
        ("decode0", 1.65, 0.1, 0, 1), ("decode0", 1.75, 0.1, 0, 1), ("decode0", 2.7, 0.1, 0, 1)]
    assert [r.iteration for r in eng.iteration_log] == list(range(5))
    s = eng.stats()
    assert s["num_transfers"] == 2 and s["transfer_seconds"] == pytest.approx(2.1)
    assert s["transfer_bytes"] == 2000  # 100 tokens x 10 bytes each
    assert [(t.request_id, t.source, t.target, t.num_blocks, t.num_bytes, t.start, t.seconds)
            for t in eng.transfer_log] == [("A", "prefill0", "decode0", 7, 1000, pytest.approx(0.6), pytest.approx(1.05)),
                                           ("B", "prefill0", "decode0", 7, 1000, pytest.approx(1.65), pytest.approx(1.05))]
    # Each transfer is on the record of the receiving instance's first iteration after it landed.
    moved = [(r.instance, round(r.start_time, 9), r.transfer_bytes, round(r.transfer_seconds, 9))
             for r in eng.iteration_log if r.transfer_bytes]
    assert sorted(moved) == [("decode0", 1.65, 1000, 1.05), ("decode0", 2.7, 1000, 1.05)]
    assert _no_blocks_held(eng) and not eng.has_unfinished_requests()


def test_decode_side_prefix_cache_moves_only_the_rest():
    """With prefix caching, a decode side whose cache holds a prompt's leading blocks is sent only the rest.
    Dummy prompts are a function of the position, so B (arriving after A finished) is A's 40 tokens: A moves
    3 blocks, 40 x 10 B in 0.05 + 0.4 s; B shares the 2 full blocks A left on the decode side (and hits them on
    the prefill side) and moves 1 block, 8 x 10 B in 0.05 + 0.08 s."""
    eng = _engine(prefix_caching=True)
    _run(eng, [("A", 0.0, 40, 3), ("B", 5.0, 40, 3)])
    assert [(t.request_id, t.num_blocks, t.num_bytes, t.seconds) for t in eng.transfer_log] == [
        ("A", 3, 400, pytest.approx(0.45)), ("B", 1, 80, pytest.approx(0.13))]
    s = eng.stats()
    assert s["prefix_cache_hits"] == s["instances"]["prefill0"]["prefix_cache_hits"] == 32  # the prompts'
    assert s["instances"]["decode0"]["prefix_cache_hits"] == 32 and s["transfer_bytes"] == 480
    assert _no_blocks_held(eng) and not eng.has_unfinished_requests()


def test_max_tokens_one_ends_on_the_prefill_side():
    eng = _engine()
    loop = _run(eng, [("A", 0.0, 100, 1)])
    assert loop.finished["A"].metrics.finished_time == pytest.approx(0.6)
    assert eng.stats()["num_transfers"] == 0 and {r.instance for r in eng.iteration_log} == {"prefill0"}


def test_backpressure_decode_holds_two_requests():
    """Each request lands with 3 blocks (a 33-token prompt) and needs no more (33 + 15 tokens); the decode
    instance has 6: room for 2. Ten requests all finish, no instance ever holds more than it can, and no block
    is left on either side."""
    eng = _engine(budget=64, blocks=6, link=KV_LINKS["nvlink"])
    decode, prefill = eng.decode[0], eng.prefill[0]
    for i in range(10):  # a prefill takes 0.53 s, decodes 1.4 s: decode is the bottleneck
        eng.add_request(f"r{i}", 33, SamplingParams(max_tokens=15, ignore_eos=True), arrival_time=0.3 * i)
    finished, held_seen, steps, entered_while_held = {}, 0, 0, 0
    sched = prefill.core.scheduler
    in_prefill = lambda: {s.seq_id for s in (*sched.running, *sched.waiting)}  # noqa: E731
    while eng.has_unfinished_requests():
        held, before = eng.stats()["num_held"], in_prefill()
        outs = eng.step()
        if held:  # new prefills stop while a finished one waits for decode room
            entered_while_held += len(in_prefill() - before)
        for out in outs:
            assert out.request_id not in finished
            if out.finished:
                finished[out.request_id] = out
        steps += 1
        assert steps < 10_000
        s = eng.stats()
        held_seen = max(held_seen, s["num_held"])
        assert decode.core.scheduler.num_running + decode.incoming <= 2
        for inst in (decode, prefill):
            assert inst.block_manager.num_used_blocks <= inst.block_manager.num_total_blocks == 6
    assert sorted(finished) == sorted(f"r{i}" for i in range(10))
    assert all(o.finish_reason == "length" and len(o.token_ids) == 15 for o in finished.values())
    assert held_seen >= 1  # back-pressure happened: finished prefills waited for decode room
    assert entered_while_held == 0
    assert eng.stats()["num_preemptions"] == 0 and _no_blocks_held(eng)


def test_decode_preemption_recomputes_through_the_prefill_side():
    """The decode side holds what a colocated engine would (a request lands with its prompt's 3 blocks and
    grows as it decodes: 40 + 40 tokens end in 5), so 8 blocks take 2 requests at once and a third waits; as
    they grow the decode core preempts its latest arrival, which goes back to the prefill instance, is
    re-prefilled there with its outputs so far (the dummy tokens are a function of the position: a recompute that
    lost them would sample other tokens), moves again and finishes with the colocated engine's tokens."""
    arrivals = [(f"r{i}", 0.0, 40, 40) for i in range(3)]
    eng = _engine(budget=64, blocks=8, link=KV_LINKS["nvlink"])
    recomputes = []  # (prompt + outputs) of each preempted request, when it left the decode side
    queue_recompute = eng.recompute
    eng.recompute = lambda state, now: (recomputes.append(state.seq.num_tokens), queue_recompute(state, now))
    loop = _run(eng, arrivals)
    cfg = SchedulerConfig(policy="sarathi", token_budget=64, max_num_seqs=8, max_model_len=512, watermark=0.0)
    colocated = _run(SimulatedEngine(cfg, 8, 16, StepCost()), arrivals)
    assert {r: o.token_ids for r, o in loop.finished.items()} == {
        r: o.token_ids for r, o in colocated.finished.items()}
    assert all(o.finish_reason == "length" and len(o.token_ids) == 40 for o in loop.finished.values())
    s = eng.stats()
    preempted = s["instances"]["decode0"]["num_preemptions"]
    assert preempted >= 1 and s["instances"]["prefill0"]["num_preemptions"] == 0
    assert s["num_transfers"] == 3 + preempted  # each recompute moves again
    assert len(recomputes) == preempted
    prefill = [r for r in eng.iteration_log if r.instance == "prefill0"]
    # The prefill side ran the prompts and each recompute's prompt and outputs, nothing more (a recompute's last
    # output alone, after a chunk, counts as a decode token, as in a colocated re-prefill).
    assert sum(r.num_prefill_tokens + r.num_decode_tokens for r in prefill) == 3 * 40 + sum(recomputes)
    assert all(r.num_prefill_tokens == 0 for r in eng.iteration_log if r.instance == "decode0")
    assert sum(o.metrics.num_preemptions for o in loop.finished.values()) == preempted
    assert _no_blocks_held(eng) and not eng.has_unfinished_requests()


def _drain_after_abort(eng, victim: str, outputs: dict, steps: int, max_steps: int) -> list:
    """Step `eng` (whose `victim` was just aborted) until nothing is left, collecting outputs; the victim's
    outputs after the abort, checked to be one "abort" with no new tokens."""
    n_before = len(outputs[victim])
    while eng.has_unfinished_requests():
        for out in eng.step():
            outputs[out.request_id].append(out)
        steps += 1
        assert steps < max_steps
    after = outputs[victim][n_before:]
    assert [o.finish_reason for o in after] == ["abort"] and after[0].new_token_ids == ()
    return after


@pytest.mark.parametrize("stage", ["queued", "prefill", "held", "moving"])
def test_abort_of_a_recompute_frees_every_block(stage):
    """A request preempted on the decode side and aborted while its recompute is queued, re-prefilling, held or
    moving: its last output says abort with its tokens so far, nothing follows, no block stays anywhere."""
    eng = _engine(budget=64, blocks=8, link=SLOW_LINK)
    for i in range(3):
        eng.add_request(f"r{i}", 40, SamplingParams(max_tokens=40, ignore_eos=True), arrival_time=0.0)
    outputs, steps = {f"r{i}": [] for i in range(3)}, 0
    victim = None
    while victim is None or eng.stage_of(victim) != stage:
        for out in eng.step():
            outputs[out.request_id].append(out)
        if victim is None:
            victim = next(iter(eng._resuming), None)
        steps += 1
        assert steps < 5000, f"never reached {stage}"
    assert eng.abort(victim)
    after = _drain_after_abort(eng, victim, outputs, steps, 10_000)
    emitted = [t for o in outputs[victim] for t in o.new_token_ids]
    assert list(after[0].token_ids) == emitted and len(emitted) >= 1
    assert all(len(outputs[r][-1].token_ids) == 40 for r in outputs if r != victim)
    assert _no_blocks_held(eng) and all(i.incoming == 0 for i in eng.instances)


@pytest.mark.parametrize("stage", ["queued", "prefill", "held", "moving", "decode"])
def test_abort_at_each_stage_frees_every_block(stage):
    # Budget 32: a 100-token prompt prefills in 4 chunks; the decode side holds one request (7 blocks, each
    # request needs 7: 100 + 8 tokens), so the second waits held; the link takes 1.05 s per transfer.
    eng = _engine(budget=32, blocks=7)
    for rid in ("a", "b"):
        eng.add_request(rid, 100, SamplingParams(max_tokens=8, ignore_eos=True), arrival_time=0.0)
    victim = "b" if stage == "held" else "a"
    outputs = {"a": [], "b": []}
    steps = 0
    while eng.stage_of(victim) != stage:
        for out in eng.step():
            outputs[out.request_id].append(out)
        steps += 1
        assert steps < 1000, f"never reached {stage}"
    if stage == "prefill":
        seq = next(s for s in eng.prefill[0].core.scheduler.running if s.seq_id == victim)
        assert 0 < seq.num_computed_tokens < 100  # mid-prompt
    assert eng.abort(victim) and not eng.abort(victim) and eng.stage_of(victim) is None
    _drain_after_abort(eng, victim, outputs, steps, 2000)
    survivor = "a" if victim == "b" else "b"
    assert outputs[survivor][-1].finish_reason == "length" and len(outputs[survivor][-1].token_ids) == 8
    assert _no_blocks_held(eng) and all(i.incoming == 0 for i in eng.instances)


def test_request_too_long_for_the_decode_instance_is_refused_at_admission():
    # "2:1": a TP-2 prefill instance of 40 blocks (640 tokens), a one-device decode instance of 20 (320 tokens).
    eng = _engine("2:1", blocks=20)
    assert [i.block_manager.num_total_blocks for i in eng.instances] == [40, 20]
    with pytest.raises(AdmissionError, match="400 tokens need 25 KV blocks .* the cache has 20 blocks"):
        eng.add_request("big", 300, SamplingParams(max_tokens=100))  # fits the prefill side, not the decode side
    eng.add_request("ok", 200, SamplingParams(max_tokens=100))
    with pytest.raises(AdmissionError, match="request_id"):
        eng.add_request("ok", 10)


def test_replicas_spread_prompts_and_all_finish():
    eng = _engine("2/1:2/1", cost=CostModel())
    loop = _run(eng, [(f"r{i}", 0.01 * i, 100 + 10 * i, 5) for i in range(12)])
    assert len(loop.finished) == 12
    assert {r.instance for r in eng.iteration_log} == {"prefill0", "prefill1", "decode0", "decode1"}
    assert _no_blocks_held(eng)


def test_split_parse_and_checks():
    s = DisaggregationSplit.parse("2:6/2")
    assert s.prefill == InstanceGroup(2, 2) and s.decode == InstanceGroup(6, 2) and s.decode.num_instances == 3
    assert str(s) == "2:6/2" and s.num_devices == 8
    for bad, words in [("2", "'P:D'"), ("a:1", "prefill side 'a'"), ("1:0", "decode side needs >= 1"),
                       ("3/2:1", "3 is not a multiple of 2")]:
        with pytest.raises(ValueError, match=words):
            DisaggregationSplit.parse(bad)
    with pytest.raises(ValueError, match=r"needs 5 devices \(3 prefill \+ 2 decode\), but only 4"):
        DisaggregationSplit.parse("3:2").check(4, 8, 4)
    with pytest.raises(ValueError, match="prefill side's tensor parallelism 3 does not divide the model's 8 attention"):
        DisaggregationSplit.parse("3:1").check(4, 8, 4)
    with pytest.raises(ValueError, match="decode side's tensor parallelism 6 and the model's 4 KV heads"):
        DisaggregationSplit.parse("2:6").check(8, 12, 4)
    DisaggregationSplit.parse("3/1:1").check(4, 8, 4)  # three one-device prefill instances fit


def test_engine_config_and_the_colocated_engine_refuse_what_they_cannot_run():
    assert EngineConfig(disaggregation="2:2").disaggregation == "2:2"
    with pytest.raises(ValueError, match="disaggregation must be 'P:D'"):
        EngineConfig(disaggregation="22")
    with pytest.raises(ValueError, match="not with tensor_parallel_size"):
        EngineConfig(disaggregation="2:2", tensor_parallel_size=2)
    from sarathi_jax.engine.llm_engine import LLMEngine

    with pytest.raises(ValueError, match="LLMEngine is colocated; build `DisaggregatedEngine`"):
        LLMEngine(EngineConfig(disaggregation="1:1"))


def test_kv_links_and_tensor_parallel_cost():
    assert KV_LINKS["nvlink"].transfer_time(300_000_000) == pytest.approx(1e-3 + 5e-6)
    assert parse_kv_link("pcie") is KV_LINKS["pcie"] and parse_kv_link("10").bandwidth == 10e9
    with pytest.raises(ValueError, match="kv link"):
        parse_kv_link("fast")
    base = StepCost()
    link = KVLink("l", bandwidth=1e6, latency_s=1e-3, source="test")
    tp = TensorParallelCost(base, 2, link, num_layers=3, hidden_size=100, bytes_per_value=4, serial_fraction=0.2)

    class Out:  # 10 prefill tokens in one chunk
        num_prefill_tokens = 10
        chunks = [type("C", (), {"num_new_tokens": 10})()]

    # 0.2 x 0.51 + 0.8 x 0.51 / 2 + 2 x 3 x (2 x 1/2 x 10 x 100 x 4 B / 1e6 B/s + 1 ms)
    assert tp.iteration_time(Out()) == pytest.approx(0.102 + 0.204 + 6 * (0.004 + 0.001))
    one = TensorParallelCost(base, 1, link, num_layers=3, hidden_size=100, bytes_per_value=4)
    assert one.iteration_time(Out()) == pytest.approx(0.51)
