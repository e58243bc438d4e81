"""`CompilePool`: where the servers compile requests' structured-outputs constraints.

llguidance compiles a constraint in up to about a second (docs/design/structured-outputs.md). On the event loop
that HTTP and gRPC share, that would hold every stream and /health meanwhile; here a few threads do it
(`DEFAULT_COMPILE_THREADS` at once, the rest queue), and the request session awaits the result after its cheap
checks (request id, back-pressure), so a refused request compiles nothing. Those checks' admission call (`check`:
tokenisation, chat rendering, a constraint's validation, up to about 0.1 s for a 64 KB schema) runs in threads of
its own (`DEFAULT_CHECK_THREADS`), so no request waits behind another's compile.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar
from concurrent.futures import ThreadPoolExecutor

import grpc

from sarathi_jax.core.admission import Admission, AdmissionError, AdmittedRequest
from server.request_state import RequestError

DEFAULT_COMPILE_THREADS = 2
DEFAULT_CHECK_THREADS = 4

FieldNamer = Callable[[AdmissionError], AdmissionError]
T = TypeVar("T")


def same_name(error: AdmissionError) -> AdmissionError:
    return error


class CompilePool:
    """`max_threads` compile threads; `with_grammar` awaits one request's compile, `check` one admission call."""

    def __init__(self, max_threads: int = DEFAULT_COMPILE_THREADS, check_threads: int = DEFAULT_CHECK_THREADS) -> None:
        self._pool = ThreadPoolExecutor(max_threads, thread_name_prefix="grammar-compile")
        self._checks = ThreadPoolExecutor(check_threads, thread_name_prefix="admission")

    async def check(self, build: Callable[[Admission], T], admission: Admission) -> T:
        """`build(admission)` in an admission thread (its exceptions raised here)."""
        return await asyncio.wrap_future(self._checks.submit(build, admission))

    async def with_grammar(self, admission: Admission, admitted: AdmittedRequest,
                           name: FieldNamer = same_name) -> AdmittedRequest:
        """`admission.with_grammar(admitted)` in a compile thread; a refused constraint is RequestError
        INVALID_ARGUMENT naming the field `name` gives it (the HTTP body's own field). Without a constraint to
        compile, `admitted` as it is, on the loop."""
        if admitted.params.structured_outputs is None or admitted.grammar is not None:
            return admitted
        try:
            return await asyncio.wrap_future(self._pool.submit(admission.with_grammar, admitted))
        except AdmissionError as exc:
            named = name(exc)
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(named), named.param) from None

    def close(self) -> None:
        """Compiles and checks queued are dropped; those running finish in their threads."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._checks.shutdown(wait=False, cancel_futures=True)
