import pytest

from sarathi_jax.core.admission import AdmissionError
from sarathi_jax.request.sampling_params import SamplingParams
from sarathi_jax.scheduler import SCHEDULER_POLICIES, SchedulerConfig
from sarathi_jax.request.sequence import ScheduledChunk, SchedulerOutput
from sarathi_jax.request.sequence import Sequence
from sarathi_jax.sim.simulator import CostModel, SimRequest, SimulatedEngine, poisson_trace, simulate, summarize


def _cfg(policy="sarathi", **kw):
    return SchedulerConfig(**({"policy": policy, "token_budget": 64, "max_num_seqs": 8, "max_model_len": 512} | kw))


def test_cost_model():
    cm = CostModel(overhead_s=1.0, prefill_token_s=0.1, decode_token_s=0.01, attention_s=0.001)
    a, b = Sequence("a", list(range(10)), SamplingParams(), 0.0), Sequence("b", list(range(5)), SamplingParams(), 0.0)
    b.num_computed_tokens = 4
    out = SchedulerOutput((ScheduledChunk(a, 4, 0), ScheduledChunk(b, 1, 4)), num_prefill_tokens=4, num_decode_tokens=1)
    assert cm.iteration_time(out) == pytest.approx(1.0 + 0.4 + 0.01 + 0.001 * (4 * 4 + 1 * 5))
    with pytest.raises(ValueError, match="overhead_s"):
        CostModel(overhead_s=-1)


