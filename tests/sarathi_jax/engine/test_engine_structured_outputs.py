"""Structured outputs through the engine (admission, the constrained sampler variants, the grammar state in
`EngineCore._postprocess`): outputs that satisfy their constraint, exact tokens where the constraint allows the
unconstrained ones, no interference with unconstrained rows, the finish reasons, aborts and bad input.

The tiny random model is tests/conftest.py's `ascii_llama`, with an ASCII byte-level BPE (llguidance cannot
read the Metaspace tiny tokenizer, and random weights over all 256 bytes would emit text that is not UTF-8);
SmolLM2-135M-Instruct (the converted GGUF of the session fixtures) checks JSON schemas with `jsonschema`.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import jsonschema
import pytest

from sarathi_jax import LLM, EngineConfig, LLMEngine, SamplingParams
from sarathi_jax.core.admission import Admission, AdmissionError
from sarathi_jax.request.tokenizer import load_tokenizer

PROMPTS = ["The quick brown fox", "Hello world", "red green blue"]


@pytest.fixture(scope="module")
def llm(ascii_llama: Path) -> LLM:
    return LLM(str(ascii_llama), token_budget=64, max_num_seqs=8, num_blocks=128, max_model_len=256, warmup=False)


GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


def test_greedy_under_a_constraint_the_output_satisfies_gives_identical_tokens(llm: LLM) -> None:
    refs = llm.generate(PROMPTS, GREEDY)
    assert all(ref.text for ref in refs)
    for ref, prompt in zip(refs, PROMPTS):
        for constraint in ({"choice": [ref.text, "zzz"]}, {"regex": re.escape(ref.text) + "|[0-9]+"}):
            [out] = llm.generate(prompt, GREEDY.replace(structured_outputs=constraint))
            assert out.token_ids == ref.token_ids, (constraint, out.text, ref.text)
            assert out.text == ref.text
            assert out.finish_reason == "stop"  # the grammar is complete with the text (or took EOS there)


def test_unconstrained_rows_beside_constrained_ones_are_unchanged(llm: LLM) -> None:
    plain = [GREEDY, SamplingParams(temperature=0.9, top_p=0.8, seed=7, max_tokens=16),
             SamplingParams(temperature=1.0, top_k=5, seed=3, max_tokens=16, logprobs=2)]
    alone = llm.generate(PROMPTS, plain)
    constrained = [GREEDY.replace(structured_outputs={"regex": "[a-z]+ [0-9]{3}"}),
                   SamplingParams(temperature=1.0, seed=5, max_tokens=16,
                                  structured_outputs={"choice": ["red", "green", "blue"]})]
    mixed = llm.generate(PROMPTS + PROMPTS[:2], plain + constrained)
    for a, m in zip(alone, mixed[:3]):
        assert m.token_ids == a.token_ids and m.text == a.text
        assert [lp.top_token_ids for lp in m.new_logprobs] == [lp.top_token_ids for lp in a.new_logprobs]
    assert re.fullmatch("[a-z]+ [0-9]{3}", mixed[3].text) and mixed[3].finish_reason == "stop"
    assert mixed[4].text in ("red", "green", "blue") and mixed[4].finish_reason == "stop"


@pytest.mark.parametrize("seed", range(4))
def test_random_weights_still_give_valid_outputs(llm: LLM, seed: int) -> None:
    params = SamplingParams(temperature=1.0, seed=seed, max_tokens=40)
    cases = [("regex", r"[a-z]{2,6}( [0-9]{1,3}){2}", lambda t: re.fullmatch(r"[a-z]{2,6}( [0-9]{1,3}){2}", t)),
             ("choice", ["The quick brown fox", "lazy dog", "Ada"], lambda t: t in ("The quick brown fox", "lazy dog", "Ada")),
             ("grammar", 'start: "id=" /[0-9]{1,4}/ ";"', lambda t: re.fullmatch(r"id=[0-9]{1,4};", t))]
    outs = llm.generate(["Hello world"] * len(cases), [params.replace(structured_outputs={k: v}) for k, v, _ in cases])
    for (kind, _, valid), out in zip(cases, outs):
        assert out.finish_reason == "stop" and out.error is None, (kind, out)
        assert valid(out.text), (kind, out.text)


# Every kind of JSON schema constraint structured outputs take, in the ASCII tokenizer's alphabet; strings and the
# number's digits bounded, so random weights end well within max_tokens.
RANDOM_WEIGHTS_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99},
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,5}$"},
        "status": {"enum": ["on", "off", "unknown"]},
        "score": {"type": "number", "minimum": -1, "maximum": 1, "multipleOf": 0.25},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "minItems": 1, "maxItems": 2},
        "address": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{3}$"},
                                                     "apt": {"type": "integer", "minimum": 1, "maximum": 9}},
                    "required": ["zip"], "additionalProperties": False},
        "flag": {"type": "boolean"},
    },
    "required": ["id", "name", "status", "tags", "address"],
    "additionalProperties": False,
}


def test_random_weights_give_json_that_validates(llm: LLM) -> None:
    """Nested objects, arrays with min/max items, enums, bounded numbers, required and optional keys and
    patterned strings, sampled from random weights: every output parses and validates (`jsonschema`)."""
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=150,
                             structured_outputs={"json": RANDOM_WEIGHTS_SCHEMA}) for seed in range(6)]
    outs = llm.generate(["Hello world"] * len(params), params)
    for out in outs:
        assert out.finish_reason == "stop" and out.error is None, out
        jsonschema.validate(json.loads(out.text), RANDOM_WEIGHTS_SCHEMA)
    assert any(set(json.loads(o.text)) - set(RANDOM_WEIGHTS_SCHEMA["required"]) for o in outs)  # optional keys too


def test_a_dead_end_finishes_with_a_clear_error(llm: LLM) -> None:
    """ascii_llama's tokenizer cannot write "é": after "a" no token can continue "aé", so the request finishes
    with an error of one line (and its KV blocks come back); a constraint whose output cannot even start is
    refused at admission."""
    before = llm.engine.stats()["num_free_blocks"]
    [out] = llm.generate("Hello", SamplingParams(temperature=1.0, seed=0, max_tokens=8,
                                                 structured_outputs={"regex": "aé"}))
    assert out.finish_reason == "error" and out.text.startswith("a"), out
    assert out.error == ("structured_outputs: a dead end: no token of this tokenizer can continue the output "
                         "(llguidance: NoExtensionBias)")
    assert llm.engine.stats()["num_free_blocks"] == before
    with pytest.raises(AdmissionError, match="cannot be generated with this model's tokenizer: a dead end") as info:
        llm.engine.admission.admit("Hello", SamplingParams(structured_outputs={"regex": "é+"}))
    assert info.value.param == "structured_outputs"


def test_logprobs_under_a_constraint_are_over_the_allowed_tokens(llm: LLM) -> None:
    """The bitmask is applied before the logprobs: a choice of "x" or "y" allows two first tokens, whose
    probabilities add up to 1; the other top entries are -inf (never candidates)."""
    x, y = (llm.engine.admission.prompt_ids(c) for c in "xy")
    [out] = llm.generate("Hello", SamplingParams(temperature=1.0, seed=1, max_tokens=4, logprobs=5,
                                                 structured_outputs={"choice": ["x", "y"]}))
    first = out.new_logprobs[0]
    allowed = {t: v for t, v in zip(first.top_token_ids, first.top_logprobs) if v > -math.inf}
    assert set(allowed) == {x[0], y[0]} and len(x) == len(y) == 1
    assert sum(math.exp(v) for v in allowed.values()) == pytest.approx(1.0, abs=1e-5)
    assert list(first.top_logprobs[2:]) == [-math.inf] * 3
    assert first.token_id in allowed and first.logprob == pytest.approx(allowed[first.token_id])


def test_no_compilation_per_constraint_after_warmup(ascii_llama: Path) -> None:
    """Warm-up builds the constrained sampler variants; four kinds of constraint, greedy and sampled, with and
    without logprobs, alone and in a full batch beside unconstrained rows, then compile nothing."""
    llm = LLM(str(ascii_llama), token_budget=64, max_num_seqs=8, num_blocks=128, max_model_len=256)
    assert llm.engine.wait_until_compiled(timeout=600)
    compiled = llm.engine.runner.num_compilations
    constraints = [{"regex": "[a-z]{2,5}"}, {"choice": ["red", "blue"]}, {"json": RANDOM_WEIGHTS_SCHEMA},
                   {"grammar": 'start: "id=" /[0-9]{1,3}/'}]
    params = [SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=c) for c in constraints]
    params += [SamplingParams(temperature=1.0, seed=i, max_tokens=40, logprobs=2, structured_outputs=c)
               for i, c in enumerate(constraints)]
    llm.generate("Hello", params[2])
    outs = llm.generate(["Hello world"] * 9, params + [SamplingParams(temperature=0.7, seed=9, max_tokens=20)])
    assert all(out.finish_reason in ("stop", "length") and out.error is None for out in outs)
    assert llm.engine.runner.num_compilations == compiled


def test_max_tokens_mid_structure_finishes_with_length(llm: LLM) -> None:
    [out] = llm.generate("Hello", GREEDY.replace(max_tokens=4, structured_outputs={"regex": "[a-z]{30}"}))
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    assert re.fullmatch("[a-z]+", out.text) and len(out.text) < 30


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_an_abort_mid_structure_leaves_no_kv_block(ascii_llama: Path, async_scheduling: bool) -> None:
    config = EngineConfig(model=str(ascii_llama), token_budget=64, max_num_seqs=8, num_blocks=64,
                          max_model_len=256, async_scheduling=async_scheduling)
    engine = LLMEngine(config, warmup=False)
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=100, structured_outputs={"regex": "[a-z ]{90,}"})
    engine.add_request("a", "Hello world", params)
    engine.add_request("b", "Hello world", params)
    seen = []
    for _ in range(6):
        seen += engine.step()
    assert engine.abort("a")
    while engine.has_unfinished_requests():
        seen += engine.step()
    finals = {o.request_id: o for o in seen if o.finished}
    assert finals["a"].finish_reason == "abort" and re.fullmatch("[a-z ]*", finals["a"].text)
    assert finals["b"].finish_reason in ("stop", "length") and re.fullmatch("[a-z ]{90,}", finals["b"].text)
    stats = engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"] and stats["num_running"] == 0
    assert engine.core._num_constrained == 0


@pytest.mark.parametrize(("constraint", "message"), [
    ({"regex": "("}, "invalid regex"),
    ({"choice": []}, "non-empty list"),
    ({"json": {"type": "object"}, "regex": "a"}, "exactly one of"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"grammar": "start: nothing_defined"}, "invalid grammar"),
    ({"colour": "red"}, "unknown keys"),
])
def test_bad_constraints_are_refused_naming_the_field(constraint: dict, message: str) -> None:
    with pytest.raises(AdmissionError, match=message) as info:
        SamplingParams(structured_outputs=constraint)
    assert info.value.param == "structured_outputs" and not info.value.reason.startswith("structured_outputs")


def test_params_stay_hashable_and_equal_for_equal_constraints() -> None:
    a = SamplingParams(structured_outputs={"json": {"type": "object", "properties": {"a": {"type": "integer"}}}})
    b = SamplingParams(structured_outputs={"json": '{"type": "object", "properties": {"a": {"type": "integer"}}}'})
    assert a == b and hash(a) == hash(b) and a.replace(max_tokens=3).structured_outputs == a.structured_outputs


def test_admission_needs_a_tokenizer_llguidance_reads(hf_checkpoint) -> None:
    params = SamplingParams(structured_outputs={"regex": "[a-z]+"})
    no_tokenizer = Admission(vocab_size=256, max_model_len=64, eos_token_ids=(2,))
    with pytest.raises(AdmissionError, match="needs a tokenizer") as info:
        no_tokenizer.admit([1, 2, 3], params)
    assert info.value.param == "structured_outputs"
    # tests/conftest.py's tiny tokenizer decodes with Metaspace, which llguidance does not take: refused, twice.
    metaspace = Admission(vocab_size=256, max_model_len=64, eos_token_ids=(2,),
                          tokenizer=load_tokenizer(hf_checkpoint("llama")))
    for _ in range(2):
        with pytest.raises(AdmissionError, match="not available with this model's tokenizer"):
            metaspace.admit([1, 2, 3], params)
    assert metaspace.admit([1, 2, 3], SamplingParams()).grammar is None


def test_an_admitted_constraint_gets_its_own_matcher(llm: LLM) -> None:
    params = SamplingParams(structured_outputs={"choice": ["a", "b"]})
    first, second = (llm.engine.admission.admit("Hello", params) for _ in range(2))
    assert first.grammar is not None and second.grammar is not None and first.grammar is not second.grammar


# ------------------------------------------------------------------------------------------------ SmolLM2

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,10}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colour": {"enum": ["red", "green", "blue"]},
        "scores": {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 10},
                   "minItems": 1, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                    "required": ["city"]},
        "nickname": {"type": "string", "maxLength": 8},
    },
    "required": ["name", "age", "colour", "scores", "address"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def smollm2(smollm2_dir: Path) -> LLM:
    return LLM(str(smollm2_dir), token_budget=256, max_num_seqs=8, max_model_len=512, warmup=False)


def test_smollm2_outputs_satisfy_their_constraints(smollm2: LLM) -> None:
    chat = "<|im_start|>user\nDescribe a person as JSON.<|im_end|>\n<|im_start|>assistant\n"
    regex = r"[0-9]{3}-[0-9]{4}"
    choices = ["Paris", "London", "Rome"]
    params = [SamplingParams(temperature=0.0, max_tokens=120, structured_outputs={"json": SCHEMA}),
              SamplingParams(temperature=1.0, seed=2, max_tokens=120, structured_outputs={"json": SCHEMA}),
              SamplingParams(temperature=0.8, seed=3, max_tokens=60, structured_outputs={"json_object": True}),
              SamplingParams(temperature=1.0, seed=4, max_tokens=20, structured_outputs={"regex": regex}),
              SamplingParams(temperature=1.0, seed=5, max_tokens=20, structured_outputs={"choice": choices})]
    outs = smollm2.generate([chat] * len(params), params)
    assert all(out.finish_reason == "stop" and out.error is None for out in outs), [o.text for o in outs]
    for out in outs[:2]:
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert isinstance(json.loads(outs[2].text), dict)
    assert re.fullmatch(regex, outs[3].text)
    assert outs[4].text in choices


def test_int8_weights_under_constraints(ascii_llama: Path) -> None:
    """Constraints act on the logits whatever the weights hold: an int8 engine's greedy text, then constrained to
    itself, comes back token for token."""
    llm = LLM(str(ascii_llama), quantization="int8", token_budget=64, max_num_seqs=8, num_blocks=128,
              max_model_len=256, warmup=False)
    refs = llm.generate(PROMPTS, GREEDY)
    outs = llm.generate(PROMPTS, [GREEDY.replace(structured_outputs={"choice": [ref.text, "zzz"]}) for ref in refs])
    assert [o.token_ids for o in outs] == [r.token_ids for r in refs]
    [out] = llm.generate(PROMPTS[0], GREEDY.replace(max_tokens=48, structured_outputs={"regex": "[a-z]{3} [0-9]{2}"}))
    assert re.fullmatch("[a-z]{3} [0-9]{2}", out.text)
