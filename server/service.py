"""`GenerationServer`: one engine thread behind the gRPC and HTTP front ends, on one asyncio loop.

Each request gets an asyncio queue; the engine thread (`EngineWorker`) pushes the request's outputs into it
with `loop.call_soon_threadsafe`. Adds and aborts reach the engine through the worker's thread-safe queue.
Both front ends (server/grpc_service.py, server/http_api.py) go through `admit`, `next_output` and
`release`; a request whose RPC or HTTP request ends early is aborted in the engine from `release`, which frees
its KV blocks before the engine's next iteration. The gRPC messages are converted in server/proto_convert.py.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from sarathi_jax.admission import Admission, AdmissionError, AdmittedRequest
from sarathi_jax.outputs import RequestOutput
from server.engine_worker import EngineError, EngineWorker, ServingEngine
from server.metrics import ServerMetrics
from server.proto_convert import sampling_params_from_proto  # noqa: F401  (re-exported: its old home)

log = logging.getLogger(__name__)

DEFAULT_MAX_WAITING_REQUESTS = 1024
DEFAULT_MAX_WAITING_PROMPT_TOKENS = 1 << 20

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


class GenerationServer:
    """One engine behind a gRPC `sarathi.v1.Generation` service, health checking and reflection, and (with
    `http_port`) the OpenAI-compatible HTTP API of server/http_api.py. Both front ends go through `admit`,
    `next_output` and `release`: one admission path, one back-pressure rule, one set of metrics. `port=None`
    serves HTTP only.

    Use from asyncio (`await start()`, `await wait_stopped()`, `await drain_async()`), or from plain threads
    (`start_in_thread()`, `drain()`, `stop()`), as the tests and `python -m server` do.

    Back-pressure: a request is refused with RESOURCE_EXHAUSTED when admitting it would leave more than
    `max_waiting_requests` requests, or more than `max_waiting_prompt_tokens` prompt tokens, waiting, where
    waiting means admitted but without its first output yet. A lone request is always admitted whatever its
    prompt length (the engine bounds that with max_model_len).
    """

    def __init__(
        self,
        engine: ServingEngine,
        *,
        engine_config: Any = None,
        model_name: str | None = None,
        host: str = "127.0.0.1",
        port: int | None = 0,
        metrics_port: int | None = None,
        metrics_host: str | None = None,
        http_port: int | None = None,
        http_host: str | None = None,
        max_waiting_requests: int | None = DEFAULT_MAX_WAITING_REQUESTS,
        max_waiting_prompt_tokens: int | None = DEFAULT_MAX_WAITING_PROMPT_TOKENS,
    ) -> None:
        self.engine = engine
        self.engine_config = engine_config if engine_config is not None else engine.config
        self.model_name = model_name or str(self.engine_config.model or "unknown")
        self.host = host
        self.port = port
        self.metrics_port = metrics_port
        self.metrics_host = metrics_host or host
        self.http_port = http_port
        self.http_host = http_host or host
        self.max_waiting_requests = max_waiting_requests
        self.max_waiting_prompt_tokens = max_waiting_prompt_tokens
        self.metrics = ServerMetrics(self.model_name)
        self.worker = EngineWorker(engine, on_stats=self.metrics.update_engine_stats)
        self._active: dict[str, ActiveRequest] = {}
        self._pending_requests = 0
        self._pending_tokens = 0
        self._draining = False
        self._drain_task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._grpc: grpc.aio.Server | None = None
        self._http: Any = None  # server.http_api.HttpFrontEnd
        self._health: Any = None
        self._idle: asyncio.Event | None = None
        self._stopped: asyncio.Event | None = None
        self._stop_lock: asyncio.Lock | None = None
        self._thread: threading.Thread | None = None

    # ----------------------------------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """Start the engine thread, the gRPC and HTTP servers and the metrics endpoint; SERVING once all are up."""
        self._loop = asyncio.get_running_loop()
        self._idle = asyncio.Event()
        self._idle.set()
        self._stopped = asyncio.Event()
        self._stop_lock = asyncio.Lock()
        if self.port is not None:
            await self._start_grpc()
        self.worker.start()
        if self._grpc is not None:
            await self._grpc.start()
        if self.http_port is not None:
            from server.http_api import HttpFrontEnd  # FastAPI and uvicorn load only when HTTP is served

            self._http = HttpFrontEnd(self)
            self.http_port = await self._http.start(self.http_host, self.http_port)
        if self.metrics_port is not None:
            self.metrics_port = self.metrics.serve(self.metrics_port, self.metrics_host)
        # The engine compiles and warms up in its constructor, so it is ready as soon as its thread runs.
        if self._health is not None:
            from server.grpc_service import set_health

            await set_health(self._health, serving=True)
        log.info("serving %s%s%s%s", self.model_name,
                 f", gRPC on {self.host}:{self.port}" if self.port is not None else "",
                 f", HTTP on {self.http_host}:{self.http_port}" if self.http_port is not None else "",
                 f", metrics on :{self.metrics_port}" if self.metrics_port is not None else "")

    async def _start_grpc(self) -> None:
        from server.grpc_service import build_grpc_server  # imports this module: loaded once it is defined

        self._grpc, self._health, self.port = await build_grpc_server(self, self.host, self.port)

    async def wait_stopped(self) -> None:
        assert self._stopped is not None
        await self._stopped.wait()

    async def drain_async(self, grace: float | None = None) -> None:
        """Refuse new requests (UNAVAILABLE, health NOT_SERVING), let running ones finish, then stop.

        After `grace` seconds (None: no limit) requests still running are cancelled.
        """
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self._drain(grace))
        await asyncio.shield(self._drain_task)

    async def _drain(self, grace: float | None) -> None:
        await self._begin_shutdown()
        assert self._idle is not None
        log.info("draining: %d requests in flight", len(self._active))
        try:
            await asyncio.wait_for(self._idle.wait(), grace)
        except asyncio.TimeoutError:
            log.warning("drain grace over: cancelling %d requests", len(self._active))
        # A short grace lets an RPC that slipped in meanwhile get its UNAVAILABLE answer instead of a
        # cancellation; stop() returns as soon as no RPC is left.
        await self.stop_async(grace=0 if self._active else 1.0)

    async def stop_async(self, grace: float | None = None) -> None:
        """Stop now: in-flight RPCs and HTTP requests get `grace` seconds (None: none), then are cancelled; the
        engine thread ends."""
        assert self._stop_lock is not None and self._stopped is not None
        async with self._stop_lock:
            if self._stopped.is_set():
                return
            await self._begin_shutdown()
            stops = [] if self._grpc is None else [self._grpc.stop(grace)]
            if self._http is not None:
                stops.append(self._http.stop(grace))
            await asyncio.gather(*stops)
            await asyncio.get_running_loop().run_in_executor(None, self.worker.stop)
            self.metrics.close()
            self._stopped.set()
            log.info("server stopped")

    async def _begin_shutdown(self) -> None:
        self._draining = True
        if self._health is not None:
            await self._health.enter_graceful_shutdown()

    # --------------------------------------------------------------------- use from plain (non-async) threads
    def start_in_thread(self, timeout: float | None = 600.0) -> GenerationServer:
        """Run the server's event loop in a daemon thread; returns once it is SERVING."""
        started = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self.start())
            except BaseException as exc:
                errors.append(exc)
                started.set()
                loop.close()
                return
            started.set()
            try:
                loop.run_until_complete(self.wait_stopped())
                # Let the drain()/stop() coroutines that other threads wait on return their results.
                rest = [t for t in asyncio.all_tasks(loop) if not t.done()]
                if rest:
                    loop.run_until_complete(asyncio.wait(rest, timeout=1.0))
                loop.run_until_complete(loop.shutdown_asyncgens())
            finally:
                loop.close()

        self._thread = threading.Thread(target=run, name="sarathi-grpc", daemon=True)
        self._thread.start()
        if not started.wait(timeout):
            raise TimeoutError("server did not start")
        if errors:
            raise errors[0]
        return self

    def _call(self, coro: Any, timeout: float | None) -> Any:
        assert self._loop is not None, "server not started"
        if self._loop.is_closed():
            coro.close()
            return None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def drain(self, grace: float | None = None, timeout: float | None = None) -> None:
        """Blocking drain (the SIGTERM path) from another thread; returns once stopped."""
        self._call(self.drain_async(grace), timeout)
        self._join(timeout)

    def stop(self, grace: float | None = None, timeout: float | None = None) -> None:
        self._call(self.stop_async(grace), timeout)
        self._join(timeout)

    def _join(self, timeout: float | None) -> None:
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def pause_engine(self) -> None:
        """Admin / test hook: the engine thread keeps accepting adds and aborts but takes no iterations."""
        self.worker.pause()

    def resume_engine(self) -> None:
        self.worker.resume()

    @property
    def target(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "", "[::]", "::") else self.host
        return f"{host}:{self.port}"

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def num_active_requests(self) -> int:
        return len(self._active)

    # ----------------------------------------------------------------------------------------- requests
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
        assert loop is not None and self._idle is not None
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
        """The engine's `stats()`, read between iterations, plus the server's counters."""
        s = await asyncio.wrap_future(self.worker.call(lambda engine: engine.stats()))
        return dict(s, num_active_requests=len(self._active), num_pending_requests=self._pending_requests,
                    num_pending_prompt_tokens=self._pending_tokens, num_iterations=self.worker.num_iterations,
                    draining=self._draining)


