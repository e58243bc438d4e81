"""What a hostile client gets from both front ends: a 4xx in the protocol's own shape naming the field, never a
5xx; and bounded costs (body size, request head time, request id length). One server (gRPC and HTTP, small
limits) over the shared engine, with a test chat template."""

from __future__ import annotations

import json
import socket
import time

import grpc
import httpx2
import pytest

from grpc_test_utils import PLAIN_CHAT_TEMPLATE, all_blocks_free, greedy, serving
from sarathi_jax.request.sampling_params import MAX_STOP_STRINGS
from server.client import make_request
from server.http_limits import HttpLimits
from server.proto.sarathi.v1 import generation_pb2 as pb
from server.proto.sarathi.v1 import generation_pb2_grpc as pb_grpc

MAX_BODY_BYTES = 64 << 10
HEADER_TIMEOUT_S = 1.0
MAX_REQUEST_ID_LENGTH = 32
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(llama_engine):
    with serving(llama_engine, PLAIN_CHAT_TEMPLATE, http_port=0,
                 max_request_id_length=MAX_REQUEST_ID_LENGTH,
                 http_limits=HttpLimits(max_body_bytes=MAX_BODY_BYTES, header_timeout_s=HEADER_TIMEOUT_S)) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx2.Client(base_url=f"http://127.0.0.1:{server.http_port}", timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(server.target) as channel:
        yield channel


def assert_openai_error(resp, status: int, param: str | None, code: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
    assert err["type"] == "invalid_request_error" and err["message"], err
    assert code is None or err["code"] == code, err
    return err


# --------------------------------------------------------------------------------------------- HTTP input
HOSTILE_BODIES = [
    # (case, path, body, field at fault)
    ("surrogate-prompt", "/v1/completions", {"prompt": "\ud800", "max_tokens": 2}, "prompt"),
    ("surrogate-prompt-streamed", "/v1/completions", {"prompt": "a\udfff", "max_tokens": 2, "stream": True}, "prompt"),
    ("surrogate-chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": "\udfff"}]}, "messages"),
    ("surrogate-chat-part", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}], "stream": True}, "messages"),
    ("surrogate-model", "/v1/completions", {"model": "\ud800", "prompt": "hi"}, "model"),
    ("empty-model", "/v1/completions", {"model": "", "prompt": "hi"}, "model"),
    ("bool-max_tokens", "/v1/completions", {"prompt": "hi", "max_tokens": True}, "max_tokens"),
    ("string-max_tokens", "/v1/completions", {"prompt": "hi", "max_tokens": "5"}, "max_tokens"),
    ("string-temperature", "/v1/completions", {"prompt": "hi", "temperature": "0.5"}, "temperature"),
    ("string-stream", "/v1/completions", {"prompt": "hi", "stream": "yes"}, "stream"),
    ("bool-prompt-ids", "/v1/completions", {"prompt": [True, False]}, "prompt"),
    ("bool-stop-id", "/v1/completions", {"prompt": "hi", "stop_token_ids": [True]}, "stop_token_ids.0"),
    ("too-many-stops", "/v1/completions", {"prompt": "hi", "stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop"),
]


@pytest.mark.parametrize("case", HOSTILE_BODIES, ids=[c[0] for c in HOSTILE_BODIES])
def test_hostile_body_is_a_400_naming_the_field(http, case):
    _, path, body, param = case
    content = json.dumps(body).encode()  # ASCII with \u escapes: JSON's way to carry a lone surrogate
    assert_openai_error(http.post(path, content=content, headers={"Content-Type": "application/json"}), 400, param)


def test_an_int_is_still_a_valid_float(http):
    resp = http.post("/v1/completions", json={"prompt": [3, 4], "max_tokens": 2, "temperature": 0, "top_p": 1,
                                              "ignore_eos": True})
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 2


