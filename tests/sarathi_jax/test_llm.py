"""The offline `LLM` API: text prompts, stop conditions and logprobs, checked against HF and the tokenizer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sarathi_jax import LLM, SamplingParams
from sarathi_jax.request.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def llama_dir(hf_checkpoint):
    return hf_checkpoint("llama")


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), token_budget=64, max_num_seqs=8, num_blocks=128, max_model_len=256, warmup=False)


@pytest.fixture(scope="module")
def hf_model(llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(llama_dir, torch_dtype=torch.float32).eval()


def test_text_prompt_round_trips_through_tokenizer(llm, llama_dir):
    tokenizer = load_tokenizer(llama_dir)
    prompt = "The quick brown fox jumps over the lazy dog."
    [out] = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert out.prompt_token_ids == tuple(tokenizer.encode(prompt))
    assert len(out.token_ids) == 12 and out.finish_reason == "length"
    assert out.text == tokenizer.decode(list(out.token_ids))


def test_logprobs_match_hf_log_softmax(llm, hf_model):
    prompt = [1, 17, 42, 99, 7, 3]
    [out] = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=3))
    assert len(out.new_logprobs) == 5
    ids = list(prompt)
    for entry in out.new_logprobs:
        with torch.no_grad():
            logits = hf_model(torch.tensor([ids])).logits[0, -1].double()
        ref = torch.log_softmax(logits, dim=-1).numpy()
        assert entry.token_id == int(np.argmax(ref))
        assert entry.logprob == pytest.approx(ref[entry.token_id], abs=1e-4)
        assert list(entry.top_token_ids) == list(np.argsort(-ref)[:3])
        np.testing.assert_allclose(entry.top_logprobs, np.sort(ref)[::-1][:3], atol=1e-4)
        ids.append(entry.token_id)


def test_logprobs_zero_alone_gives_each_tokens_logprob(llm, hf_model):
    # logprobs=0 (the sampled token's logprob, no top-N) alone in its steps: it once ran the variant without
    # logprobs, whose steps bring none to the host, and the engine step failed (found by tests/server/test_fuzz.py).
    prompt = [1, 17, 42, 99, 7, 3]
    [out] = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=0))
    assert len(out.new_logprobs) == 3
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt])).logits[0, -1].double()
    first = out.new_logprobs[0]
    assert first.logprob == pytest.approx(torch.log_softmax(logits, dim=-1)[first.token_id].item(), abs=1e-4)
    assert all(e.top_token_ids == () and e.top_logprobs == () for e in out.new_logprobs)


def test_stop_string_cuts_text_and_stop_token_stops(llm, llama_dir):
    tokenizer = load_tokenizer(llama_dir)
    prompt = "Hello world! How are you"
    [free] = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    text = free.text
    assert len(text) > 4
    stop = text[2:4]  # a stop string from inside the greedy continuation
    [cut] = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=[stop]))
    assert cut.finish_reason == "stop"
    assert cut.text == text[: text.index(stop)]
    assert stop not in cut.text

    third = free.token_ids[2]
    [by_id] = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                                                  stop_token_ids=[third]))
    first_hit = free.token_ids.index(third)
    assert by_id.finish_reason == "stop"
    assert by_id.token_ids == free.token_ids[: first_hit + 1]
    assert tokenizer is not None


def test_min_tokens_suppresses_stop_tokens(llm):
    prompt = [1, 5, 9, 13]
    [free] = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    first = free.token_ids[0]
    params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=3, stop_token_ids=[first], ignore_eos=True)
    [out] = llm.generate(prompt, params)
    assert first not in out.token_ids[:3]
    assert len(out.token_ids) >= 3


def test_eos_stops_unless_ignored(llm, monkeypatch):
    prompt = [1, 20, 30]
    [free] = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    # Random weights rarely emit the real EOS, so declare the model's second greedy token to be EOS.
    eos_like = free.token_ids[1]
    monkeypatch.setattr(llm.engine.core, "eos_token_ids", (eos_like,))
    [out] = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=6))
    assert out.token_ids == free.token_ids[: free.token_ids.index(eos_like) + 1]
    assert out.finish_reason == "stop"
    [ignored] = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert ignored.token_ids == free.token_ids and ignored.finish_reason == "length"


def test_generate_rejects_bad_batch_and_keeps_serving(llm):
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([[1, 2, 3], []], SamplingParams(max_tokens=2))
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_total_blocks
    [out] = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=2))
    assert len(out.token_ids) == 2


def test_request_too_long_for_max_model_len_is_refused_at_admission(llm):
    with pytest.raises(ValueError, match="max_tokens: .*max_model_len"):
        llm.generate([[1, 2, 3] * 40], SamplingParams(max_tokens=200))  # 120 + 200 > 256
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_total_blocks


def test_streamed_text_deltas_add_up_and_never_show_the_stop_string(llm):
    engine = llm.engine
    prompt = "Hello world! How are you"
    [free] = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    stop = free.text[3:6]
    engine.add_request("stream", prompt, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=stop))
    deltas, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append(out.text_delta)
            assert stop not in "".join(deltas)
            if out.finished:
                final = out
    assert "".join(deltas) == final.text == free.text[: free.text.index(stop)]


def test_generate_takes_one_priority_per_prompt(llm):
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    plain = llm.generate([[5, 6, 7], [8, 9]], params)
    ranked = llm.generate([[5, 6, 7], [8, 9]], params, priority=[2, -1])
    assert [o.token_ids for o in ranked] == [o.token_ids for o in plain]
    with pytest.raises(ValueError, match="priority: got 1 priorities for 2 prompts"):
        llm.generate([[5, 6, 7], [8, 9]], params, priority=[0])
    with pytest.raises(ValueError, match="^priority: must be an integer"):
        llm.generate([[5, 6, 7], [8, 9]], params, priority=[0, 0.5])
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_total_blocks


def test_generate_takes_slo_targets_and_reports_whether_met(llm):
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    plain = llm.generate([[5, 6, 7], [8, 9]], params)
    outs = llm.generate([[5, 6, 7], [8, 9]], params, slo_ttft_s=[3600.0, 1e-9], slo_tbt_s=3600.0)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert [(o.metrics.slo_ttft_s, o.metrics.slo_tbt_s) for o in outs] == [(3600.0, 3600.0), (1e-9, 3600.0)]
    assert [o.metrics.slo_met for o in outs] == [True, False]  # no engine answers in a nanosecond
    assert plain[0].metrics.slo_met is None
    with pytest.raises(ValueError, match="slo_tbt_s: got 1 values for 2 prompts"):
        llm.generate([[5, 6, 7], [8, 9]], params, slo_tbt_s=[0.1])
    with pytest.raises(ValueError, match="^slo_ttft_s: must be a finite number of seconds > 0"):
        llm.generate([[5, 6, 7], [8, 9]], params, slo_ttft_s=[1.0, -1.0])
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_total_blocks


class _Interrupt:
    """Raises KeyboardInterrupt at the `at`-th call of `target.name` (wrapping it), once; what Ctrl-C does to a
    `generate` at that point."""

    def __init__(self, monkeypatch, target, name: str, at: int, after: bool = False) -> None:
        self.calls, real = 0, getattr(target, name)

        def wrapped(*args, **kwargs):
            self.calls += 1
            if self.calls == at and not after:
                raise KeyboardInterrupt
            result = real(*args, **kwargs)
            if self.calls == at:  # after: the call's work is done, its result lost
                raise KeyboardInterrupt
            return result

        monkeypatch.setattr(target, name, wrapped)


def _result_of_handles(monkeypatch, executor, at: int) -> None:
    """KeyboardInterrupt from the `at`-th step handle's `result()` (a batch taken out of flight, not retired)."""
    real_submit, count = executor.submit, [0]

    def submit(*args, **kwargs):
        handle = real_submit(*args, **kwargs)
        count[0] += 1
        if count[0] == at:
            real_result = handle.result

            def result():
                real_result()
                raise KeyboardInterrupt

            monkeypatch.setattr(handle, "result", result)
        return handle

    monkeypatch.setattr(executor, "submit", submit)


