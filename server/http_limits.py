"""What bounds one HTTP client's cost to the server: a body-size limit (413) and a deadline on reading a request's
head. Plain configuration (the server's flags build it without loading starlette or uvicorn); server/http_api.py
enforces it."""

from __future__ import annotations

from dataclasses import dataclass

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
