"""The API key (server/security.py) on a real server: every generation route and RPC, reflection included, needs
`Bearer KEY` (401 in OpenAI's shape / UNAUTHENTICATED otherwise); health checking and /metrics stay open; the
clients (`python -m server.client`, the load driver) send the key. TLS is test_tls.py's."""

from __future__ import annotations

import io
import logging
import sys

import grpc
import httpx2
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from grpc_test_utils import all_blocks_free, serving, wait_until
from sarathi_jax.request.sampling_params import SamplingParams
from server import client
from server.proto.sarathi.v1 import generation_pb2 as pb
from server.proto.sarathi.v1 import generation_pb2_grpc as pb_grpc
from server.security import ClientSecurity, ServerSecurity, grpc_channel

KEY = "sk-test-0123456789"
HTTP_ROUTES = [("POST", "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2}),
               ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
               ("GET", "/v1/models", None)]
REQUEST = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]), max_tokens=3, ignore_eos=True)
RPCS = {"Generate": lambda stub, md: list(stub.Generate(REQUEST, metadata=md, timeout=30)),
        "Complete": lambda stub, md: stub.Complete(REQUEST, metadata=md, timeout=30),
        "GetModelInfo": lambda stub, md: stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=md, timeout=30),
        "GetStats": lambda stub, md: stub.GetStats(pb.GetStatsRequest(), metadata=md, timeout=30)}
WRONG = [None, "Bearer wrong-key", f"Basic {KEY}", f"Bearer {KEY}x"]


@pytest.fixture(scope="module")
def server(llama_engine):
    with serving(llama_engine, "{% for m in messages %}{{ m.content }}{% endfor %}", http_port=0, metrics_port=0,
                 security=ServerSecurity(api_key=KEY)) as srv:
        yield srv


@pytest.fixture(scope="module")
def base_url(server):
    return f"http://127.0.0.1:{server.http_port}"


def _auth(value: str | None) -> dict[str, str]:
    return {} if value is None else {"Authorization": value}


@pytest.mark.parametrize("method, path, body", HTTP_ROUTES, ids=[p for _, p, _ in HTTP_ROUTES])
@pytest.mark.parametrize("authorization", WRONG, ids=["missing", "wrong", "basic", "longer"])
def test_http_generation_routes_refuse_a_missing_or_wrong_key(server, base_url, method, path, body, authorization):
    resp = httpx2.request(method, base_url + path, json=body, headers=_auth(authorization), timeout=30)
    assert resp.status_code == 401, resp.text
    assert resp.headers["www-authenticate"] == "Bearer"
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
    assert KEY not in resp.text


def test_http_with_the_key_serves_a_completion_and_a_stream(server, base_url):
    api = openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0, timeout=60)
    [model] = api.models.list().data
    done = api.completions.create(model=model.id, prompt="hello", max_tokens=3, extra_body={"ignore_eos": True})
    assert done.usage.completion_tokens == 3
    chunks = list(api.chat.completions.create(model=model.id, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=3, stream=True, extra_body={"ignore_eos": True}))
    assert chunks and chunks[-1].choices[0].finish_reason == "length"
    # The scheme is case-insensitive (RFC 9110).
    assert httpx2.get(f"{base_url}/v1/models", headers=_auth(f"bearer {KEY}"), timeout=30).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{base_url}/v1", api_key="wrong", max_retries=0, timeout=60).models.list()


def test_health_and_metrics_stay_open(server, base_url):
    assert httpx2.get(f"{base_url}/health", timeout=30).status_code == 200
    assert "sarathi:" in httpx2.get(f"{base_url}/metrics", timeout=30).text
    assert "sarathi:" in httpx2.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=30).text
    with grpc.insecure_channel(server.target) as channel:
        resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("rpc", sorted(RPCS))
@pytest.mark.parametrize("authorization", WRONG, ids=["missing", "wrong", "basic", "longer"])
def test_every_generation_rpc_refuses_a_missing_or_wrong_key(server, rpc, authorization):
    metadata = () if authorization is None else (("authorization", authorization),)
    with grpc.insecure_channel(server.target) as channel:
        with pytest.raises(grpc.RpcError) as info:
            RPCS[rpc](pb_grpc.GenerationStub(channel), metadata)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, info.value
    assert KEY not in info.value.details()
    wait_until(lambda: server.session.num_active_requests == 0, what="nothing admitted")


def _list_services(channel: grpc.Channel, metadata=()) -> set[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    (resp,) = list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                             metadata=metadata, timeout=10))
    return {s.name for s in resp.list_services_response.service}


