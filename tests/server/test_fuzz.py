"""Property-based fuzzing of both front ends: requests drawn from the OpenAI schema (/v1/completions,
/v1/chat/completions, streamed or not) and from the gRPC proto (Generate, Complete), with hostile values (lone
surrogates, NUL, huge and negative numbers, NaN/inf, wrong types, deep nesting, huge lists, empty strings,
unknown fields). Each must get a 2xx or a 4xx in the protocol's own shape, never a 5xx, an UNKNOWN/INTERNAL or a
hang; afterwards the server still serves and holds no running request and no KV block.

Deterministic (derandomize) and bounded: a fixed number of examples per test, one server for the module, run
once without an API key and once with one (the clients sending it)."""

from __future__ import annotations

import json
import math
from typing import Any

import grpc
import httpx2
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from grpc_test_utils import PLAIN_CHAT_TEMPLATE, all_blocks_free, serving, wait_until
from server.http_limits import HttpLimits
from server.proto.sarathi.v1 import generation_pb2 as pb
from server.proto.sarathi.v1 import generation_pb2_grpc as pb_grpc
from server.security import ClientSecurity, ServerSecurity, grpc_channel

REQUEST_TIMEOUT_S = 30.0  # a hang fails the example instead of stalling the suite
MAX_BODY_BYTES = 64 << 10
MAX_REQUEST_ID_LENGTH = 32
FUZZ = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
OK_GRPC_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                 grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.FAILED_PRECONDITION}


@pytest.fixture(scope="module", params=[None, "sk-fuzz"], ids=["open", "keyed"])
def client_security(request) -> ClientSecurity:
    """The module runs twice: against a server without an API key, then one with (the clients send it)."""
    return ClientSecurity(api_key=request.param)


@pytest.fixture(scope="module")
def server(llama_engine, client_security):
    with serving(llama_engine, PLAIN_CHAT_TEMPLATE, http_port=0,
                 max_request_id_length=MAX_REQUEST_ID_LENGTH,
                 http_limits=HttpLimits(max_body_bytes=MAX_BODY_BYTES, header_timeout_s=5.0),
                 security=ServerSecurity(api_key=client_security.api_key)) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server, client_security):
    with httpx2.Client(base_url=f"http://127.0.0.1:{server.http_port}", timeout=REQUEST_TIMEOUT_S,
                       headers=client_security.http_headers()) as client:
        yield client


@pytest.fixture(scope="module")
def channel(server, client_security):
    with grpc_channel(server.target, client_security) as channel:
        yield channel


@pytest.fixture(scope="module")
def stub(channel):
    return pb_grpc.GenerationStub(channel)


def assert_healthy_and_idle(server, http, stub) -> None:
    """A normal request still succeeds on each front end, and nothing is left running or holding KV blocks."""
    ok = http.post("/v1/completions", json={"prompt": [3, 4], "max_tokens": 2, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2, ok.text
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[3, 4]), max_tokens=2, ignore_eos=True)
    assert len(stub.Complete(req, timeout=REQUEST_TIMEOUT_S).token_ids) == 2
    wait_until(lambda: all_blocks_free(stub) and server.num_active_requests == 0, timeout=10,
               what="no running request and no KV block in use")


# --------------------------------------------------------------------------------------------- values
HOSTILE_TEXT = ["", "\x00", "\ud800", "a\udfff", "\ud83d\x00", "\uffff", "x" * 5000, "<|endoftext|>"]
HOSTILE_INTS = [-1, 0, 2**31, -(2**31) - 1, 2**63, -(2**63) - 1, 10**30]
HOSTILE_FLOATS = [math.nan, math.inf, -math.inf, 1e300, -1e300, -0.0, 5e-324]
DEEP = "\x00deep\x00"  # placeholder replaced by deeply nested JSON text (json.dumps itself would recurse)

