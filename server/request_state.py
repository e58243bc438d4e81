"""What the front ends and the request session share: a request between `admit` and `release`
(`ActiveRequest`) and the error a refused or failed request raises (`RequestError`). A leaf: it imports no
other module of the server, so both front ends and the session import it without a cycle."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import grpc


class RequestError(Exception):
    """A request refused or failed: the gRPC status code (the HTTP front end maps it to an HTTP status) and,
    for bad input, the request field at fault."""

    def __init__(self, code: grpc.StatusCode, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param


@dataclass
class ActiveRequest:
    """A request between `admit` and `release`: the front end reads its outputs with `next_output`."""

    request_id: str
    arrival_time: float
    num_prompt_tokens: int
    queue: asyncio.Queue
    pending: bool = True  # admitted, no output yet: what back-pressure counts
    tokens_seen: int = 0  # tokens already accounted for in the metrics
    first_timings_sent: bool = False
    queue_time_observed: bool = False
    finished: bool = False
