"""The cost of structured-outputs constraints through both servers (on tests/conftest.py's `ascii_llama`):
constraints llguidance gives up on are refused at admission (HTTP 400 plain and streamed, gRPC INVALID_ARGUMENT);
a constraint that fails mid-generation (its mask budget spent) is the client's error on every path; a refused
request compiles nothing; compiles run off the event loop."""

from __future__ import annotations

import json
import threading
import time

import grpc
import httpx2 as httpx
import pytest

from grpc_test_utils import make_engine, serving, stub_for, wait_until
from sarathi_jax.request.structured_outputs import GrammarCompiler, MaskBudget, StructuredOutputs
from server.client import make_request
from server.proto.sarathi.v1 import generation_pb2 as pb

HOSTILE = {
    "choice of 2001": {"choice": [f"opt{i}" for i in range(2001)]},
    "2500 rules": {"grammar": "start: r0\n" + "\n".join(f'r{i}: "x{i}" | r{i + 1}' for i in range(2500))
                   + '\nr2500: "end"\n'},
    "no finite string": {"grammar": 'start: a\na: "x" a\n'},
    "nested repeats": {"regex": "((a{0,100}){0,100}){0,100}"},
}
LIMITS = "exceeds the grammar engine's limits"


@pytest.fixture(scope="module")
def server(ascii_llama):
    with serving(make_engine(ascii_llama), http_port=0) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=f"http://127.0.0.1:{server.http_port}", timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def stub(server):
    channel, stub = stub_for(server.target)
    yield stub
    channel.close()


@pytest.fixture
def compiler(server) -> GrammarCompiler:
    admission = server.engine.admission
    admission.grammar_matcher(StructuredOutputs.parse({"regex": "a"}))  # builds the engine's compiler
    return admission._grammar_compiler


def body(**extra) -> dict:
    return {"prompt": "hi", "max_tokens": 8, "temperature": 0.0, **extra}


@pytest.mark.parametrize("name", HOSTILE)
@pytest.mark.parametrize("stream", [False, True])
def test_hostile_constraints_are_400_naming_the_field(http, name: str, stream: bool) -> None:
    r = http.post("/v1/completions", json=body(stream=stream, structured_outputs=HOSTILE[name]))
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "structured_outputs" and LIMITS in err["message"], r.text
    guided = {"choice": "guided_choice", "grammar": "guided_grammar", "regex": "guided_regex"}
    kind, value = next(iter(HOSTILE[name].items()))
    r = http.post("/v1/completions", json=body(stream=stream, **{guided[kind]: value}))
    assert r.status_code == 400 and r.json()["error"]["param"] == guided[kind]


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_constraints_are_invalid_argument_on_grpc(stub, name: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        stub.Complete(make_request("hi", max_tokens=8, structured_outputs=json.dumps(HOSTILE[name])), timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "structured_outputs" in info.value.details() and LIMITS in info.value.details()


def test_a_constraint_past_its_mask_budget_is_the_clients_error(http, stub, compiler, monkeypatch) -> None:
    monkeypatch.setattr(compiler, "mask_budget", MaskBudget(base_s=0.0, per_token_s=0.0))  # the first mask is past it
    extra = {"guided_regex": "[a-z]{5}"}
    r = http.post("/v1/completions", json=body(**extra))
    err = r.json()["error"]
    assert r.status_code == 400 and err["type"] == "invalid_request_error" and err["param"] == "guided_regex"
    assert "structured_outputs: masks took" in err["message"] and "past the budget" in err["message"]
    with http.stream("POST", "/v1/completions", json=body(stream=True, **extra)) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert r.status_code == 200 and events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["code"] == "invalid_argument" and err["type"] == "invalid_request_error"
    assert err["param"] == "guided_regex" and "past the budget" in err["message"]
    resp = stub.Complete(make_request("hi", max_tokens=8, structured_outputs=json.dumps({"regex": "[a-z]{5}"})),
                         timeout=60)
    assert resp.finish_reason == pb.FINISH_REASON_ERROR and resp.error.startswith("structured_outputs: masks took")


def count_compiles(compiler: GrammarCompiler, monkeypatch) -> list:
    built: list = []
    monkeypatch.setattr(compiler, "_build", lambda *a, _b=compiler._build: built.append(a[0]) or _b(*a))
    return built


def test_a_refused_request_compiles_nothing(server, stub, compiler, monkeypatch, engine_resumed) -> None:
    built = count_compiles(compiler, monkeypatch)
    server.pause_engine()
    held = stub.Generate(make_request("hi", request_id="held", max_tokens=4), timeout=60)  # waits: engine paused
    wait_until(lambda: server.session.num_active_requests == 1, what="the held request admitted")
    fresh = {"regex": f"[a-z]{{{time.monotonic_ns() % 1000 + 7}}}"}  # compiled by nothing before
    with pytest.raises(grpc.RpcError) as info:
        stub.Complete(make_request("hi", request_id="held", max_tokens=4, structured_outputs=json.dumps(fresh)),
                      timeout=30)
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
    server.session.max_waiting_requests = 1
    with pytest.raises(grpc.RpcError) as info:
        stub.Complete(make_request("hi", max_tokens=4, structured_outputs=json.dumps(fresh)), timeout=30)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert built == []
    server.resume_engine()
    assert [r.finished for r in held][-1]


def test_the_event_loop_serves_while_a_constraint_compiles(server, http, compiler, monkeypatch) -> None:
    release, started = threading.Event(), threading.Event()
    real = compiler._build

    def slow_build(*args):
        started.set()
        release.wait(30)
        return real(*args)

    monkeypatch.setattr(compiler, "_build", slow_build)
    result: dict = {}
    fresh = {"regex": f"[a-z]{{{time.monotonic_ns() % 1000 + 1100}}}"}

    def constrained() -> None:
        result["r"] = http.post("/v1/completions", json=body(guided_regex=fresh["regex"]))

    worker = threading.Thread(target=constrained)
    worker.start()
    try:
        assert started.wait(30)
        t0 = time.monotonic()
        assert http.get("/health").status_code == 200
        plain = http.post("/v1/completions", json=body())  # a whole request, start to finish
        assert plain.status_code == 200 and time.monotonic() - t0 < 20
        assert worker.is_alive() and server.session.num_active_requests == 1  # still compiling
    finally:
        release.set()
        worker.join(60)
    assert result["r"].status_code == 200, result["r"].text