texts = st.one_of(st.text(max_size=12), st.sampled_from(HOSTILE_TEXT))
ints = st.one_of(st.integers(-3, 8), st.sampled_from(HOSTILE_INTS))
floats = st.one_of(st.floats(-2, 3), st.sampled_from(HOSTILE_FLOATS))
scalars = st.one_of(st.none(), st.booleans(), ints, floats, texts)
huge_lists = st.sampled_from([[1] * 5000, ["x"] * 2000, [[1]] * 1000, [None] * 500])
hostile = st.one_of(scalars, huge_lists, st.just(DEEP), st.just({}), st.just([]),
                    st.lists(scalars, max_size=4), st.dictionaries(texts, scalars, max_size=3))


token_ids = st.lists(st.integers(0, 200), min_size=1, max_size=6)
plain_texts = st.text(st.characters(codec="utf-8"), max_size=12)  # no surrogate: what a valid field holds
# A str field's values: well-formed, or hostile yet still a str (lone surrogates, NUL, control characters, huge).
any_texts = st.one_of(plain_texts, st.sampled_from(HOSTILE_TEXT),
                      st.text(st.characters(categories=["Cs", "Cc", "Zs", "L"]), min_size=1, max_size=8))
SAMPLING_FIELDS = {  # field -> a value of the right type, mostly in range
    "max_tokens": st.integers(0, 4), "temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1),
    "top_k": st.integers(-1, 8), "min_p": st.floats(0, 1), "min_tokens": st.integers(0, 3),
    "seed": st.integers(0, 2**31), "stop": st.one_of(any_texts, st.lists(any_texts, max_size=3)),
    "stop_token_ids": token_ids, "ignore_eos": st.booleans(), "n": st.just(1), "return_token_ids": st.booleans(),
    "stream": st.booleans(), "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
}
COMPLETION_FIELDS = {
    **SAMPLING_FIELDS, "logprobs": st.integers(0, 3), "echo": st.booleans(), "best_of": st.just(1),
}
part = st.fixed_dictionaries({"type": st.just("text"), "text": any_texts})
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"])},
                                optional={"content": st.one_of(any_texts, st.lists(part, max_size=2))})
CHAT_FIELDS = {
    **SAMPLING_FIELDS, "max_completion_tokens": st.integers(0, 4), "logprobs": st.booleans(),
    "top_logprobs": st.integers(0, 3),
}
OTHER_FIELDS = ["model", "suffix", "tools", "response_format", "an_unknown_field"]  # hostile values only


@st.composite
def bodies(draw, required: dict[str, st.SearchStrategy], optional: dict[str, st.SearchStrategy],
           nested: list[str]) -> Any:
    """A well-typed body, then (mostly) one field, or a field of a nested object, made hostile; or no object."""
    body = draw(st.fixed_dictionaries(required, optional=optional))
    how = draw(st.sampled_from(["valid", "field", "field", "field", "nested", "not-an-object"]))
    if how == "field":
        body[draw(st.sampled_from([*required, *optional, *OTHER_FIELDS]))] = draw(hostile)
    elif how == "nested":
        outer, inner = draw(st.sampled_from(nested)).split(".")
        body.setdefault(outer, [{}] if outer == "messages" else {})
        target = body[outer][0] if isinstance(body[outer], list) and body[outer] else body[outer]
        if isinstance(target, dict):
            target[inner] = draw(hostile)
    elif how == "not-an-object":
        return draw(hostile)
    return body


completion_payloads = bodies({"prompt": st.one_of(any_texts, token_ids, st.lists(any_texts, max_size=2),
                                                   st.lists(token_ids, max_size=2))},
                             COMPLETION_FIELDS, ["stream_options.include_usage", "stream_options.unknown"])
chat_payloads = bodies({"messages": st.lists(message, min_size=1, max_size=3)}, CHAT_FIELDS,
                       ["messages.role", "messages.content", "messages.name", "messages.unknown",
                        "stream_options.include_usage"])


