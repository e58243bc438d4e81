"""The real disaggregated engine on 8 virtual CPU devices (XLA_FLAGS set in tests/conftest.py).

Greedy tokens equal HF's and the colocated engine's for "1:1", "2:2" and "4:4" with chunked prefills (token
budget 16, prompts up to 45 tokens), every prompt's K/V moved by the KV block mover; no KV block left on
either side; back-pressure with a decode cache of two requests; aborts; prefix-cache hits on the prefill side;
`LLM` on it; the refusals. Engines compile lazily (warmup=False) and one bucket, to keep compile time small.
"""

from __future__ import annotations

import dataclasses
import json
import re
from concurrent.futures import Future

import jax
import numpy as np
import pytest

from sarathi_jax import LLM, EngineConfig, LLMEngine, SamplingParams
from sarathi_jax.core.admission import AdmissionError
from sarathi_jax.disagg.real_engine import DisaggregatedEngine, place_instances
from sarathi_jax.config.disaggregation import DisaggregationSplit
from sarathi_jax.disagg.kv_transfer import KVBlockMover, PendingCopy
from tests.sarathi_jax.engine_helpers import hf_generate, run_staggered

PROMPT_LENGTHS = (3, 17, 30, 9, 45, 1)
MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
FIELDS = dict(token_budget=16, max_num_seqs=4, block_size=16, num_blocks=48, max_model_len=128)


def make_engine(model_dir, split: str | None, **overrides):
    config = EngineConfig(model=str(model_dir), disaggregation=split, **{**FIELDS, **overrides})
    return (DisaggregatedEngine if split else LLMEngine)(config, warmup=False)