FRAMEWORK_ERRORS = [
    # (case, method, path, raw body, status, code)
    ("invalid-utf8", "POST", "/v1/completions", b'{"prompt": "\xff\xfe"}', 400, "bad_request"),
    ("deep-json", "POST", "/v1/completions", b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, "bad_request"),
    ("unknown-route", "GET", "/v1/nothing", None, 404, "not_found"),
    ("wrong-method", "GET", "/v1/completions", None, 405, "method_not_allowed"),
    ("body-too-large", "POST", "/v1/completions", b'{"prompt": "' + b"a" * MAX_BODY_BYTES + b'"}', 413,
     "request_entity_too_large"),
]


@pytest.mark.parametrize("case", FRAMEWORK_ERRORS, ids=[c[0] for c in FRAMEWORK_ERRORS])
def test_framework_errors_have_openais_shape(http, case):
    _, method, path, body, status, code = case
    resp = http.request(method, path, content=body, headers={"Content-Type": "application/json"})
    assert_openai_error(resp, status, None, code)


def test_a_chunked_body_over_the_limit_is_a_413(http):
    def chunks():
        for _ in range(3):
            yield b" " * (MAX_BODY_BYTES // 2)  # whitespace: valid JSON padding, were it not too large
        yield b'{"prompt": "hi"}'

    resp = http.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert_openai_error(resp, 413, None, "request_entity_too_large")


def test_a_slow_request_head_is_cut_off(server):
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=HEADER_TIMEOUT_S + 10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # ... and never the rest of the head
        start = time.monotonic()
        assert sock.recv(1024) == b""  # closed by the server
        assert time.monotonic() - start < HEADER_TIMEOUT_S + 5


def test_a_keep_alive_connection_serves_requests_past_the_header_timeout(http):
    for _ in range(2):  # the deadline is on each head, not on the connection
        resp = http.post("/v1/completions", json={"prompt": [3, 4], "max_tokens": 2, "ignore_eos": True})
        assert resp.status_code == 200
        time.sleep(HEADER_TIMEOUT_S / 2)


# --------------------------------------------------------------------------------------------- gRPC input
def test_grpc_request_id_is_bounded(channel):
    complete = pb_grpc.GenerationStub(channel).Complete
    ok = complete(make_request([3, 4], max_tokens=2, request_id="r" * MAX_REQUEST_ID_LENGTH, **greedy()), timeout=30)
    assert len(ok.token_ids) == 2
    with pytest.raises(grpc.RpcError) as info:
        complete(make_request([3, 4], max_tokens=2, request_id="r" * (MAX_REQUEST_ID_LENGTH + 1)), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in info.value.details()


UNDECODABLE = [
    ("garbage", "Generate", b"\xff\xff\xff"), ("garbage", "Complete", b"\xff\xff\xff"),
    ("garbage", "GetStats", b"\xff\xff\xff"), ("garbage", "GetModelInfo", b"\xff\xff\xff"),
    ("invalid-utf8-text", "Generate", pb.GenerateRequest(text="hi").SerializeToString().replace(b"hi", b"\xff\xfe")),
    ("invalid-utf8-text", "Complete", pb.GenerateRequest(text="hi").SerializeToString().replace(b"hi", b"\xff\xfe")),
]


@pytest.mark.parametrize("case", UNDECODABLE, ids=[f"{c[0]}-{c[1]}" for c in UNDECODABLE])
def test_undecodable_grpc_request_is_invalid_argument(channel, case, caplog):
    _, method, payload = case
    call = (channel.unary_stream if method == "Generate" else channel.unary_unary)(f"/sarathi.v1.Generation/{method}")
    with pytest.raises(grpc.RpcError) as info:
        result = call(payload, timeout=30)
        list(result) if method == "Generate" else result
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "decode" in info.value.details()
    assert "ERROR" not in [r.levelname for r in caplog.records]


def test_servers_keep_serving_and_nothing_leaks(server, channel, http):
    stub = pb_grpc.GenerationStub(channel)
    assert len(stub.Complete(make_request([3, 4, 5], max_tokens=3, **greedy()), timeout=30).token_ids) == 3
    ok = http.post("/v1/completions", json={"prompt": [3, 4], "max_tokens": 2, "ignore_eos": True})
    assert ok.status_code == 200 and json.loads(ok.text)["usage"]["completion_tokens"] == 2
    assert all_blocks_free(stub) and server.num_active_requests == 0
