"""Structured outputs through both servers, on tests/conftest.py's `ascii_llama` (a tokenizer llguidance reads):
the official `openai` client's `response_format` and vLLM's extras, streaming and not, and gRPC's
`structured_outputs` field; bad constraints are 400 / INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import json
import math
import re

import grpc
import jsonschema
import openai
import pytest

from grpc_test_utils import PLAIN_CHAT_TEMPLATE, make_engine, serving, stub_for
from server.client import make_request
from server.proto.sarathi.v1 import generation_pb2 as pb

SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tags": {"type": "array", "items": {"enum": ["x", "yz"]},
                                                    "minItems": 1, "maxItems": 2}},
          "required": ["id", "tags"], "additionalProperties": False}
REGEX = r"[a-z]{2,5} [0-9]{2}"


@pytest.fixture(scope="module")
def server(ascii_llama):
    with serving(make_engine(ascii_llama), chat_template=PLAIN_CHAT_TEMPLATE, http_port=0) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def stub(server):
    channel, stub = stub_for(server.target)
    yield stub
    channel.close()


def response_format() -> dict:
    return {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA, "strict": True}}


@pytest.mark.parametrize("stream", [False, True])
def test_openai_response_format_round_trip(server, client, stream: bool) -> None:
    kwargs = dict(model=server.model_name, max_tokens=60, temperature=0.0, response_format=response_format())
    if stream:
        chunks = list(client.chat.completions.create(messages=[{"role": "user", "content": "id?"}], stream=True,
                                                     **kwargs))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    else:
        chat = client.chat.completions.create(messages=[{"role": "user", "content": "id?"}], **kwargs)
        text, finish = chat.choices[0].message.content, [chat.choices[0].finish_reason]
        # The client's completions API has no response_format argument; the route takes it in the body.
        rf = kwargs.pop("response_format")
        plain = client.completions.create(prompt="Hello world", extra_body={"response_format": rf}, **kwargs)
        assert plain.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(plain.choices[0].text), SCHEMA)
    assert finish == ["stop"]
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_under_a_constraint_list_only_the_allowed_tokens(server, client, stream: bool) -> None:
    """A choice of "x" or "y" allows two first tokens: top_logprobs=5 lists those two (the others were never
    candidates, and JSON has no -inf), their probabilities adding up to 1."""
    kwargs = dict(model=server.model_name, messages=[{"role": "user", "content": "x or y?"}], max_tokens=4,
                  temperature=1.0, seed=2, logprobs=True, top_logprobs=5, extra_body={"guided_choice": ["x", "y"]})
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        content = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    else:
        content = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    top = content[0].top_logprobs
    assert sorted(t.token for t in top) == ["x", "y"] and content[0].token in ("x", "y")
    assert sum(math.exp(t.logprob) for t in top) == pytest.approx(1.0, abs=1e-5)
    plain = client.completions.create(model=server.model_name, prompt="Hello", max_tokens=4, logprobs=5,
                                      extra_body={"guided_choice": ["x", "y"]})
    assert sorted(plain.choices[0].logprobs.top_logprobs[0]) == ["x", "y"]


def test_openai_json_object_on_both_routes(server, client) -> None:
    common = dict(model=server.model_name, max_tokens=40, temperature=1.0, seed=5,
                  response_format={"type": "json_object"})
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "JSON?"}], **common).choices[0]
    rf = common.pop("response_format")
    plain = client.completions.create(prompt="Hello", extra_body={"response_format": rf}, **common).choices[0]
    for text, finish in ((chat.message.content, chat.finish_reason), (plain.text, plain.finish_reason)):
        assert finish == "length" or isinstance(json.loads(text), dict), (finish, text)
        assert text.startswith("{"), text


def test_vllm_extras(server, client) -> None:
    common = dict(model=server.model_name, prompt="Hello world", max_tokens=30, temperature=1.0, seed=3)
    regex = client.completions.create(extra_body={"guided_regex": REGEX}, **common).choices[0]
    assert re.fullmatch(REGEX, regex.text) and regex.finish_reason == "stop"
    choice = client.completions.create(extra_body={"guided_choice": ["red", "green"]}, **common).choices[0]
    assert choice.text in ("red", "green")
    nested = client.completions.create(extra_body={"structured_outputs": {"regex": "[0-9]{4}"}}, **common)
    assert re.fullmatch("[0-9]{4}", nested.choices[0].text)
    grammar = client.completions.create(extra_body={"guided_grammar": 'start: "a" | "b"'}, **common)
    assert grammar.choices[0].text in ("a", "b")
    as_json = client.completions.create(extra_body={"guided_json": SCHEMA}, **{**common, "max_tokens": 60})
    jsonschema.validate(json.loads(as_json.choices[0].text), SCHEMA)


@pytest.mark.parametrize(("extra", "param", "word"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    ({"guided_json": {"type": "object", "properties": {"a": {"type": "bogus"}}}}, "guided_json", "invalid json"),
    ({"guided_choice": []}, "guided_choice", "non-empty"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "only one"),
    ({"guided_json": {"type": "object"}, "guided_choice": ["a"]}, "guided_choice", "only one"),
    ({"guided_regex": "a(b"}, "guided_regex", "unclosed group"),
    ({"guided_grammar": "start: nope"}, "guided_grammar", "invalid grammar"),
    ({"guided_regex": "é+"}, "guided_regex", "cannot be generated with this model's tokenizer"),
    ({"guided_json": {"type": "object", "properties": {f"k{i}": {"type": "integer"} for i in range(5000)}}},
     "guided_json", "the limit is 65536"),
])
def test_bad_constraints_are_400_naming_the_field(server, client, extra: dict, param: str, word: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=server.model_name, prompt="hi", max_tokens=2, extra_body=extra)
    assert info.value.body["param"] == param and word in info.value.message


def test_grpc_structured_outputs(stub) -> None:
    req = make_request("Hello world", temperature=1.0, seed=4, max_tokens=30,
                       structured_outputs=json.dumps({"regex": REGEX}))
    resp = stub.Complete(req, timeout=60)
    assert resp.finish_reason == pb.FINISH_REASON_STOP and re.fullmatch(REGEX, resp.text)
    streamed = "".join(r.text for r in stub.Generate(
        make_request("Hello world", temperature=0.0, max_tokens=60, structured_outputs={"json": SCHEMA}), timeout=60))
    jsonschema.validate(json.loads(streamed), SCHEMA)


@pytest.mark.parametrize(("value", "word"), [
    ("{not json", "not a JSON object"),
    (json.dumps({"regex": "a", "json_object": True}), "exactly one"),
    (json.dumps({"regex": "("}), "invalid regex"),
    (json.dumps({"choice": []}), "non-empty list"),
    (json.dumps({"grammar": "start: nope"}), "invalid grammar"),
    (json.dumps({"json": {"type": "object", "properties": {"a": {"type": "bogus"}}}}), "invalid json"),
    (json.dumps({"json": {"type": "object", "properties": {f"k{i}": {} for i in range(9000)}}}), "the limit is 65536"),
])
def test_grpc_bad_constraints_are_invalid_argument(stub, value: str, word: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        stub.Complete(make_request([1, 2, 3], max_tokens=2, structured_outputs=value), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and word in info.value.details()
    assert "structured_outputs" in info.value.details()