def test_reflection_needs_the_key(server):
    with grpc.insecure_channel(server.target) as channel:
        for metadata in ((), (("authorization", "Bearer wrong"),)):
            with pytest.raises(grpc.RpcError) as info:
                _list_services(channel, metadata)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with grpc_channel(server.target, ClientSecurity(api_key=KEY)) as channel:
        assert "sarathi.v1.Generation" in _list_services(channel)


def test_every_generation_rpc_serves_with_the_key(server):
    with grpc_channel(server.target, ClientSecurity(api_key=KEY)) as channel:
        stub = pb_grpc.GenerationStub(channel)
        assert RPCS["Generate"](stub, ())[-1].finished
        assert len(RPCS["Complete"](stub, ()).token_ids) == 3
        assert RPCS["GetModelInfo"](stub, ()).max_model_len > 0
        wait_until(lambda: all_blocks_free(stub), what="every KV block free")


def stderr_of(main, argv, monkeypatch) -> tuple[int, str]:
    """(exit status, stderr) of a command's `main`. Not capsys: the session's engine, built while a test's
    capsys is active, would keep writing its progress bars to that test's closed capture."""
    err = io.StringIO()
    with monkeypatch.context() as m:
        m.setattr(sys, "stderr", err)
        m.setattr(sys, "stdout", io.StringIO())
        return main(argv), err.getvalue()


def test_client_cli_sends_the_key_from_its_flag_or_the_environment(server, monkeypatch):
    argv = ["--token-ids", "1,2,3", "--max-tokens", "3", "--ignore-eos", "--target", server.target]
    monkeypatch.delenv("SARATHI_API_KEY", raising=False)
    rc, err = stderr_of(client.main, argv, monkeypatch)
    assert rc == 1 and "UNAUTHENTICATED" in err
    rc, err = stderr_of(client.main, [*argv, "--api-key", KEY], monkeypatch)
    assert rc == 0 and "finish_reason=length" in err
    monkeypatch.setenv("SARATHI_API_KEY", KEY)
    rc, err = stderr_of(client.main, argv, monkeypatch)
    assert rc == 0 and "completion_tokens=3" in err


@pytest.mark.parametrize("route", ["grpc", "http"])
def test_load_driver_sends_the_key(server, base_url, route):
    from sarathi_jax.bench.loadgen import run_load

    target = server.target if route == "grpc" else base_url
    requests = [(0.0, [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0))] * 2
    keyed = run_load(target, requests, request_timeout=60, security=ClientSecurity(api_key=KEY))
    assert [(r.error, r.num_tokens) for r in keyed] == [(None, 3)] * 2
    refused = run_load(target, requests, request_timeout=60)
    assert all(r.error and r.error.startswith(("UNAUTHENTICATED:", "HTTP 401:")) for r in refused), refused


def test_load_driver_command_takes_the_key(server, tmp_path, monkeypatch):
    import json

    import numpy as np

    from sarathi_jax.bench.endpoint import bench_job
    from sarathi_jax.bench.loadgen import main
    from sarathi_jax.bench.workload import Workload

    monkeypatch.delenv("SARATHI_API_KEY", raising=False)
    job, result = tmp_path / "job.json", tmp_path / "result.json"
    workload = Workload(np.zeros(2), np.full(2, 3), np.full(2, 2))
    job.write_text(json.dumps(bench_job(server.target, workload, [[1, 2, 3]] * 2, 0.0)))
    assert main(["--bench-job", str(job), "--bench-result", str(result)]) == 1  # no key: refused
    assert main(["--bench-job", str(job), "--bench-result", str(result), "--api-key", KEY]) == 0
    assert [r["num_output_tokens"] for r in json.loads(result.read_text())["records"]] == [2, 2]


def test_security_settings_never_show_the_key():
    assert KEY not in repr(ServerSecurity(api_key=KEY)) and KEY not in repr(ClientSecurity(api_key=KEY))
    with pytest.raises(ValueError, match="--ssl-keyfile and --ssl-certfile"):
        ServerSecurity(ssl_certfile="cert.pem")
    with pytest.raises(ValueError, match="--ssl-ca-certs needs"):
        ServerSecurity(ssl_ca_certs="ca.pem")


@pytest.mark.parametrize("host, warned", [("0.0.0.0", True), ("127.0.0.1", False), ("::1", False)])
def test_warns_when_serving_beyond_loopback_without_a_key(llama_engine, caplog, host, warned):
    from server.service import GenerationServer

    engine, config = llama_engine
    for security, expected in ((ServerSecurity(), warned), (ServerSecurity(api_key=KEY), False)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="server.service"):
            GenerationServer(engine, engine_config=config, host=host, port=0, security=security)._warn_if_open()
        assert any("without an API key" in r.message for r in caplog.records) == expected, (host, security)