def no_blocks_held(engine: DisaggregatedEngine) -> bool:
    return all(i.block_manager.num_used_blocks == 0 for i in engine.instances)


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint):
    return tiny_checkpoint()  # Llama, 8 heads, 4 KV heads, 4 layers


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(7)
    return [rng.integers(3, 256, size=n).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def expected(model_dir, prompts) -> dict[str, list[int]]:
    """HF's greedy tokens, checked equal to the colocated engine's."""
    hf = {f"r{i}": tokens for i, tokens in enumerate(hf_generate(model_dir, prompts, MAX_TOKENS))}
    assert run_staggered(make_engine(model_dir, None), prompts, GREEDY) == hf
    return hf


@pytest.fixture(scope="module")
def engines() -> dict:
    """Engines built by test_tokens_match_hf_and_colocated, by split, reused by later tests."""
    return {}


@pytest.mark.parametrize("split,overlapped", [("1:1", True), ("2:2", True), ("4:4", True), ("1:1", False)],
                         ids=["1:1", "2:2", "4:4", "1:1-synchronous"])
def test_tokens_match_hf_and_colocated(model_dir, prompts, expected, engines, split, overlapped):
    engine = make_engine(model_dir, split, async_scheduling=overlapped)
    if overlapped:
        engines[split] = engine
    assert run_staggered(engine, prompts, GREEDY) == expected
    assert no_blocks_held(engine) and not engine.has_unfinished_requests()
    # Each side on its own devices: prefill on the first P, decode on the next D.
    p, d = (int(n) for n in split.split(":"))
    devices = jax.devices()
    for inst, want in ((engine.prefill[0], devices[:p]), (engine.decode[0], devices[p:p + d])):
        assert {dev for a in inst.engine.runner.kv_caches[0] for dev in a.devices()} == set(want)
    # The prefill instance ran prompts only (chunked: 45 tokens at a budget of 16), the decode instance decodes.
    log = engine.iteration_log
    assert {r.instance for r in log} == {"prefill0", "decode0"}
    assert all(r.num_decode_tokens == 0 for r in log if r.instance == "prefill0")
    assert all(r.num_prefill_tokens == 0 and r.num_decode_tokens > 0 for r in log if r.instance == "decode0")
    assert sum(r.num_prefill_tokens for r in log) == sum(PROMPT_LENGTHS)
    stats = engine.stats()
    assert stats["num_transfers"] == len(prompts) == len(engine.transfer_log)
    # Each move: the padded bucket's blocks, K and V, in the decode cache's layout; timed (dispatch to seen done).
    k_cache = engine.decode[0].engine.runner.kv_caches[0][0]
    per_block = 2 * k_cache.nbytes // k_cache.shape[1]
    bucket = engine.movers[("prefill0", "decode0")].bucket_for
    assert [t.num_bytes for t in engine.transfer_log] == [bucket(t.num_blocks) * per_block
                                                          for t in engine.transfer_log]
    assert sorted(t.num_blocks for t in engine.transfer_log) == sorted(-(-n // 16) for n in PROMPT_LENGTHS)
    assert all(t.seconds > 0 for t in engine.transfer_log)
    # On the decode side's records, but for those seen done after its last iteration (still in `landed`).
    late = engine.decode[0].landed
    assert stats["transfer_bytes"] == sum(r.transfer_bytes for r in log if r.instance == "decode0") + sum(
        t.num_bytes for t in late) > 0
    assert stats["transfer_seconds"] == pytest.approx(sum(r.transfer_seconds for r in log) + sum(
        t.seconds for t in late))
    # Moves compile once per block-count bucket used (prompts of 1-3 blocks: buckets 1, 2 and 4), not per request.
    mover = engine.movers[("prefill0", "decode0")]
    assert mover.num_traces == 2 * 3


def test_moves_never_compile_after_warmup(model_dir, prompts, expected, engines):
    engine = engines.get("1:1") or make_engine(model_dir, "1:1")
    prefill, decode = engine.prefill[0], engine.decode[0]
    mover = engine.movers[("prefill0", "decode0")] = KVBlockMover(prefill.engine.runner, decode.engine.runner)
    mover.warmup()  # writes nothing: every id of its scatters is padding
    assert mover.buckets == (1, 2, 4, 8) and mover.num_traces == 2 * 4  # max_model_len 128: up to 8 blocks
    assert run_staggered(engine, prompts, GREEDY) == expected
    assert mover.num_traces == 2 * 4 and engine.stats()["num_transfers"] >= len(prompts)


def test_instances_of_one_device_each_side(model_dir, prompts, expected):
    """"2/1:2/1": two prefill and two decode instances of one device each, on devices 0-3, four movers."""
    engine = make_engine(model_dir, "2/1:2/1")
    assert run_staggered(engine, prompts, GREEDY) == expected
    names = [i.name for i in engine.instances]
    assert names == ["prefill0", "prefill1", "decode0", "decode1"]
    for inst, device in zip(engine.instances, jax.devices()[:4]):
        assert {d for a in inst.engine.runner.kv_caches[0] for d in a.devices()} == {device}
    assert {r.instance for r in engine.iteration_log} == set(names)  # the work spread over every instance
    assert no_blocks_held(engine)


def test_the_copy_carries_the_kv(model_dir, prompts, expected, engines, monkeypatch):
    """With the device copy skipped, the decode side reads blocks that were never written: other tokens."""
    engine = engines.get("1:1") or make_engine(model_dir, "1:1")
    done: Future[float] = Future()
    done.set_result(0.0)
    stage = engine.decode[0].engine.runner.stages[0]
    stage.kv_cache = jax.tree.map(lambda a: a * 0, stage.kv_cache)  # no K/V left from an earlier run
    monkeypatch.setattr(KVBlockMover, "move", lambda self, source, target: PendingCopy(0, 0.0, done))  # no copy
    got = run_staggered(engine, prompts, GREEDY)
    assert [got[r][0] for r in expected] == [t[0] for t in expected.values()]  # first tokens: the prefill side's
    assert got != expected
    assert no_blocks_held(engine)


def test_backpressure_decode_cache_of_two_requests(model_dir):
    """Each request lands with 3 blocks (a 33-token prompt) and needs no more (33 + 15 tokens); the decode
    instance has 6: room for two. Ten requests all finish with HF's tokens, finished prefills wait (their blocks
    held) and no new prefill starts meanwhile, no instance holds more than it can, and no block is left."""
    rng = np.random.default_rng(6)  # prompts whose HF continuations hold no EOS (HF would stop there)
    prompts = [rng.integers(3, 256, size=33).tolist() for _ in range(10)]
    engine = make_engine(model_dir, "1:1", num_blocks=6, max_model_len=96, max_num_seqs=8)
    params = SamplingParams(temperature=0.0, max_tokens=15, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    decode, prefill = engine.decode[0], engine.prefill[0]
    sched = prefill.core.scheduler
    in_prefill = lambda: {s.seq_id for s in (*sched.running, *sched.waiting)}  # noqa: E731
    finished, held_seen, entered_while_held, steps = {}, 0, 0, 0
    while engine.has_unfinished_requests():
        held, before = engine.stats()["num_held"], in_prefill()
        for out in engine.step():
            assert out.request_id not in finished
            if out.finished:
                finished[out.request_id] = list(out.token_ids)
        if held:
            entered_while_held += len(in_prefill() - before)
        held_seen = max(held_seen, engine.stats()["num_held"])
        assert decode.core.scheduler.num_running <= 2
        steps += 1
        assert steps < 2000
    assert finished == {f"r{i}": t for i, t in enumerate(hf_generate(model_dir, prompts, 15))}
    assert held_seen >= 1 and entered_while_held == 0
    assert engine.stats()["num_preemptions"] == 0 and no_blocks_held(engine)
    # Too long for the caches (prompt + max_tokens > 6 blocks above the watermark): refused at admission.
    with pytest.raises(AdmissionError, match="max_tokens"):
        engine.add_request("long", prompts[0], SamplingParams(max_tokens=80))
    assert not engine.has_unfinished_requests() and no_blocks_held(engine)


@pytest.fixture(scope="module")
def preemption_case(model_dir):
    """Three 40-token prompts of 40 tokens each (80 tokens: 5 blocks) on caches of 8 blocks: two requests land
    at once and, as they grow, the latest is preempted. HF's tokens, checked equal to the colocated engine's
    under the same preemptions."""
    rng = np.random.default_rng(11)
    prompts = [rng.integers(3, 256, size=40).tolist() for _ in range(3)]
    hf = {f"r{i}": t for i, t in enumerate(hf_generate(model_dir, prompts, 40))}
    colocated = make_engine(model_dir, None, **PREEMPTION_FIELDS)
    assert run_staggered(colocated, prompts, PREEMPTION_PARAMS, arrive_every=1) == hf
    assert colocated.stats()["num_preemptions"] >= 1
    return prompts, hf


PREEMPTION_FIELDS = dict(num_blocks=8, max_model_len=96, token_budget=64, watermark=0.0)
PREEMPTION_PARAMS = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.mark.parametrize("split", ["1:1", "2:2"])
def test_decode_preemption_recomputes_through_the_prefill_side(model_dir, preemption_case, split):
    """The decode side holds what a colocated engine would (a 40-token prompt lands with 3 blocks and grows),
    so it takes two requests of three at once and preempts as they grow: the victim goes back to the prefill
    instance, its prompt and outputs so far are re-prefilled there, its next token sampled, its K/V moved
    again; greedy tokens stay HF's and the colocated engine's, and no block is left on either side."""
    prompts, hf = preemption_case
    engine = make_engine(model_dir, split, **PREEMPTION_FIELDS)
    recomputes = []  # prompt + outputs of each victim when it left the decode side
    queue_recompute = engine.recompute
    engine.recompute = lambda state, now: (recomputes.append(state.seq.num_tokens), queue_recompute(state, now))
    assert run_staggered(engine, prompts, PREEMPTION_PARAMS, arrive_every=1) == hf
    s = engine.stats()
    preempted = s["instances"]["decode0"]["num_preemptions"]
    assert preempted >= 1 and preempted == len(recomputes) and s["num_transfers"] == 3 + preempted
    log = engine.iteration_log
    # The prompts and each recompute's prompt and outputs ran on the prefill side, less what its prefix cache
    # held (a recompute finds its prompt's full blocks there: the prompts differ, so no other hits).
    hits = s["instances"]["prefill0"]["prefix_cache_hits"]
    assert 0 < hits <= 32 * preempted
    assert sum(r.num_prefill_tokens + r.num_decode_tokens for r in log if r.instance == "prefill0") == (
        3 * 40 + sum(recomputes) - hits)
    assert all(r.num_prefill_tokens == 0 for r in log if r.instance == "decode0")
    assert no_blocks_held(engine) and not engine.has_unfinished_requests()


@pytest.mark.parametrize("stage", ["queued", "prefill", "decode"])
def test_abort_at_each_stage(model_dir, prompts, expected, engines, stage):
    engine = engines.get("2:2") or make_engine(model_dir, "2:2")
    engine.add_request("victim", prompts[4], GREEDY)  # 45 tokens: three prefill chunks
    engine.add_request("other", prompts[1], GREEDY)
    outputs = {}
    while engine.stage_of("victim") != stage:
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    assert engine.abort("victim") and not engine.abort("victim")
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    last = outputs["victim"][-1]
    assert last.finished and last.finish_reason == "abort"
    assert all(not o.finished for o in outputs["victim"][:-1])  # nothing after the abort
    assert list(outputs["other"][-1].token_ids) == expected["r1"]
    assert no_blocks_held(engine)


def test_prefix_cache_hits_on_the_prefill_side(model_dir):
    rng = np.random.default_rng(5)
    shared = rng.integers(3, 256, size=40).tolist()
    prompts = [shared + rng.integers(3, 256, size=n).tolist() for n in (5, 12)]
    engine = make_engine(model_dir, "1:1", enable_prefix_caching=True)
    got = run_staggered(engine, prompts, GREEDY, arrive_every=40)  # the second arrives after the first is done
    assert got == {f"r{i}": t for i, t in enumerate(hf_generate(model_dir, prompts, MAX_TOKENS))}
    prefill = engine.prefill[0].block_manager
    assert prefill.num_prefix_hits == 32  # two whole blocks of the shared 40 tokens
    assert prefill.num_used_blocks == 0 and engine.decode[0].block_manager.num_used_blocks == 0


def test_llm_generate_runs_on_it(model_dir, prompts, expected):
    llm = LLM(str(model_dir), warmup=False, disaggregation="1:1", **FIELDS)
    assert isinstance(llm.engine, DisaggregatedEngine)
    outs = llm.generate(prompts[:2], GREEDY)
    assert [list(o.token_ids) for o in outs] == [expected["r0"], expected["r1"]]


@pytest.mark.parametrize("split,match", [
    ("4:5", r"needs 9 devices .* only 8"),
    ("3:1", r"tensor parallelism 3 does not divide the model's 8 attention heads"),
])
def test_bad_split_is_refused_at_start(model_dir, split, match):
    with pytest.raises(ValueError, match=match):
        make_engine(model_dir, split)


def test_instances_are_placed_by_process():
    """`place_instances` (the two-process run itself: tests/sarathi_jax/parallel/test_parallel.py's
    test_multihost_disaggregation): one process in order; several, each instance on one process's devices and
    the decode side on later processes than the prefill side; the rest refused, naming the numbers."""
    devices = [_FakeDevice(i, i // 2) for i in range(6)]  # three processes of two devices
    one = [_FakeDevice(i, 0) for i in range(4)]
    assert place_instances(DisaggregationSplit.parse("1:1"), one) == ([one[:1]], [one[1:2]])
    assert place_instances(DisaggregationSplit.parse("1:1"), devices) == ([devices[:1]], [devices[2:3]])
    assert place_instances(DisaggregationSplit.parse("2:2"), devices) == ([devices[:2]], [devices[2:4]])
    assert place_instances(DisaggregationSplit.parse("3/1:1"), devices) == (
        [devices[:1], devices[1:2], devices[2:3]], [devices[4:5]])  # prefill on processes 0, 1: decode on 2
    assert place_instances(DisaggregationSplit.parse("2:2/1"), one) == ([one[:2]], [one[2:3], one[3:4]])
    with pytest.raises(ValueError, match=r"instance of 4 devices would span processes \[0, 1\]"):
        place_instances(DisaggregationSplit.parse("4:2"), devices)
    with pytest.raises(ValueError, match=r"needs 6 devices .* only 2 are left for its decode side"):
        place_instances(DisaggregationSplit.parse("2:4/2"), devices[:4])
    uneven = [_FakeDevice(0, 0), _FakeDevice(1, 1), _FakeDevice(2, 1)]
    with pytest.raises(ValueError, match=r"needs 2 devices on every process .* the smallest process has 1"):
        place_instances(DisaggregationSplit.parse("2:2"), devices[:5])  # process 2 has one device
    with pytest.raises(ValueError, match=r"tensor parallelism 1 and the decode instances' 2 must be equal"):
        place_instances(DisaggregationSplit.parse("1:2"), uneven)


@dataclasses.dataclass(frozen=True)
class _FakeDevice:
    id: int
    process_index: int


def test_text_and_stop_strings_match_the_colocated_engine(hf_checkpoint):
    """A model with a tokenizer: the decode side owns the text (the hand-off detokenizes the first token), so
    `LLM.generate` gives the colocated engine's text, also when a stop string lies in the first token (the
    request ends at the hand-off) or spans the first tokens."""
    model = str(hf_checkpoint("llama"))
    fields = dict(FIELDS, num_blocks=64, max_model_len=256)
    colocated = LLM(model, warmup=False, **fields)
    disaggregated = LLM(model, warmup=False, disaggregation="1:1", **fields)
    prompts = ["The quick brown fox", "Once upon a time, in a land far away"]
    plain = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    first = colocated.generate(prompts, dataclasses.replace(plain, max_tokens=1))
    full = colocated.generate(prompts, plain)
    stops = [first[0].text, full[1].text[len(first[1].text) - 1:len(first[1].text) + 2]]
    assert all(stops), stops
    cases = [plain] + [dataclasses.replace(plain, stop=(stop,)) for stop in stops]
    ends = []
    for params in cases:
        want, got = colocated.generate(prompts, params), disaggregated.generate(prompts, params)
        assert [(o.token_ids, o.text, o.finish_reason) for o in got] == [
            (o.token_ids, o.text, o.finish_reason) for o in want]
        ends.append([o.finish_reason for o in want])
    assert ends[1][0] == "stop" and ends[2][1] == "stop"  # each stop string was hit
    assert all(i.block_manager.num_used_blocks == 0 for i in disaggregated.engine.instances)


@pytest.mark.parametrize("num_blocks", [128, 5], ids=["roomy", "preempting"])
def test_structured_outputs_match_the_colocated_engine(ascii_llama, num_blocks):
    """Structured outputs (regex, choice, grammar, a JSON schema; greedy and seeded sampling): the request's
    grammar state is one matcher that the prefill core advances with the first token and the decode core goes
    on with, so outputs equal the colocated engine's. With 5 blocks (80 tokens) both engines preempt, and the
    disaggregated one recomputes through its prefill side with the grammar state where the decode side left it."""
    fields = dict(token_budget=64, max_num_seqs=8, num_blocks=num_blocks, max_model_len=80, warmup=False)
    colocated, disaggregated = LLM(str(ascii_llama), **fields), LLM(str(ascii_llama), disaggregation="1:1", **fields)
    schema = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
                                               "tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                                        "minItems": 1, "maxItems": 4}},
              "required": ["name", "tags"], "additionalProperties": False}
    greedy = SamplingParams(temperature=0.0, max_tokens=60)
    params = [greedy.replace(structured_outputs={"regex": "[a-z]+( [0-9]{1,3}){2,8}"}),
              greedy.replace(structured_outputs={"choice": ["red", "green", "blue"]}),
              greedy.replace(structured_outputs={"grammar": 'start: "id=" /[0-9]{1,4}/ ";"'}),
              greedy.replace(structured_outputs={"json": schema})]
    params += [SamplingParams(temperature=1.0, seed=s, max_tokens=60, structured_outputs={"json": schema})
               for s in range(4)]
    prompts = ["Hello world", "The quick brown fox"] * 4
    want, got = colocated.generate(prompts, params), disaggregated.generate(prompts, params)
    assert [(o.token_ids, o.text, o.finish_reason, o.error) for o in got] == [
        (o.token_ids, o.text, o.finish_reason, o.error) for o in want]
    # Each output that its grammar ended satisfies it (random weights may run to max_tokens instead).
    valid = [lambda t: re.fullmatch("[a-z]+( [0-9]{1,3}){2,8}", t), lambda t: t in ("red", "green", "blue"),
             lambda t: re.fullmatch("id=[0-9]{1,4};", t)] + [json.loads] * 5
    assert all(ok(o.text) is not None for ok, o in zip(valid, want) if o.finish_reason == "stop")
    assert sum(o.finish_reason == "stop" for o in want) >= 4, [(o.finish_reason, o.text) for o in want]
    engine = disaggregated.engine
    if num_blocks == 5:
        assert colocated.engine.stats()["num_preemptions"] >= 1
        assert engine.stats()["instances"]["decode0"]["num_preemptions"] >= 1
    assert all(i.block_manager.num_used_blocks == 0 for i in engine.instances)
