"""What bounds one HTTP client's cost to the server: a body-size limit (413) and a deadline on reading a request's
head, which uvicorn lacks (its keep-alive timeout only runs between requests, and any byte cancels it: a client
sending a head a byte at a time holds its connection forever). Used by server/http_api.py; starlette and uvicorn
load only when HTTP is served (`HttpLimits` is plain configuration)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from starlette.exceptions import HTTPException
    from starlette.types import ASGIApp, Message, Receive, Scope, Send
    from uvicorn.protocols.http.h11_impl import H11Protocol

DEFAULT_MAX_BODY_BYTES = 4 << 20  # as gRPC's default largest request message
DEFAULT_HEADER_TIMEOUT_S = 10.0
MAX_HEADER_BYTES = 16 << 10  # h11's own default for an incomplete head, made explicit


@dataclass(frozen=True)
class HttpLimits:
    """max_body_bytes: a larger request body gets 413. header_timeout_s: a connection whose next request head is
    not complete this long after the connection opened (or its previous response ended) is closed.
    max_header_bytes: a larger head gets uvicorn's 400."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    max_header_bytes: int = MAX_HEADER_BYTES


class BodySizeLimit:
    """ASGI middleware: a body over `max_bytes` (as declared in Content-Length, or as received when chunked)
    raises HTTPException(413) where the app reads it, which the app's handler answers in OpenAI's shape."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            if declared.isdigit() and int(declared) > self.max_bytes:
                raise self._too_large(int(declared))
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise self._too_large(received)
            return message

        await self.app(scope, limited_receive, send)

    def _too_large(self, size: int) -> HTTPException:
        from starlette.exceptions import HTTPException

        return HTTPException(413, f"the request body ({size} bytes) exceeds the limit of {self.max_bytes} bytes "
                                  "(--max-body-bytes)")


def h11_protocol_with_header_timeout(header_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection whose request head takes longer than `header_timeout_s`."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class H11WithHeaderTimeout(H11Protocol):
        _head_deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_head_deadline()

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not None and not self.cycle.response_complete:  # a head arrived whole
                self._disarm_head_deadline()

        def on_response_complete(self) -> None:
            super().on_response_complete()  # may start a pipelined request's cycle
            if self.cycle is None or self.cycle.response_complete:
                self._arm_head_deadline()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_head_deadline()
            super().connection_lost(exc)

        def _arm_head_deadline(self) -> None:
            self._disarm_head_deadline()
            self._head_deadline = self.loop.call_later(header_timeout_s, self._head_too_slow)

        def _disarm_head_deadline(self) -> None:
            if self._head_deadline is not None:
                self._head_deadline.cancel()
                self._head_deadline = None

        def _head_too_slow(self) -> None:
            self._head_deadline = None
            if not self.transport.is_closing():
                self.transport.close()

    return H11WithHeaderTimeout
