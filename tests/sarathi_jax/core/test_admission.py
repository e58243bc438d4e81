"""`Admission` on hostile input: whatever a request carries, admitting it raises only `AdmissionError` naming the
field (servers answer that with a 400 / INVALID_ARGUMENT), and a prompt too long to fit is refused before it is
tokenised or converted."""

from __future__ import annotations

import pytest
import tokenizers
from tokenizers import models, pre_tokenizers

from sarathi_jax.core.admission import Admission, AdmissionError
from sarathi_jax.request.chat_template import ChatTemplate
from sarathi_jax.request.sampling_params import SamplingParams
from sarathi_jax.request.tokenizer import Tokenizer

VOCAB = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4, "user:": 5, "longest-token": 6}
MAX_MODEL_LEN = 32


class _RaisingList(list):
    """A token-id list whose elements must never be converted (the length check comes first)."""

    def __iter__(self):
        raise AssertionError("the ids were converted before the length check")


@pytest.fixture
def admission() -> Admission:
    backend = tokenizers.Tokenizer(models.WordLevel(vocab=VOCAB, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return Admission(vocab_size=len(VOCAB), max_model_len=MAX_MODEL_LEN, tokenizer=Tokenizer(backend),
                     chat_template=ChatTemplate("{% for m in messages %}{{ m.role }}: {{ m.content }} {% endfor %}"))


def refusal(call, *args) -> AdmissionError:
    with pytest.raises(AdmissionError) as info:
        call(*args)
    return info.value


@pytest.mark.parametrize("text", ["\ud800", "hello \udfff world"])
def test_lone_surrogate_in_a_text_prompt_is_refused_naming_the_field(admission, text) -> None:
    err = refusal(admission.admit, text, SamplingParams(max_tokens=2))
    assert err.param == "prompt" and "not valid Unicode" in err.reason


def test_lone_surrogate_in_chat_content_is_refused_naming_messages(admission) -> None:
    err = refusal(admission.admit_chat, [{"role": "user", "content": "\udfff"}], SamplingParams(max_tokens=2))
    assert err.param == "messages" and "not valid Unicode" in err.reason


def test_valid_text_still_tokenises(admission) -> None:
    assert admission.admit("hello world", SamplingParams(max_tokens=2)).prompt_token_ids == (3, 4)
    assert admission.admit_chat([{"role": "user", "content": "hello"}]).prompt_token_ids == (5, 3)


@pytest.mark.parametrize("prompt", [[1, True], [1, 2.5], [1, "2"], [[1, 2]], 7])
def test_token_ids_that_are_not_integers_are_refused(admission, prompt) -> None:
    assert refusal(admission.admit, prompt).param == "prompt"


def test_too_many_token_ids_are_refused_before_conversion(admission) -> None:
    err = refusal(admission.admit, _RaisingList([3] * MAX_MODEL_LEN))
    assert err.param == "prompt" and "max_model_len" in err.reason


def test_text_too_long_to_fit_is_refused_before_tokenising(admission) -> None:
    assert admission.tokenizer.longest_token_chars == len("longest-token")
    limit = MAX_MODEL_LEN * len("longest-token")
    admission.tokenizer.backend = None  # tokenising now fails: the length check must come first
    err = refusal(admission.admit, "x" * (limit + 1))
    assert err.param == "prompt" and str(limit) in err.reason


@pytest.mark.parametrize("bad", [1.5, "1", None, True, [0], 2**31, -(2**31) - 1, 10**30])
def test_bad_priority_is_refused_naming_the_field(admission, bad):
    for call, first in ((admission.admit, [3, 4]), (admission.admit_chat, [{"role": "user", "content": "hello"}])):
        err = refusal(call, first, None, bad)
        assert err.param == "priority" and str(err).startswith("priority: ")


@pytest.mark.parametrize("good", [0, -(2**31), 2**31 - 1, -7])
def test_priority_in_the_int32_range_is_admitted(admission, good):
    assert admission.admit([3, 4], None, good).priority == good
    assert admission.admit("hello world").priority == 0


@pytest.mark.parametrize("param", ["slo_ttft_s", "slo_tbt_s"])
@pytest.mark.parametrize("bad", [0, -0.5, float("nan"), float("inf"), True, "1", [1.0]])
def test_bad_slo_target_is_refused_naming_the_field(admission, param, bad):
    for call, first in ((admission.admit, [3, 4]), (admission.admit_chat, [{"role": "user", "content": "hello"}])):
        with pytest.raises(AdmissionError) as info:
            call(first, None, 0, **{param: bad})
        assert info.value.param == param and str(info.value).startswith(f"{param}: ")
    with pytest.raises(AdmissionError, match=f"^{param}: "):
        admission.check([3, 4], None, **{param: bad})


def test_slo_targets_are_admitted_as_floats(admission):
    req = admission.admit([3, 4], None, slo_ttft_s=2, slo_tbt_s=0.05)
    assert (req.slo_ttft_s, req.slo_tbt_s) == (2.0, 0.05) and isinstance(req.slo_ttft_s, float)
    req = admission.admit("hello world")
    assert (req.slo_ttft_s, req.slo_tbt_s) == (None, None)