def encode(body: Any, depth: int) -> bytes:
    """JSON as a careless client writes it: NaN/Infinity literals, lone surrogates as \\u escapes, and the DEEP
    placeholder `depth` arrays deep."""
    text = json.dumps(body)  # ensure_ascii: a lone surrogate travels as its escape, as JSON allows
    return text.replace(json.dumps(DEEP), "[" * depth + "]" * depth).encode()


# --------------------------------------------------------------------------------------------- HTTP checks
def assert_openai_error(status: int, payload: Any) -> None:
    assert isinstance(payload, dict) and set(payload) == {"error"}, payload
    err = payload["error"]
    assert isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str), err
    assert err["param"] is None or isinstance(err["param"], str), err


def check_http(http, path: str, content: bytes) -> None:
    headers = {"Content-Type": "application/json"}
    with http.stream("POST", path, content=content, headers=headers) as resp:
        raw = resp.read()
    status = resp.status_code
    event(f"HTTP {status}")  # what the run covered: `pytest --hypothesis-show-statistics`
    assert status < 500, (status, raw[:500])
    if status >= 400:
        assert_openai_error(status, json.loads(raw))
        return
    assert 200 <= status < 300, (status, raw[:500])
    if not resp.headers.get("content-type", "").startswith("text/event-stream"):
        assert json.loads(raw)["choices"], raw[:500]
        return
    events = [line[len(b"data: "):] for line in raw.split(b"\n") if line.startswith(b"data: ")]
    assert events and events[-1] == b"[DONE]", raw[-500:]
    for data in events[:-1]:
        chunk = json.loads(data)
        if "error" in chunk:  # an in-band error must still be OpenAI's error object
            assert_openai_error(status, chunk)


@pytest.mark.parametrize("path, payloads", [("/v1/completions", completion_payloads),
                                            ("/v1/chat/completions", chat_payloads)], ids=["completions", "chat"])
def test_http_fuzz_never_5xx_nor_hangs(server, http, stub, path, payloads):
    @FUZZ
    @given(body=payloads, depth=st.sampled_from([1, 64, 5000]))
    def one_request(body: Any, depth: int) -> None:
        check_http(http, path, encode(body, depth))

    one_request()
    assert_healthy_and_idle(server, http, stub)


def test_logprobs_zero_is_served(server, http, stub):
    # Found by the fuzzer: logprobs=0 alone in a step failed the engine step (HTTP 500 "engine step failed").
    resp = http.post("/v1/completions", json={"prompt": [3, 4], "max_tokens": 2, "ignore_eos": True, "logprobs": 0})
    assert resp.status_code == 200, resp.text
    logprobs = resp.json()["choices"][0]["logprobs"]
    assert len(logprobs["token_logprobs"]) == 2 and all(x <= 0 for x in logprobs["token_logprobs"]), logprobs
    assert_healthy_and_idle(server, http, stub)


# --------------------------------------------------------------------------------------------- gRPC
def varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # negative numbers travel as 10-byte two's complement, as protobuf writes them
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def length_delimited(number: int, payload: bytes) -> bytes:
    return varint(number << 3 | 2) + varint(len(payload)) + payload


grpc_texts = st.one_of(plain_texts, st.sampled_from(["", "\x00", "x" * 5000, "\uffff"]))
grpc_messages = st.builds(pb.ChatMessage, role=st.sampled_from(["user", "system", "", "\x00"]), content=grpc_texts)
prompts = st.one_of(
    st.builds(lambda t: {"text": t}, grpc_texts),
    st.builds(lambda ids: {"token_ids": pb.TokenIds(ids=ids)}, st.one_of(token_ids, token_ids, st.just([1] * 5000))),
    st.builds(lambda ms: {"messages": pb.ChatMessages(messages=ms)}, st.lists(grpc_messages, max_size=3)),
    st.just({}))  # no prompt at all
