"""TLS (server/security.py) on a real server, with certificates made here (tls_test_utils.py): HTTPS with the
`openai` client, gRPC over TLS, /metrics over HTTPS, and mutual TLS (`ssl_ca_certs`: a client without a
certificate the CA signed is refused). Each test runs its own server over the shared engine."""

from __future__ import annotations

import io
import ssl
import sys

import grpc
import httpx2
import openai
import pytest

from grpc_test_utils import serving
from server import client
from server.proto.sarathi.v1 import generation_pb2 as pb
from server.proto.sarathi.v1 import generation_pb2_grpc as pb_grpc
from server.security import ClientSecurity, ServerSecurity, grpc_channel
from tls_test_utils import Pki, make_pki

KEY = "sk-tls-test"
REQUEST = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]), max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def _verify(pki: Pki, with_client_cert: bool = False) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=pki.ca_cert)
    if with_client_cert:
        context.load_cert_chain(pki.client_cert, pki.client_key)
    return context


def test_https_and_grpc_over_tls(llama_engine, pki, monkeypatch):
    security = ServerSecurity(api_key=KEY, ssl_keyfile=pki.server_key, ssl_certfile=pki.server_cert)
    with serving(llama_engine, http_port=0, metrics_port=0, security=security) as srv:
        with httpx2.Client(verify=_verify(pki), timeout=60) as http:
            api = openai.OpenAI(base_url=f"https://127.0.0.1:{srv.http_port}/v1", api_key=KEY, max_retries=0,
                                http_client=http)
            done = api.completions.create(model=srv.model_name, prompt=[1, 2, 3], max_tokens=3,
                                          extra_body={"ignore_eos": True})
            assert done.usage.completion_tokens == 3
            assert "sarathi:" in http.get(f"https://127.0.0.1:{srv.metrics_port}/metrics").text
        with pytest.raises(httpx2.HTTPError):  # plain HTTP on the TLS port
            httpx2.get(f"http://127.0.0.1:{srv.http_port}/health", timeout=10)
        tls = ClientSecurity(api_key=KEY, tls=True, ssl_ca_certs=pki.ca_cert)
        with grpc_channel(srv.target, tls) as channel:
            assert len(pb_grpc.GenerationStub(channel).Complete(REQUEST, timeout=60).token_ids) == 3
        with grpc.insecure_channel(srv.target) as channel:  # plaintext gRPC on the TLS port
            with pytest.raises(grpc.RpcError) as info:
                pb_grpc.GenerationStub(channel).Complete(REQUEST, timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        argv = ["--token-ids", "1,2,3", "--max-tokens", "3", "--ignore-eos", "--target", srv.target,
                "--api-key", KEY, "--tls", "--ssl-ca-certs", pki.ca_cert]
        monkeypatch.setattr(sys, "stderr", io.StringIO())  # not capsys: see test_security.py's `stderr_of`
        monkeypatch.setattr(sys, "stdout", io.StringIO())
        assert client.main(argv) == 0, sys.stderr.getvalue()
        assert "completion_tokens=3" in sys.stderr.getvalue()


def test_mutual_tls_refuses_a_client_without_a_certificate(llama_engine, pki):
    security = ServerSecurity(ssl_keyfile=pki.server_key, ssl_certfile=pki.server_cert, ssl_ca_certs=pki.ca_cert)
    with serving(llama_engine, http_port=0, metrics_port=0, security=security) as srv:
        for port in (srv.http_port, srv.metrics_port):
            with pytest.raises(httpx2.HTTPError):
                httpx2.get(f"https://127.0.0.1:{port}/health", verify=_verify(pki), timeout=10)
        ok = httpx2.post(f"https://127.0.0.1:{srv.http_port}/v1/completions", verify=_verify(pki, True), timeout=60,
                         json={"prompt": [1, 2, 3], "max_tokens": 3, "ignore_eos": True})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
        with grpc_channel(srv.target, ClientSecurity(tls=True, ssl_ca_certs=pki.ca_cert)) as channel:
            with pytest.raises(grpc.RpcError) as info:
                pb_grpc.GenerationStub(channel).Complete(REQUEST, timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        mine = ClientSecurity(tls=True, ssl_ca_certs=pki.ca_cert, ssl_certfile=pki.client_cert,
                              ssl_keyfile=pki.client_key)
        with grpc_channel(srv.target, mine) as channel:
            assert len(pb_grpc.GenerationStub(channel).Complete(REQUEST, timeout=60).token_ids) == 3


def test_load_driver_over_https_with_a_ca_file(llama_engine, pki):
    from sarathi_jax.bench.loadgen import run_load
    from sarathi_jax.request.sampling_params import SamplingParams

    security = ServerSecurity(api_key=KEY, ssl_keyfile=pki.server_key, ssl_certfile=pki.server_cert)
    requests = [(0.0, [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0))] * 2
    mine = ClientSecurity(api_key=KEY, tls=True, ssl_ca_certs=pki.ca_cert)
    with serving(llama_engine, http_port=0, security=security) as srv:
        for target in (srv.target, f"https://127.0.0.1:{srv.http_port}"):
            results = run_load(target, requests, request_timeout=60, security=mine)
            assert [(r.error, r.num_tokens) for r in results] == [(None, 3)] * 2, target
