"""The HTTP server's connection-level limits, as a subclass of uvicorn's h11 protocol (one instance per connection):
a deadline on each request head and on each request body, a cap on open connections, and a lingering close.

uvicorn has none of these: its keep-alive timeout only runs between requests and any byte cancels it (a client
sending a head or a body a byte at a time holds its connection forever), and its `limit_concurrency` answers 503
per request but leaves idle connections open. A connection is closed while its client may still be sending a
body (a 413, a 408); closing a socket with unread data makes the kernel send a reset, which the client may see
before the response. So such a close half-closes (FIN after the response), reads and discards what still
arrives, and closes once the client is done, quiet for `LINGER_IDLE_S`, or `HttpLimits.linger_s` has passed
(nginx's lingering close).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from server.http_limits import HttpLimits

LINGER_IDLE_S = 1.0  # a lingering close ends once the client has sent nothing for this long


def _raw_response(status: int, reason: str, message: str, code: str) -> tuple[h11.Response, bytes]:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error" if status < 500 else
                                 "service_unavailable_error", "param": None, "code": code}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"connection", b"close")]
    return h11.Response(status_code=status, reason=reason.encode(), headers=headers), body


class _LingeringTransport:
    """The connection's transport as uvicorn sees it: `close()` goes through the protocol's lingering close, and
    a lingering connection reads as closing (uvicorn then starts nothing more on it)."""

    def __init__(self, transport: asyncio.Transport, protocol: LimitedH11Protocol) -> None:
        self._transport = transport
        self._protocol = protocol

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def close(self) -> None:
        self._protocol.close_lingering()

    def is_closing(self) -> bool:
        return self._protocol.lingering or self._transport.is_closing()


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol under `limits` (set by `h11_protocol_with_limits`)."""

    limits: HttpLimits = HttpLimits()
    _deadline: asyncio.TimerHandle | None = None
    _deadline_for: str | None = None  # "head" or "body"
    lingering = False
    _linger_end = 0.0
    _last_data = 0.0
    _real_transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._real_transport = transport
        super().connection_made(_LingeringTransport(transport, self))  # type: ignore[arg-type]
        if len(self.connections) > self.limits.max_connections:  # refused before anything is read
            event, body = _raw_response(503, "Service Unavailable", "too many open connections "
                                        f"(--max-connections {self.limits.max_connections}); retry later",
                                        "service_unavailable")
            transport.write(b"HTTP/1.1 503 Service Unavailable\r\n" + b"".join(
                name + b": " + value + b"\r\n" for name, value in event.headers) + b"\r\n" + body)
            transport.close()
            return
        self._arm("head")

    def data_received(self, data: bytes) -> None:
        if self.lingering:  # discarded: the response is sent, the connection is closing
            self._last_data = self.loop.time()
            return
        super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()
        if self.lingering or self._real_transport is None or self._real_transport.is_closing():
            return
        if self.conn.their_state is h11.SEND_BODY:
            if self._deadline_for != "body":  # the head arrived whole: the body's turn
                self._arm("body")
        elif self.cycle is not None and not self.cycle.response_complete:
            self._disarm()  # the request arrived whole: the app has it
        elif self._deadline_for != "head":  # the body of a request already answered arrived: the next head's turn
            self._arm("head")

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start a pipelined request's cycle
        if self.lingering or self._real_transport is None or self._real_transport.is_closing():
            return
        if (self.cycle is None or self.cycle.response_complete) and self.conn.their_state is not h11.SEND_BODY:
            self._arm("head")

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self.lingering = False
        super().connection_lost(exc)

    def shutdown(self) -> None:
        """The server stops: a lingering connection closes now (uvicorn waits for every connection to close)."""
        if self.lingering and self._real_transport is not None:
            self._disarm()
            self._real_transport.close()
            return
        super().shutdown()

    def close_lingering(self) -> None:
        """Close; while the client is still sending a body, half-close and read it away first (bounded)."""
        real = self._real_transport
        assert real is not None
        if self.lingering or real.is_closing():
            return
        self._disarm()
        if self.conn.their_state is not h11.SEND_BODY:
            real.close()
            return
        self.lingering = True
        if real.can_write_eof():
            real.write_eof()  # the client reads the response, then end of stream
        real.resume_reading()
        now = self.loop.time()
        self._linger_end, self._last_data = now + self.limits.linger_s, now
        self._deadline = self.loop.call_later(min(LINGER_IDLE_S, self.limits.linger_s), self._linger_check)

    def _linger_check(self) -> None:
        now = self.loop.time()
        until = min(self._linger_end, self._last_data + LINGER_IDLE_S)
        if now < until:
            self._deadline = self.loop.call_later(until - now, self._linger_check)
            return
        self._deadline = None
        assert self._real_transport is not None
        self._real_transport.close()

    def _arm(self, what: str) -> None:
        self._disarm()
        timeout = self.limits.header_timeout_s if what == "head" else self.limits.body_timeout_s
        self._deadline_for = what
        self._deadline = self.loop.call_later(timeout, self._head_too_slow if what == "head" else self._body_too_slow)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline, self._deadline_for = None, None

    def _head_too_slow(self) -> None:
        self._deadline, self._deadline_for = None, None
        self.transport.close()

    def _body_too_slow(self) -> None:
        """408 when no response has started (the app, waiting for the body, then reads a disconnect), then close."""
        self._deadline, self._deadline_for = None, None
        cycle = self.cycle
        if cycle is not None and not cycle.response_started and self.conn.our_state is h11.SEND_RESPONSE:
            event, body = _raw_response(408, "Request Timeout", "the request body did not arrive whole within "
                                        f"{self.limits.body_timeout_s:g} s (--body-timeout)", "request_timeout")
            self.transport.write(self.conn.send(event) + self.conn.send(h11.Data(data=body)) +
                                 self.conn.send(h11.EndOfMessage()))
            cycle.response_started = cycle.response_complete = cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()


def h11_protocol_with_limits(limits: HttpLimits) -> type[LimitedH11Protocol]:
    """uvicorn's h11 protocol under `limits`: the class uvicorn's `http=` option takes."""
    return type("LimitedH11Protocol", (LimitedH11Protocol,), {"limits": limits})