@pytest.mark.parametrize("where", ["dispatch", "retire", "schedule", "after_step", "between_adds"])
def test_an_interrupted_generate_leaves_the_engine_clean(llm, monkeypatch, where):
    prompts = [[1, 17, 42, 99, 7, 3] * 3, [5, 6, 7], [8, 9, 10, 11] * 5, [2, 4]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    reference = [o.token_ids for o in llm.generate(prompts, params)]
    engine = llm.engine
    with monkeypatch.context() as patch:
        if where == "dispatch":
            _Interrupt(patch, engine.core.executor, "submit", at=3)
        elif where == "retire":
            _result_of_handles(patch, engine.core.executor, at=3)
        elif where == "schedule":
            _Interrupt(patch, engine.core.scheduler, "schedule", at=4)
        elif where == "after_step":
            _Interrupt(patch, engine, "step", at=3, after=True)
        else:
            _Interrupt(patch, engine, "add_request", at=3, after=True)
        with pytest.raises(KeyboardInterrupt):
            llm.generate(prompts, params)
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks
    again = llm.generate(prompts, params)
    assert [o.token_ids for o in again] == reference
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks


def test_an_exception_in_generate_aborts_only_its_own_requests(llm, monkeypatch):
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    [alone] = llm.generate([[3, 1, 4, 1, 5]], params)
    engine.add_request("outside", [3, 1, 4, 1, 5], params)  # a request of the engine's own API, not of generate
    with monkeypatch.context() as patch:
        _Interrupt(patch, engine, "step", at=2, after=True)
        with pytest.raises(KeyboardInterrupt):
            llm.generate([[5, 6, 7]], params)
    assert "outside" in engine.core
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "outside" and out.finished:
                final = out
    assert final is not None and final.token_ids == alone.token_ids
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks


def test_generate_takes_numpy_token_ids_and_refuses_what_is_no_prompt(llm):
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    [as_list] = llm.generate([5, 6, 7], params)
    [as_array] = llm.generate(np.array([5, 6, 7]), params)
    as_rows = llm.generate(np.array([[5, 6, 7], [5, 6, 7]], dtype=np.int32), params)
    assert as_array.token_ids == as_list.token_ids == as_rows[0].token_ids == as_rows[1].token_ids
    assert as_array.prompt_token_ids == (5, 6, 7)
    for bad, match in ((None, "^prompts: .*got NoneType"), (b"\x05\x06", "^prompts: .*bytes"),
                       ([b"\x05\x06"], "^prompt: .*bytes"), ({"prompt": "hi"}, "^prompts: .*dict"),
                       (5, "^prompts: .*got int")):
        with pytest.raises(ValueError, match=match):
            llm.generate(bad, params)
    for bad, match in (({"max_tokens": 3}, r"^params: .*got dict \(SamplingParams\(\*\*d\)"),
                       ([{"max_tokens": 3}], "^params: .*holding dict"), ("greedy", "^params: .*got str")):
        with pytest.raises(ValueError, match=match):
            llm.generate([5, 6, 7], bad)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_total_blocks
