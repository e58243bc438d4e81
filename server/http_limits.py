"""What bounds one HTTP client's cost to the server: a body-size limit (413), deadlines on reading a request's
head and body, a cap on open connections, and how long a closing connection reads away a body still arriving.
Plain configuration (the server's flags build it without loading starlette or uvicorn); server/http_api.py and
server/http_connection.py enforce it."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_BODY_BYTES = 4 << 20  # as gRPC's default largest request message
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 30.0
DEFAULT_MAX_CONNECTIONS = 4096  # below common open-file limits (`ulimit -n`), which must leave room for it
DEFAULT_LINGER_S = 5.0  # nginx's lingering_timeout
MAX_HEADER_BYTES = 16 << 10  # h11's own default for an incomplete head, made explicit


@dataclass(frozen=True)
class HttpLimits:
    """max_body_bytes: a larger request body gets 413. header_timeout_s: a connection whose next request head is
    not complete this long after the connection opened (or its previous response ended) is closed.
    body_timeout_s: a request body not complete this long after its head gets 408 (when no response has
    started) and its connection is closed. max_connections: a connection opened while this many are open gets
    503 at once and is closed. linger_s: the longest a connection closed while its client is still sending a
    body reads and discards it, so that the client gets the response rather than a reset.
    max_header_bytes: a larger head gets uvicorn's 400."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    linger_s: float = DEFAULT_LINGER_S
    max_header_bytes: int = MAX_HEADER_BYTES
