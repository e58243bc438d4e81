"""`GenerationServer`: the server's lifecycle. One engine thread behind the gRPC and HTTP front ends, on one
asyncio loop: start, drain, stop, from asyncio or from plain threads.

The requests themselves (admission, back-pressure, outputs, aborts) are the `RequestSession`'s
(server/session.py), which both front ends (server/grpc_service.py, server/http_api.py) go through.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import grpc

from server.engine_worker import EngineWorker, ServingEngine
from server.grpc_service import build_grpc_server, set_health
from server.http_limits import HttpLimits
from server.security import ServerSecurity, is_loopback
from server.session import ServerMetrics
from server.session import (
    DEFAULT_MAX_REQUEST_ID_LENGTH,
    DEFAULT_MAX_WAITING_PROMPT_TOKENS,
    DEFAULT_MAX_WAITING_REQUESTS,
    RequestSession,
)

log = logging.getLogger(__name__)

# After the drain grace, how long the front ends get to end their requests' streams in-band (a client that does
# not read may hold a write); what is still running then is cancelled.
STREAM_END_TIMEOUT_S = 5.0


class GenerationServer:
    """One engine behind a gRPC `sarathi.v1.Generation` service, health checking and reflection, and (with
    `http_port`) the OpenAI-compatible HTTP API of server/http_api.py. Both front ends go through
    `self.session` (`RequestSession`: admission, back-pressure with `max_waiting_requests` and
    `max_waiting_prompt_tokens`, metrics). `port=None` serves HTTP only. `http_limits`: the HTTP body-size limit
    and head deadline; `max_request_id_length`: the longest client request id; `security`: the API key and TLS
    settings of all three endpoints (server/security.py).

    Use from asyncio (`await start()`, `await wait_stopped()`, `await drain_async()`), or from plain threads
    (`start_in_thread()`, `drain()`, `stop()`), as the tests and `python -m server` do.
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
        max_request_id_length: int = DEFAULT_MAX_REQUEST_ID_LENGTH,
        http_limits: HttpLimits = HttpLimits(),
        security: ServerSecurity = ServerSecurity(),
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
        self.http_limits = http_limits
        self.security = security
        self.metrics = ServerMetrics(self.model_name)
        self.worker = EngineWorker(engine, on_stats=self.metrics.update_engine_stats)
        self.session = RequestSession(engine, self.engine_config, self.model_name, self.worker, self.metrics,
                                      max_waiting_requests=max_waiting_requests,
                                      max_waiting_prompt_tokens=max_waiting_prompt_tokens,
                                      max_request_id_length=max_request_id_length)
        self._drain_task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._grpc: grpc.aio.Server | None = None
        self._http: Any = None  # server.http_api.HttpFrontEnd
        self._health: Any = None
        self._stopped: asyncio.Event | None = None
        self._stop_lock: asyncio.Lock | None = None
        self._grace_over: asyncio.Event | None = None  # set by end_drain_async
        self._thread: threading.Thread | None = None

    # ----------------------------------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """Start the engine thread, the gRPC and HTTP servers and the metrics endpoint; SERVING once all are up.
        If one cannot start (a port in use: OSError), what did start is stopped before the error is raised."""
        self._loop = asyncio.get_running_loop()
        self.session.bind(self._loop)
        self._stopped = asyncio.Event()
        self._stop_lock = asyncio.Lock()
        self._grace_over = asyncio.Event()
        try:
            # Before serving: building the grammar compiler holds the GIL (docs/design/structured-outputs.md).
            await self._loop.run_in_executor(None, self.engine.admission.warm_grammars)
            await self._start_all()
        except BaseException:
            await self.stop_async(grace=0)
            raise

    async def _start_all(self) -> None:
        if self.port is not None:
            await self._start_grpc()
        self.worker.start()
        if self._grpc is not None:
            await self._grpc.start()
        if self.http_port is not None:
            from server.http_api import HttpFrontEnd  # FastAPI and uvicorn load only when HTTP is served

            self._http = HttpFrontEnd(self.session, self.http_limits, self.security)
            self.http_port = await self._http.start(self.http_host, self.http_port)
        if self.metrics_port is not None:
            self.metrics_port = self.metrics.serve(self.metrics_port, self.metrics_host,
                                                   self.security.metrics_tls_options())
        self._warn_if_open()
        # The engine compiles and warms up in its constructor, so it is ready as soon as its thread runs.
        if self._health is not None:
            await set_health(self._health, serving=True)
        log.info("serving %s%s%s%s", self.model_name,
                 f", gRPC on {self.host}:{self.port}" if self.port is not None else "",
                 f", HTTP on {self.http_host}:{self.http_port}" if self.http_port is not None else "",
                 f", metrics on :{self.metrics_port}" if self.metrics_port is not None else "")

    def _warn_if_open(self) -> None:
        """A WARNING when an API is reachable beyond this machine and needs no key."""
        if self.security.api_key is not None:
            return
        hosts = [h for h, p in ((self.host, self.port), (self.http_host, self.http_port)) if p is not None]
        exposed = sorted({h for h in hosts if not is_loopback(h)})
        if exposed:
            log.warning("serving on %s without an API key: anyone who can reach it may generate (give --api-key "
                        "or SARATHI_API_KEY, or bind --host 127.0.0.1)", ", ".join(exposed))

    async def _start_grpc(self) -> None:
        self._grpc, self._health, self.port = await build_grpc_server(self.session, self.host, self.port,
                                                                      self.security)

    async def wait_stopped(self) -> None:
        assert self._stopped is not None
        await self._stopped.wait()

    async def drain_async(self, grace: float | None = None) -> None:
        """Refuse new requests (UNAVAILABLE, health NOT_SERVING), let running ones finish, then stop.

        After `grace` seconds (None: no limit) requests still running are ended in-band: an HTTP stream with an
        SSE error event and `data: [DONE]` (a non-streamed request: 503), a gRPC stream with a last message
        carrying FINISH_REASON_ABORT (Complete: its response).
        """
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self._drain(grace))
        await asyncio.shield(self._drain_task)

    async def end_drain_async(self) -> None:
        """End the drain's grace now (a second SIGTERM or Ctrl-C): requests still running end in-band, as when
        the grace runs out, then the server stops. Starts a drain first if none is under way."""
        assert self._grace_over is not None
        self._grace_over.set()
        await self.drain_async(0)

    async def _drain(self, grace: float | None) -> None:
        assert self._grace_over is not None
        await self._begin_shutdown()
        log.info("draining: %d requests in flight", self.session.num_active_requests)
        waits = [asyncio.ensure_future(self.session.wait_until_idle()), asyncio.ensure_future(self._grace_over.wait())]
        try:
            await asyncio.wait(waits, timeout=grace, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        if self.session.num_active_requests:
            log.warning("drain grace over: ending %d requests", self.session.end_all_requests())
            try:
                await asyncio.wait_for(self.session.wait_until_idle(), STREAM_END_TIMEOUT_S)
            except asyncio.TimeoutError:
                log.warning("%d requests did not end in %.0f s: cancelling them", self.session.num_active_requests,
                            STREAM_END_TIMEOUT_S)
        # A short grace lets an RPC that slipped in meanwhile get its UNAVAILABLE answer instead of a
        # cancellation; stop() returns as soon as no RPC is left.
        await self.stop_async(grace=0 if self.session.num_active_requests else 1.0)

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
            self.session.compiles.close()
            self.metrics.close()
            self._stopped.set()
            log.info("server stopped")

    async def _begin_shutdown(self) -> None:
        self.session.stop_admitting()
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

    def end_drain(self, timeout: float | None = None) -> None:
        """Blocking `end_drain_async` (the second signal's path) from another thread; returns once stopped."""
        self._call(self.end_drain_async(), timeout)
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
        return self.session.draining

    @property
    def num_active_requests(self) -> int:
        return self.session.num_active_requests
