"""What bounds a slow or greedy HTTP client at the connection level (server/http_connection.py): a deadline on the
request body (408, then closed), a cap on open connections (503 at once), and a 413 the client reads although it
is still sending (lingering close, not a reset). One server over the shared engine, with small limits; the
clients are raw sockets, so that nothing but the test decides what is sent and when."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx2
import pytest

from grpc_test_utils import serving
from server.http_limits import HttpLimits

MAX_BODY_BYTES = 64 << 10
BODY_TIMEOUT_S = 1.0
MAX_CONNECTIONS = 6
LIMITS = HttpLimits(max_body_bytes=MAX_BODY_BYTES, header_timeout_s=30.0, body_timeout_s=BODY_TIMEOUT_S,
                    max_connections=MAX_CONNECTIONS)


@pytest.fixture(scope="module")
def server(llama_engine):
    with serving(llama_engine, http_port=0, http_limits=LIMITS) as srv:
        yield srv


def _connect(server, timeout: float = 30.0) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.http_port), timeout=timeout)


def _head(method: str, path: str, length: int | None = None, extra: str = "") -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: x", "Content-Type: application/json"]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n" + extra + "\r\n").encode()


def _read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One response (status, lower-cased headers, body by Content-Length), read from a raw socket."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before a response head: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in header_lines)}
    while len(body) < int(headers["content-length"]):
        chunk = sock.recv(65536)
        assert chunk, "closed inside the response body"
        body += chunk
    return int(status_line.split()[1]), headers, body


def _until_closed(sock: socket.socket) -> bytes:
    rest = b""
    while chunk := sock.recv(65536):
        rest += chunk
    return rest


def _openai_error(body: bytes, code: str) -> dict:
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code, err
    return err


def _get_health(sock: socket.socket) -> int:
    sock.sendall(_head("GET", "/health"))
    return _read_response(sock)[0]


def test_a_slow_body_gets_a_408_within_the_deadline_while_others_are_served(server):
    sent = threading.Event()
    with _connect(server) as slow:
        slow.sendall(_head("POST", "/v1/completions", length=1000) + b"{")
        start = time.monotonic()

        def dribble() -> None:  # a byte every 0.2 s, until the server closes
            try:
                while not sent.wait(0.2):
                    slow.sendall(b" ")
            except OSError:
                pass

        threading.Thread(target=dribble, daemon=True).start()
        try:
            with httpx2.Client(base_url=f"http://127.0.0.1:{server.http_port}", timeout=30) as http:
                resp = http.post("/v1/completions", json={"prompt": [3, 4], "max_tokens": 2, "ignore_eos": True})
            assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 2
            status, headers, body = _read_response(slow)
            assert status == 408 and headers["connection"] == "close"
            assert "--body-timeout" in _openai_error(body, "request_timeout")["message"]
            assert time.monotonic() - start < BODY_TIMEOUT_S + 1.0
            slow.settimeout(BODY_TIMEOUT_S + 5)
            assert _until_closed(slow) == b""  # closed by the server (after reading away the dribble)
        finally:
            sent.set()
    assert server.num_active_requests == 0


def test_a_request_within_the_body_deadline_is_served(server):
    """The deadline is on the body's arrival: a body sent in two parts well within it is a normal request."""
    body = json.dumps({"prompt": [3, 4], "max_tokens": 2, "ignore_eos": True}).encode()
    with _connect(server) as sock:
        sock.sendall(_head("POST", "/v1/completions", length=len(body)) + body[:5])
        time.sleep(BODY_TIMEOUT_S / 4)
        sock.sendall(body[5:])
        status, _, answer = _read_response(sock)
        assert status == 200 and json.loads(answer)["usage"]["completion_tokens"] == 2
        time.sleep(BODY_TIMEOUT_S * 1.5)  # the body deadline is disarmed with the body: the connection stays open
        assert _get_health(sock) == 200


def test_connections_beyond_the_cap_get_a_503_while_open_ones_are_served(server):
    opened = []
    try:
        for _ in range(MAX_CONNECTIONS):
            sock = _connect(server)
            opened.append(sock)
            assert _get_health(sock) == 200  # served, and kept open (keep-alive)
        with _connect(server) as refused:  # answered without reading a request
            status, headers, body = _read_response(refused)
            assert status == 503 and headers["connection"] == "close"
            assert "--max-connections" in _openai_error(body, "service_unavailable")["message"]
            assert _until_closed(refused) == b""
        assert all(_get_health(sock) == 200 for sock in opened)  # the open ones are still served
        opened.pop().close()

        def served_again() -> bool:  # the server sees the close soon after: a new connection is served
            with _connect(server) as sock:
                try:
                    return _get_health(sock) == 200
                except (AssertionError, OSError):
                    return False

        deadline = time.monotonic() + 10
        while not served_again():
            assert time.monotonic() < deadline, "a freed connection slot was not reused"
            time.sleep(0.05)
    finally:
        for sock in opened:
            sock.close()


@pytest.mark.parametrize("connection", ["keep-alive", "close"])
def test_a_large_body_sent_at_full_speed_reads_its_413(server, connection):
    size = 30_000_000
    with _connect(server) as sock:
        sock.sendall(_head("POST", "/v1/completions", length=size, extra=f"Connection: {connection}\r\n"))
        sock.sendall(b" " * size)  # all of it, as a client that reads only once it has sent does: no reset
        status, headers, body = _read_response(sock)
        assert status == 413 and headers["connection"] == "close"
        assert "--max-body-bytes" in _openai_error(body, "request_entity_too_large")["message"]
        assert _until_closed(sock) == b""


def test_a_chunked_body_over_the_limit_reads_its_413(server):
    chunk = b" " * 1_000_000
    with _connect(server) as sock:
        sock.sendall(_head("POST", "/v1/completions", extra="Transfer-Encoding: chunked\r\n"))
        for _ in range(30):
            sock.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
        sock.sendall(b"0\r\n\r\n")
        status, _, body = _read_response(sock)
        assert status == 413
        _openai_error(body, "request_entity_too_large")
    assert server.num_active_requests == 0
