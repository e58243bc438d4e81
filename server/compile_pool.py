"""`CompilePool`: where the servers compile requests' structured-outputs constraints.

llguidance compiles a constraint in up to about a second (docs/design/structured-outputs.md). On the event loop
that HTTP and gRPC share, that would hold every stream and /health meanwhile; here a few threads do it
(`DEFAULT_COMPILE_THREADS` at once, the rest queue), and the request session awaits the result after its cheap
checks (request id, back-pressure), so a refused request compiles nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc

from sarathi_jax.core.admission import Admission, AdmissionError, AdmittedRequest
from server.request_state import RequestError

DEFAULT_COMPILE_THREADS = 2

FieldNamer = Callable[[AdmissionError], AdmissionError]


def same_name(error: AdmissionError) -> AdmissionError:
    return error


class CompilePool:
    """`max_threads` compile threads; `with_grammar` awaits one request's compile."""

    def __init__(self, max_threads: int = DEFAULT_COMPILE_THREADS) -> None:
        self._pool = ThreadPoolExecutor(max_threads, thread_name_prefix="grammar-compile")

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
        """Compiles queued are dropped; one running finishes in its thread."""
        self._pool.shutdown(wait=False, cancel_futures=True)