def test_engine_api_on_virtual_clock():
    eng = SimulatedEngine(_cfg(), num_blocks=64, block_size=16)
    eng.add_request("a", 100, SamplingParams(max_tokens=3), arrival_time=0.0)
    eng.add_request("b", [1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="request_id"):
        eng.add_request("a", 5)
    with pytest.raises(ValueError, match="prompt"):
        eng.add_request("c", 0)
    assert eng.has_unfinished_requests() and eng.max_model_len == 512
    seen: dict[str, list[int]] = {"a": [], "b": []}
    finished = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            seen[out.request_id] += out.new_token_ids
            assert list(out.token_ids) == seen[out.request_id]
            if out.finished:
                finished[out.request_id] = out
    assert {k: len(v) for k, v in seen.items()} == {"a": 3, "b": 2}
    assert all(o.finish_reason == "length" for o in finished.values())
    log = eng.iteration_log
    assert eng.clock.now() == pytest.approx(sum(r.duration for r in log)) and all(r.duration > 0 for r in log)
    assert [r.iteration for r in log] == list(range(len(log)))
    assert sum(r.num_prefill_tokens for r in log) == 103 and sum(sum(r.chunk_sizes) for r in log) == 103
    m = finished["a"].metrics
    assert m.arrival_time <= m.first_scheduled_time < m.first_token_time <= m.finished_time == m.token_times[-1]
    assert len(m.token_times) == 3 and all(t > 0 for t in m.tbts)
    s = eng.stats()
    assert s["num_running"] == s["num_waiting"] == 0 and s["num_free_blocks"] == s["num_total_blocks"] == 64
    assert s["kv_cache_usage"] == 0.0 and s["num_preemptions"] == 0


def test_engine_abort_and_refusal():
    eng = SimulatedEngine(_cfg(), num_blocks=64, block_size=16)
    eng.add_request("a", 200, SamplingParams(max_tokens=50))
    with pytest.raises(AdmissionError) as refused:  # 550 > max_model_len: refused at once, as by LLMEngine
        eng.add_request("big", 500, SamplingParams(max_tokens=50))
    assert refused.value.param == "max_tokens" and "max_model_len (512)" in str(refused.value)
    eng.step()
    assert not eng.abort("big")  # nothing of it reached the engine
    assert eng.stats()["num_free_blocks"] < 64
    assert eng.abort("a") and not eng.abort("a") and not eng.abort("zzz")
    assert eng.stats()["num_free_blocks"] == 64
    outs = eng.step()
    assert [(o.request_id, o.finished, o.finish_reason) for o in outs] == [("a", True, "abort")]
    assert not eng.has_unfinished_requests()


def test_admission_is_the_engines_and_stop_strings_never_match():
    eng = SimulatedEngine(_cfg(), num_blocks=64, vocab_size=100)
    with pytest.raises(AdmissionError) as text:  # no tokenizer: LLMEngine's refusal for a model without one
        eng.add_request("t", "hello")
    assert text.value.param == "prompt" and "need a tokenizer" in str(text.value)
    with pytest.raises(AdmissionError) as empty:
        eng.add_request("e", 0)
    assert str(empty.value) == "prompt: empty"
    with pytest.raises(AdmissionError) as vocab:
        eng.add_request("v", [1, 100])
    assert vocab.value.param == "prompt" and "[0, 100)" in str(vocab.value)
    # Stop strings are accepted, as by the engine the simulator stands for; dummy tokens have no text.
    eng.add_request("s", 10, SamplingParams(max_tokens=5, stop=["x"]))
    final = [o for _ in range(20) for o in eng.step() if o.finished]
    assert [(o.finish_reason, len(o.token_ids), o.text) for o in final] == [("length", 5, "")]
    assert all(t < 100 for t in final[0].token_ids)  # dummy tokens come from its vocabulary


@pytest.mark.parametrize("policy", SCHEDULER_POLICIES)
def test_simulate_every_policy_finishes(policy):
    trace = poisson_trace(30, rate=20.0, prompt_len=(10, 300), output_len=(1, 40), seed=3)
    res = simulate(trace, _cfg(policy), num_blocks=80, block_size=16, max_steps=20_000)
    assert len(res.outputs) == 30
    for r in trace:
        out = res.outputs[r.request_id]
        assert out.finish_reason == "length" and len(out.token_ids) == r.max_tokens
        assert out.metrics.first_scheduled_time >= r.arrival_time
    starts = [res.outputs[r.request_id].metrics.first_scheduled_time for r in trace]
    assert starts == sorted(starts)  # FCFS
    assert res.stats["num_free_blocks"] == 80
    assert summarize(res)["num_finished"] == 30


def test_simulate_idle_time_jumps_to_next_arrival():
    trace = [SimRequest("a", 0.0, 10, 2), SimRequest("b", 100.0, 10, 2)]
    res = simulate(trace, _cfg(), num_blocks=16)
    b = res.outputs["b"].metrics
    assert b.first_scheduled_time == 100.0 and res.makespan == pytest.approx(b.finished_time)
    assert res.outputs["a"].metrics.finished_time < 1.0


def test_direction_checks_against_sarathi():
    """Same Poisson trace (prompts 1000-3000 tokens, outputs 100-300, 4 req/s: busy but stable for sarathi):
    vLLM's prefill-prioritizing batches stall decodes (P99 TBT far above sarathi's), and request-level
    batching (faster_transformer) has lower throughput."""
    trace = poisson_trace(120, rate=4.0, prompt_len=(1000, 3000), output_len=(100, 300), seed=0)
    results = {}
    for policy in ("sarathi", "vllm", "faster_transformer"):
        cfg = SchedulerConfig(policy=policy, token_budget=512, max_num_seqs=64, max_model_len=4096)
        results[policy] = summarize(simulate(trace, cfg, num_blocks=4096, block_size=16))
    sarathi, vllm, ft = results["sarathi"], results["vllm"], results["faster_transformer"]
    assert all(r["num_finished"] == 120 for r in results.values())
    assert vllm["p99_tbt"] > 2 * sarathi["p99_tbt"], results
    assert ft["requests_per_s"] < sarathi["requests_per_s"], results
    assert ft["output_tokens_per_s"] < sarathi["output_tokens_per_s"], results


@pytest.mark.parametrize("policy", SCHEDULER_POLICIES)
def test_simulator_serves_priorities(policy):
    """The simulator runs the engine's scheduler: under "priority" a request added behind ten lower-priority
    ones (one sequence at a time) finishes first; under "fcfs" last; a bad priority is refused, nothing queued."""
    finish_order = {}
    for scheduling in ("fcfs", "priority"):
        eng = SimulatedEngine(_cfg(policy, max_num_seqs=1, scheduling_policy=scheduling), num_blocks=64)
        for i in range(10):
            eng.add_request(f"low{i}", 40, SamplingParams(max_tokens=4), arrival_time=0.0, priority=1)
        eng.add_request("urgent", 40, SamplingParams(max_tokens=4), arrival_time=0.0, priority=-1)
        for bad in (0.5, 2**31, "0"):
            with pytest.raises(AdmissionError) as refused:
                eng.add_request("bad", 40, SamplingParams(max_tokens=4), priority=bad)
            assert refused.value.param == "priority"
        assert eng.stats()["num_waiting"] + eng.stats()["num_running"] == 11
        order = []
        while eng.has_unfinished_requests():
            order += [o.request_id for o in eng.step() if o.finished]
        finish_order[scheduling] = order
    assert finish_order["fcfs"][-1] == "urgent" and finish_order["priority"][0] == "urgent"


def test_simulator_ages_waiting_requests_on_its_virtual_clock():
    """priority_max_wait_s on the virtual clock: a priority-9 request behind a stream of priority-0 ones is
    served once it has waited that long, and never later than its deadline plus one request's service time."""
    def run(max_wait):
        cfg = _cfg(max_num_seqs=1, scheduling_policy="priority", priority_max_wait_s=max_wait)
        cost = CostModel(overhead_s=0.1, prefill_token_s=0.0, decode_token_s=0.0, attention_s=0.0)
        reqs = [SimRequest("low", 0.0, 8, 3, priority=9)]
        reqs += [SimRequest(f"u{i}", 0.05 * i, 8, 3) for i in range(60)]
        return simulate(reqs, cfg, num_blocks=64, cost_model=cost).outputs["low"].metrics
    strict, aged = run(None), run(1.0)
    assert strict.first_scheduled_time > 5.0  # behind all 60 (3 iterations of 0.1 s each)
    assert 1.0 <= aged.first_scheduled_time <= 1.0 + 0.3 + 1e-9


def test_request_slo_targets_are_reported_met_or_missed():
    """Targets set at add_request reach the output's metrics; a prefill joining a decode's iteration makes its
    TBT miss a target a decode-only iteration meets."""
    eng = SimulatedEngine(_cfg(), num_blocks=64, block_size=16,
                          cost_model=CostModel(overhead_s=1.0, prefill_token_s=0.1, decode_token_s=0.0, attention_s=0.0))
    eng.add_request("a", 10, SamplingParams(max_tokens=6, ignore_eos=True), slo_ttft_s=5.0, slo_tbt_s=1.05)
    eng.add_request("plain", 4, SamplingParams(max_tokens=2, ignore_eos=True))
    final, added = {}, False
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.request_id == "a" and len(out.token_ids) >= 3 and not added:
                eng.add_request("c", 30, SamplingParams(max_tokens=2, ignore_eos=True), slo_ttft_s=100.0)
                added = True
            if out.finished:
                final[out.request_id] = out.metrics
    a = final["a"]
    assert (a.slo_ttft_s, a.slo_tbt_s) == (5.0, 1.05)
    assert a.ttft <= 5.0 and a.slo_ttft_met is True
    assert max(a.tbts) > 1.05 and a.slo_tbt_met is False and a.slo_met is False  # c's prefill: 1 + 3 s
    assert final["c"].slo_met is True and final["c"].slo_tbt_met is None
    assert final["plain"].slo_met is None
    with pytest.raises(AdmissionError, match="slo_tbt_s: must be a finite number of seconds > 0"):
        eng.add_request("bad", 4, slo_tbt_s=-1.0)
    assert "bad" not in eng.core and not eng.has_unfinished_requests()
