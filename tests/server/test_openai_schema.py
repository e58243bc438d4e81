"""The HTTP API's request bodies (`server/openai_schema.py`) and error mapping (`server/http_api.py`), without a
server: field mapping to SamplingParams, refused fields, batch prompts, chat content parts, OpenAI error shapes."""

from __future__ import annotations

import json

import grpc
import pytest
from pydantic import ValidationError

from sarathi_jax.core.admission import AdmissionError
from server.http_api import error_body, error_response
from server.openai_schema import ChatCompletionRequest, ChatMessage, CompletionRequest
from server.request_state import RequestError


def test_completion_body_maps_to_sampling_params_and_keeps_defaults() -> None:
    body = CompletionRequest(prompt="hi", temperature=0.5, top_k=7, stop="x", seed=3, unknown_field=1)
    params = body.sampling_params(logprobs=2, max_tokens=9)
    assert (params.temperature, params.top_k, params.seed, params.max_tokens, params.logprobs) == (0.5, 7, 3, 9, 2)
    assert tuple(params.stop) == ("x",)
    assert params.top_p == CompletionRequest(prompt="hi").sampling_params(None, None).top_p == 1.0
    assert not body.include_usage
    assert CompletionRequest(prompt="hi", stream=True, stream_options={"include_usage": True}).include_usage


@pytest.mark.parametrize("fields, field", [({"echo": True}, "echo"), ({"suffix": "s"}, "suffix"),
                                           ({"best_of": 2}, "best_of"), ({"n": 2}, "n"), ({}, None)])
def test_unsupported_fields_are_named(fields, field) -> None:
    assert CompletionRequest(prompt="hi", **fields).unsupported() == field


def test_single_prompt_accepts_a_batch_of_one_only() -> None:
    assert CompletionRequest(prompt=["only"]).single_prompt() == "only"
    assert CompletionRequest(prompt=[[1, 2]]).single_prompt() == [1, 2]
    assert CompletionRequest(prompt=[5, 6]).single_prompt() == [5, 6]
    with pytest.raises(AdmissionError, match="batches of prompts are not supported") as err:
        CompletionRequest(prompt=["a", "b"]).single_prompt()
    assert err.value.param == "prompt"
    with pytest.raises(ValidationError):
        CompletionRequest(prompt=3.5)


def test_chat_message_content_parts_are_joined() -> None:
    message = ChatMessage(role="user", content=[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                          name="ann")
    assert message.as_template_message() == {"role": "user", "content": "ab", "name": "ann"}
    assert ChatMessage(role="assistant").as_template_message() == {"role": "assistant", "content": ""}
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], max_completion_tokens=4)
    assert body.max_completion_tokens == 4 and body.messages[0].content == "x"


@pytest.mark.parametrize("code, status, type_", [
    (grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error"),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error"),
    (grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable_error"),
    (grpc.StatusCode.INTERNAL, 500, "server_error"),
])
def test_errors_have_openais_shape_and_status(code, status, type_) -> None:
    response = error_response(RequestError(code, "went wrong", param="temperature"))
    assert response.status_code == status
    assert json.loads(response.body) == error_body("went wrong", type_, "temperature", code.name.lower())
    assert error_body("m", "t")["error"] == {"message": "m", "type": "t", "param": None, "code": None}
