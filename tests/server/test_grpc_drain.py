"""Draining (the SIGTERM path): no new requests, in-flight streams complete, then the server exits.

In-process through `GenerationServer.drain()`, and end to end with `python -m server` (gRPC and HTTP) and a real
SIGTERM.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import grpc
import httpx2
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from grpc_test_utils import ENGINE_KW, wait_until
from server.client import finish_reason_name, make_request
from server.proto.sarathi.v1 import generation_pb2_grpc as pb_grpc
from server.service import GenerationServer

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _health(target: str) -> int:
    with grpc.insecure_channel(target) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def test_drain_lets_in_flight_streams_complete(llama_engine):
    engine, config = llama_engine
    server = GenerationServer(engine, engine_config=config, host="127.0.0.1", port=0).start_in_thread()
    target = server.target
    n_streams, max_tokens = 5, 40
    try:
        assert _health(target) == health_pb2.HealthCheckResponse.SERVING

        async def drive():
            async with grpc.aio.insecure_channel(target) as channel:
                stub = pb_grpc.GenerationStub(channel)
                calls = [stub.Generate(make_request([10 + i, 11, 12], max_tokens=max_tokens, temperature=0.0,
                                                    ignore_eos=True), timeout=60) for i in range(n_streams)]
                firsts = [await c.read() for c in calls]  # every stream is running
                server.pause_engine()  # hold them mid-generation while the drain starts
                loop = asyncio.get_running_loop()
                drain = loop.run_in_executor(None, lambda: server.drain(timeout=60))
                await loop.run_in_executor(None, lambda: wait_until(
                    lambda: _health(target) == health_pb2.HealthCheckResponse.NOT_SERVING, what="NOT_SERVING"))
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.Complete(make_request([1, 2, 3], max_tokens=2), timeout=10)
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
                assert not drain.done()  # still waiting for the in-flight streams
                server.resume_engine()
                results = []
                for first, call in zip(firsts, calls):
                    msgs = [first]
                    for _ in range(max_tokens + 1):  # read() only: mixing it with async-for is not allowed
                        msg = await call.read()
                        if msg is grpc.aio.EOF:
                            break
                        msgs.append(msg)
                    results.append(msgs)
                await asyncio.wait_for(drain, 60)
                return results

        results = asyncio.run(drive())
        for msgs in results:
            assert sum(len(m.token_ids) for m in msgs) == max_tokens
            assert msgs[-1].finished and finish_reason_name(msgs[-1].finish_reason) == "length"
        assert not server.worker.alive  # the engine thread ended with the server
        with pytest.raises(grpc.RpcError) as info, grpc.insecure_channel(target) as channel:
            pb_grpc.GenerationStub(channel).Complete(make_request([1, 2], max_tokens=2), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.resume_engine()
        server.stop(grace=0, timeout=30)


class _Records(logging.Handler):
    """The records of the server's loggers (uvicorn's do not propagate to the root) between `attach` and
    `detach`."""

    LOGGERS = ("uvicorn.error", "asyncio", "grpc", "")

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def attach(self) -> _Records:
        for name in self.LOGGERS:
            logging.getLogger(name).addHandler(self)
        return self

    def detach(self) -> None:
        for name in self.LOGGERS:
            logging.getLogger(name).removeHandler(self)

    def errors(self) -> list[str]:
        """The messages logged at ERROR or with a traceback."""
        return [r.getMessage() for r in self.records if r.levelno >= logging.ERROR or r.exc_info]


def test_after_the_drain_grace_every_request_ends_in_band(llama_engine):
    """Requests still running when the grace runs out: an HTTP stream ends with an SSE error event then
    `data: [DONE]` (not a cut connection), a non-streamed HTTP request gets a 503, a gRPC stream ends with a last
    message carrying FINISH_REASON_ABORT (not UNAVAILABLE), and Complete answers with it; nothing is logged as
    cancelled."""
    engine, config = llama_engine
    server = GenerationServer(engine, engine_config=config, host="127.0.0.1", port=0, http_port=0).start_in_thread()
    body = {"prompt": [5, 6, 7], "max_tokens": 50, "ignore_eos": True}
    logged = _Records().attach()
    try:
        server.pause_engine()  # nothing finishes: every request is still running when the grace ends
        with grpc.insecure_channel(server.target) as channel, concurrent.futures.ThreadPoolExecutor(1) as pool, \
                httpx2.Client(base_url=f"http://127.0.0.1:{server.http_port}", timeout=60) as http, \
                http.stream("POST", "/v1/completions", json={**body, "stream": True}) as http_stream:
            stub = pb_grpc.GenerationStub(channel)
            stream = stub.Generate(make_request([5, 6, 7], max_tokens=50, ignore_eos=True), timeout=60)
            complete = stub.Complete.future(make_request([5, 6, 8], max_tokens=50, ignore_eos=True), timeout=60)
            not_streamed = pool.submit(http.post, "/v1/completions", json=body)
            wait_until(lambda: server.num_active_requests == 4, what="four requests in flight")
            server.drain(grace=0.3, timeout=60)

            [last] = list(stream)  # no RpcError: the stream ends with a message
            assert last.finished and finish_reason_name(last.finish_reason) == "abort" and "drain grace" in last.error
            assert finish_reason_name(complete.result(timeout=30).finish_reason) == "abort"
            resp = not_streamed.result(timeout=30)
            assert resp.status_code == 503 and "drain grace" in resp.json()["error"]["message"]
            lines = [line for line in http_stream.iter_lines() if line.startswith("data: ")]
            assert lines[-1] == "data: [DONE]"
            assert "drain grace" in json.loads(lines[-2][6:])["error"]["message"]
        assert server.num_active_requests == 0 and not server.worker.alive
    finally:
        server.resume_engine()
        server.stop(grace=0, timeout=30)
        logged.detach()
    assert not logged.errors(), logged.errors()



def test_ending_the_drain_now_ends_every_request_in_band(llama_engine):
    """`end_drain` (the second signal's path) during a drain without a grace limit: the requests still running
    end in-band at once, as after the grace, and nothing is logged at ERROR or with a traceback."""
    engine, config = llama_engine
    server = GenerationServer(engine, engine_config=config, host="127.0.0.1", port=0, http_port=0).start_in_thread()
    logged = _Records().attach()
    try:
        server.pause_engine()  # nothing finishes by itself
        body = {"prompt": [5, 6, 7], "max_tokens": 50, "ignore_eos": True, "stream": True}
        with grpc.insecure_channel(server.target) as channel, concurrent.futures.ThreadPoolExecutor(1) as pool, \
                httpx2.Client(base_url=f"http://127.0.0.1:{server.http_port}", timeout=60) as http, \
                http.stream("POST", "/v1/completions", json=body) as http_stream:
            stream = pb_grpc.GenerationStub(channel).Generate(make_request([5, 6, 7], max_tokens=50, ignore_eos=True),
                                                              timeout=60)
            wait_until(lambda: server.num_active_requests == 2, what="two requests in flight")
            drain = pool.submit(server.drain, None, 60)  # no grace limit: it would wait for ever
            wait_until(lambda: server.draining, what="draining")
            assert not drain.done()
            server.end_drain(timeout=60)
            drain.result(timeout=30)
            [last] = list(stream)
            assert last.finished and finish_reason_name(last.finish_reason) == "abort"
            lines = [line for line in http_stream.iter_lines() if line.startswith("data: ")]
            assert lines[-1] == "data: [DONE]" and "error" in json.loads(lines[-2][6:])
        assert server.num_active_requests == 0 and not server.worker.alive
    finally:
        server.resume_engine()
        server.stop(grace=0, timeout=30)
        logged.detach()
    assert not logged.errors(), logged.errors()

LONG_MAX_TOKENS = 1000


def _launch(model_dir) -> tuple[subprocess.Popen, list[str], str, str]:
    """`python -m server` over the test checkpoint, gRPC and HTTP on free ports: (process, its output lines so far
    and to come, gRPC target, HTTP base URL), once both listen."""
    cmd = [sys.executable, "-m", "server", "--model", str(model_dir), "--host", "127.0.0.1", "--port", "0",
           "--metrics-port", "0", "--http-port", "0", "--token-budget", str(ENGINE_KW["token_budget"]),
           "--max-num-seqs", str(ENGINE_KW["max_num_seqs"]), "--num-blocks", str(ENGINE_KW["num_blocks"]),
           "--max-model-len", "1024", "--scheduler", "sarathi", "--dtype", "float32",
           "--attention-backend", "xla", "--log-level", "WARNING"]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            log.append(line)

    threading.Thread(target=read, daemon=True).start()
    target = url = None
    deadline = time.monotonic() + 120
    while (target is None or url is None) and time.monotonic() < deadline and proc.poll() is None:
        for line in list(log):
            if "listening on" in line:
                target = line.split("listening on", 1)[1].split()[0]
            if "HTTP API on" in line:
                url = line.split("HTTP API on", 1)[1].split()[0].removesuffix("/v1")
        time.sleep(0.1)
    if not (target and url):
        proc.kill()
        proc.wait(timeout=30)
        pytest.fail("server did not start:\n" + "".join(log))
    return proc, log, target, url


def test_sigterm_drains_then_exits(hf_checkpoint):
    """gRPC and the HTTP API (`--http-port`) drain together: both refuse new requests, both finish their stream."""
    proc, _, target, url = _launch(hf_checkpoint("llama"))
    try:
        assert _health(target) == health_pb2.HealthCheckResponse.SERVING

        body = {"prompt": [5, 6, 8], "max_tokens": LONG_MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
                "stream": True, "return_token_ids": True}
        with grpc.insecure_channel(target) as channel, httpx2.Client(base_url=url, timeout=120) as http, \
                http.stream("POST", "/v1/completions", json=body) as http_stream:
            assert http_stream.status_code == 200
            stub = pb_grpc.GenerationStub(channel)
            # Long enough (~1000 steps) to still be running while the checks below happen.
            call = stub.Generate(make_request([5, 6, 7], max_tokens=LONG_MAX_TOKENS, temperature=0.0,
                                              ignore_eos=True), timeout=120)
            tokens = list(next(call).token_ids)
            proc.send_signal(signal.SIGTERM)
            wait_until(lambda: _health(target) == health_pb2.HealthCheckResponse.NOT_SERVING, timeout=30,
                       what="NOT_SERVING after SIGTERM")
            with pytest.raises(grpc.RpcError) as info:  # no new requests while draining
                stub.Complete(make_request([1, 2], max_tokens=2), timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert http.get("/health").status_code == 503
            assert http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}).status_code == 503
            for msg in call:  # ... but the in-flight stream runs to the end
                tokens.extend(msg.token_ids)
                last = msg
            assert len(tokens) == LONG_MAX_TOKENS and last.finished
            assert finish_reason_name(last.finish_reason) == "length"
            chunks = [json.loads(line[6:]) for line in http_stream.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
            assert sum(len(c["choices"][0]["token_ids"]) for c in chunks) == LONG_MAX_TOKENS
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)



def test_a_second_sigterm_ends_streams_in_band_then_exits(hf_checkpoint):
    """A second SIGTERM during a drain (no grace limit) ends the running streams at once, in-band: the HTTP stream
    with an SSE error event then `data: [DONE]`, the gRPC stream with a last FINISH_REASON_ABORT message; nothing
    is logged at ERROR, no traceback, and the process exits 0."""
    proc, log, target, url = _launch(hf_checkpoint("llama"))
    try:
        body = {"prompt": [5, 6, 8], "max_tokens": LONG_MAX_TOKENS, "ignore_eos": True, "stream": True}
        with grpc.insecure_channel(target) as channel, httpx2.Client(base_url=url, timeout=120) as http, \
                http.stream("POST", "/v1/completions", json=body) as http_stream:
            lines = http_stream.iter_lines()
            assert http_stream.status_code == 200 and next(lines).startswith("data: ")
            call = pb_grpc.GenerationStub(channel).Generate(
                make_request([5, 6, 7], max_tokens=LONG_MAX_TOKENS, ignore_eos=True), timeout=120)
            next(call)
            proc.send_signal(signal.SIGTERM)
            wait_until(lambda: _health(target) == health_pb2.HealthCheckResponse.NOT_SERVING, timeout=30,
                       what="NOT_SERVING after SIGTERM")
            proc.send_signal(signal.SIGTERM)
            *_, last = call  # no RpcError: the stream ends with a message
            assert last.finished and finish_reason_name(last.finish_reason) == "abort" and last.error
            events = [line for line in lines if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]"
            assert json.loads(events[-2][6:])["error"]["code"] == "unavailable"
            assert len(events) < LONG_MAX_TOKENS  # ended early, not run to the end
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    output = "".join(log)
    assert "Traceback" not in output and " ERROR " not in output, output

def _server_cmd(*flags: str) -> list[str]:
    return [sys.executable, "-m", "server", "--model", "tiny-llama", "--host", "127.0.0.1", "--token-budget", "64",
            "--max-num-seqs", "16", "--max-model-len", "256", *flags]


def test_sigterm_during_start_up_exits_0():
    proc = subprocess.Popen(_server_cmd("--port", "0", "--log-level", "INFO"), cwd=REPO_ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stderr:  # the engine is being built: nothing is served yet
            if "building engine" in line:
                break
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


@pytest.mark.parametrize("clash", ["--port", "--http-port"])
def test_a_port_in_use_is_one_clear_error(clash):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        flags = ["--port", port] if clash == "--port" else ["--port", "0", "--http-port", port]
        result = subprocess.run(_server_cmd(*flags, "--log-level", "WARNING"), cwd=REPO_ROOT, capture_output=True,
                                text=True, timeout=300)
    assert result.returncode == 1
    assert "could not start" in result.stderr and f"127.0.0.1:{port}" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and "Event loop is closed" not in result.stderr, result.stderr
