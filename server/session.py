"""`RequestSession`: what both front ends (server/grpc_service.py, server/http_api.py) talk to.

One admission path, one back-pressure rule, one set of metrics: a front end calls `admit`, reads the outputs
with `next_output` and calls `release` when it is done. Each request gets an asyncio queue; the engine thread
(`EngineWorker`) pushes the request's outputs into it with `loop.call_soon_threadsafe`. A request whose RPC or
HTTP request ends early is aborted in the engine from `release`, which frees its KV blocks before the engine's
next iteration. The server's lifecycle (start, drain, stop) is `GenerationServer`'s, in server/service.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

import grpc

from sarathi_jax.admission import Admission, AdmissionError, AdmittedRequest
from sarathi_jax.outputs import RequestOutput
from server.engine_worker import EngineError, EngineWorker, ServingEngine
from server.metrics import ServerMetrics
from server.request_state import ActiveRequest, RequestError

log = logging.getLogger(__name__)

DEFAULT_MAX_WAITING_REQUESTS = 1024
DEFAULT_MAX_WAITING_PROMPT_TOKENS = 1 << 20


class RequestSession:
    """The requests in flight over one `EngineWorker` thread, on one asyncio loop (`bind`).

    Back-pressure: a request is refused with RESOURCE_EXHAUSTED when admitting it would leave more than
    `max_waiting_requests` requests, or more than `max_waiting_prompt_tokens` prompt tokens, waiting, where
    waiting means admitted but without its first output yet. A lone request is always admitted whatever its
    prompt length (the engine bounds that with max_model_len). Once `stop_admitting` is called every new
    request is refused with UNAVAILABLE.
    """

    def __init__(self, engine: ServingEngine, engine_config: Any, model_name: str, worker: EngineWorker,
                 metrics: ServerMetrics, *, max_waiting_requests: int | None = DEFAULT_MAX_WAITING_REQUESTS,
                 max_waiting_prompt_tokens: int | None = DEFAULT_MAX_WAITING_PROMPT_TOKENS) -> None:
        self.engine = engine
        self.engine_config = engine_config
        self.model_name = model_name
        self.worker = worker
        self.metrics = metrics
        self.max_waiting_requests = max_waiting_requests
        self.max_waiting_prompt_tokens = max_waiting_prompt_tokens
        self._active: dict[str, ActiveRequest] = {}
        self._pending_requests = 0
        self._pending_tokens = 0
        self._draining = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._idle: asyncio.Event | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Serve on `loop` (the running one: the idle event belongs to it)."""
        self._loop = loop
        self._idle = asyncio.Event()
        self._idle.set()

    def stop_admitting(self) -> None:
        self._draining = True

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def num_active_requests(self) -> int:
        return len(self._active)

    async def wait_until_idle(self) -> None:
        """Until no request is in flight."""
        assert self._idle is not None, "session not bound to a loop"
        await self._idle.wait()

    def _request_id(self, request_id: str | None) -> str:
        if request_id is None:
            return uuid.uuid4().hex
        if not request_id:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "request_id: must not be empty when set", "request_id")
        if request_id in self._active:
            raise RequestError(grpc.StatusCode.ALREADY_EXISTS, f"request_id: {request_id!r} is already in flight",
                               "request_id")
        return request_id

    def _check_capacity(self, num_tokens: int) -> None:
        if self._pending_requests == 0:
            return
        if self.max_waiting_requests is not None and self._pending_requests + 1 > self.max_waiting_requests:
            self.metrics.request_rejected("waiting_requests")
            raise RequestError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"server overloaded: {self._pending_requests} requests waiting "
                f"(limit max_waiting_requests={self.max_waiting_requests}); retry later")
        if (self.max_waiting_prompt_tokens is not None
                and self._pending_tokens + num_tokens > self.max_waiting_prompt_tokens):
            self.metrics.request_rejected("waiting_prompt_tokens")
            raise RequestError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"server overloaded: {self._pending_tokens} prompt tokens waiting, this request adds {num_tokens} "
                f"(limit max_waiting_prompt_tokens={self.max_waiting_prompt_tokens}); retry later")

    def admit(self, build: Callable[[Admission], AdmittedRequest], request_id: str | None = None) -> ActiveRequest:
        """Validate (`build` calls the engine's admission: tokenisation and chat rendering happen there, once),
        apply back-pressure and hand the request to the engine thread. Raises RequestError."""
        arrival = time.monotonic()
        try:
            if self._draining:
                raise RequestError(grpc.StatusCode.UNAVAILABLE, "server is shutting down")
            if not self.worker.alive:
                raise RequestError(grpc.StatusCode.UNAVAILABLE, "engine stopped")
            try:
                admitted = build(self.engine.admission)
            except ValueError as exc:  # AdmissionError names its field; any other ValueError is bad input too
                param = exc.param if isinstance(exc, AdmissionError) else None
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(exc), param) from None
            rid = self._request_id(request_id)
            num_tokens = len(admitted.prompt_token_ids)
            self._check_capacity(num_tokens)
        except RequestError as exc:
            if exc.code == grpc.StatusCode.INVALID_ARGUMENT:
                self.metrics.request_rejected("invalid_argument")
            elif exc.code == grpc.StatusCode.UNAVAILABLE:
                self.metrics.request_rejected("shutting_down")
            raise
        loop = self._loop
        assert loop is not None and self._idle is not None, "session not bound to a loop"
        q: asyncio.Queue = asyncio.Queue()
        state = ActiveRequest(rid, arrival, num_tokens, q)
        self._active[rid] = state
        self._idle.clear()
        self._pending_requests += 1
        self._pending_tokens += num_tokens

        def sink(item: Any, _put=q.put_nowait) -> None:  # engine thread
            loop.call_soon_threadsafe(_put, item)

        self.worker.submit(rid, admitted, arrival, sink)
        return state

    def _unpend(self, state: ActiveRequest) -> None:
        if state.pending:
            state.pending = False
            self._pending_requests -= 1
            self._pending_tokens -= state.num_prompt_tokens

    def release(self, state: ActiveRequest) -> None:
        """The front end is done with the request: abort it in the engine unless it finished."""
        self._unpend(state)
        if self._active.get(state.request_id) is state:
            del self._active[state.request_id]
        if not state.finished:
            # Cancelled, disconnected or past its deadline (or failed): free its KV blocks in the engine.
            self.worker.abort(state.request_id)
            self.metrics.request_finished("abort")  # as vLLM counts it; the engine's abort output has no reader
            log.debug("request %s ended early: aborted", state.request_id)
        if not self._active and self._idle is not None:
            self._idle.set()

    async def next_output(self, state: ActiveRequest) -> RequestOutput:
        """The request's next RequestOutput; raises RequestError for an engine-side error."""
        item = await state.queue.get()
        self._unpend(state)
        if isinstance(item, BaseException):
            state.finished = True  # nothing left in the engine to abort
            if isinstance(item, ValueError):
                self.metrics.request_rejected("invalid_argument")
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(item))
            if isinstance(item, EngineError):
                raise RequestError(grpc.StatusCode.INTERNAL if not self._draining else grpc.StatusCode.UNAVAILABLE,
                                   str(item))
            raise RequestError(grpc.StatusCode.INTERNAL, f"engine error: {item!r}")
        self.metrics.observe_output(state, item)
        if item.finished:
            state.finished = True
        return item

    def model_info(self) -> dict[str, Any]:
        """What GetModelInfo answers (and the HTTP /v1/models card carries)."""
        cfg, mc = self.engine_config, self.engine.model_config
        return dict(
            model_name=self.model_name,
            architecture=mc.architecture,
            max_model_len=int(self.engine.max_model_len),
            vocab_size=int(mc.vocab_size),
            scheduler=str(cfg.scheduler or ""),
            token_budget=int(cfg.token_budget or 0),
            max_num_seqs=int(cfg.max_num_seqs or 0),
            block_size=int(cfg.block_size or 0),
            has_tokenizer=self.engine.admission.tokenizer is not None,
            dtype=str(cfg.dtype or ""),
            attention_backend=str(cfg.attention_backend or ""),
        )

    async def engine_stats(self) -> dict[str, Any]:
        """The engine's `stats()`, read between iterations, plus the session's counters."""
        s = await asyncio.wrap_future(self.worker.call(lambda engine: engine.stats()))
        return dict(s, num_active_requests=len(self._active), num_pending_requests=self._pending_requests,
                    num_pending_prompt_tokens=self._pending_tokens, num_iterations=self.worker.num_iterations,
                    draining=self._draining)