GRPC_OPTIONS = {  # field -> a value in range
    "temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1), "top_k": st.integers(0, 8),
    "min_p": st.floats(0, 1), "seed": st.integers(0, 2**31), "max_tokens": st.integers(1, 4),
    "min_tokens": st.integers(0, 1), "stop": st.lists(plain_texts, max_size=3), "stop_token_ids": token_ids,
    "ignore_eos": st.booleans(), "logprobs": st.integers(0, 3), "request_id": plain_texts.filter(bool),
}
int32_extremes = st.sampled_from([-1, -(2**31), 2**31 - 1])
int64_extremes = st.sampled_from([-1, -(2**63), 2**63 - 1])
GRPC_HOSTILE = {  # field -> out-of-range values of the field's own proto type
    "temperature": st.sampled_from(HOSTILE_FLOATS), "top_p": st.sampled_from(HOSTILE_FLOATS),
    "min_p": st.sampled_from(HOSTILE_FLOATS), "top_k": int32_extremes, "max_tokens": int32_extremes,
    "min_tokens": int32_extremes, "logprobs": int32_extremes, "seed": int64_extremes,
    "stop": st.sampled_from([["x"] * 2000, [""], ["\x00"]]),
    "stop_token_ids": st.one_of(st.lists(int64_extremes, min_size=1, max_size=3), st.just([1] * 5000)),
    "request_id": st.sampled_from(["", "\x00", "r" * (MAX_REQUEST_ID_LENGTH + 1)]),
}


@st.composite
def grpc_payloads(draw) -> bytes:
    """A serialized GenerateRequest, in range or with one field out of range; or one spoiled on the wire: a lone
    surrogate or invalid UTF-8 in a string field, a field with the wrong wire type, an unknown field, trailing
    garbage, or garbage alone."""
    options = draw(st.fixed_dictionaries({}, optional=GRPC_OPTIONS))
    if draw(st.booleans()):
        name = draw(st.sampled_from(sorted(GRPC_HOSTILE)))
        options[name] = draw(GRPC_HOSTILE[name])
    wire = pb.GenerateRequest(**draw(prompts), **options).SerializeToString()
    spoil = draw(st.sampled_from(["none", "none", "none", "surrogate", "wrong-type", "unknown-field",
                                  "garbage-tail", "garbage"]))
    if spoil == "surrogate":  # U+D800 as UTF-8 would write it, then invalid bytes: what protobuf clients refuse
        return wire + length_delimited(draw(st.sampled_from([1, 2, 11])), b"\xed\xa0\x80\x00\xff")
    if spoil == "wrong-type":  # max_tokens (an int32) sent length-delimited
        return wire + length_delimited(9, b"not a number")
    if spoil == "unknown-field":
        return wire + length_delimited(99, draw(st.binary(max_size=16)))
    if spoil == "garbage-tail":
        return wire + draw(st.binary(min_size=1, max_size=16))
    return draw(st.binary(max_size=32)) if spoil == "garbage" else wire


def check_grpc(channel: grpc.Channel, method: str, payload: bytes) -> None:
    try:
        if method == "Generate":
            replies = [pb.GenerateResponse.FromString(raw) for raw in channel.unary_stream(
                "/sarathi.v1.Generation/Generate")(payload, timeout=REQUEST_TIMEOUT_S)]
            assert replies and replies[-1].finished, replies
        else:
            replies = [pb.GenerateResponse.FromString(channel.unary_unary(
                "/sarathi.v1.Generation/Complete")(payload, timeout=REQUEST_TIMEOUT_S))]
        assert replies[-1].finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH), replies[-1]
        event("gRPC OK")
    except grpc.RpcError as err:
        event(f"gRPC {err.code().name}")
        assert err.code() in OK_GRPC_CODES and err.details(), (err.code(), err.details())


@pytest.mark.parametrize("method", ["Generate", "Complete"])
def test_grpc_fuzz_never_internal_nor_hangs(server, http, stub, channel, method):
    @FUZZ
    @given(payload=grpc_payloads())
    def one_request(payload: bytes) -> None:
        check_grpc(channel, method, payload)

    one_request()
    assert_healthy_and_idle(server, http, stub)
