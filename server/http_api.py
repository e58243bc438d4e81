"""The OpenAI-compatible HTTP front end: FastAPI on uvicorn, in the gRPC server's event loop.

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (both streamed with server-sent
events when `stream` is true, ending `data: [DONE]`), GET /health, GET /metrics (the server's Prometheus
registry). Requests go through `RequestSession.admit` / `next_output` / `release`, as gRPC's do: same
admission, back-pressure (429, gRPC's RESOURCE_EXHAUSTED), cancellation (a client that disconnects aborts its
request, which frees its KV blocks at once) and metrics. Every error, the framework's own (404, 405, an
unparsable body) and the body-size limit's 413 included, uses OpenAI's JSON shape
`{"error": {"message", "type", "param", "code"}}`. Limits on a client's cost (`HttpLimits`,
server/http_limits.py) are enforced here (`BodySizeLimit`: 413) and in server/http_connection.py (deadlines on a
request's head and body, the cap on open connections, lingering close), whose protocol uvicorn runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import grpc
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from sarathi_jax.core.admission import Admission, AdmissionError, AdmittedRequest
from sarathi_jax.request.outputs import RequestOutput, TokenLogprob
from server.http_errors import (
    ErrorJSONResponse,
    error_body,
    error_json,
    error_response,
    framework_error_response,
    validation_error_response,
)
from server.http_connection import h11_protocol_with_limits
from server.http_limits import HttpLimits
from server.openai_schema import ChatCompletionRequest, CompletionRequest, Renderer, sse_event, usage_of
from server.request_state import ActiveRequest, RequestError
from server.security import ApiKeyMiddleware, ServerSecurity
from server.session import RequestSession

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

def _finish_reason(out: RequestOutput, body: CompletionRequest | ChatCompletionRequest) -> str | None:
    """The output's finish reason; RequestError for "error": INVALID_ARGUMENT naming the body field for the
    request's own fault (its constraint), INTERNAL for the engine's."""
    if not out.finished:
        return None
    if out.finish_reason == "error":
        if out.error_param is not None:
            named = body.named(AdmissionError(out.error_param, ""))
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, out.error or out.error_param, named.param)
        raise RequestError(grpc.StatusCode.INTERNAL, out.error or "the engine could not serve this request")
    return out.finish_reason


class _Api:
    def __init__(self, session: RequestSession) -> None:
        self.session = session

    def _check_body(self, body: CompletionRequest | ChatCompletionRequest) -> None:
        """The protocol's own checks, which admission cannot know: fields this server does not honour, and the
        model name. Every request rule is admission's."""
        field = body.unsupported()
        if field is not None:
            raise AdmissionError(field, "not supported by this server")
        if body.model is not None and body.model != self.session.model_name:
            raise AdmissionError("model", f"the model `{body.model}` does not exist; this server serves "
                                          f"`{self.session.model_name}`")

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        def build(admission: Admission) -> AdmittedRequest:
            self._check_body(body)
            params = body.sampling_params(body.logprobs, body.max_tokens)
            return admission.admit(body.single_prompt(), params, body.priority, **body.slo_targets())

        return await self._serve(body, build, request)

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        def build(admission: Admission) -> AdmittedRequest:
            self._check_body(body)
            ids = admission.chat_prompt_ids([m.as_template_message() for m in body.messages])
            max_tokens = body.requested_max_tokens()
            if max_tokens is None:  # OpenAI's default for chat: as much as the context leaves
                max_tokens = admission.room(ids)
            return admission.check(ids, body.sampling_params(body.requested_logprobs(), max_tokens), body.priority,
                                   **body.slo_targets())

        return await self._serve(body, build, request)

    async def _serve(self, body: CompletionRequest | ChatCompletionRequest,
                     build: Callable[[Admission], AdmittedRequest], request: Request) -> Response:
        def admit(admission: Admission) -> AdmittedRequest:
            try:
                return build(admission)
            except AdmissionError as e:  # a refused constraint names the body field that set it
                raise body.named(e) from None

        state = await self.session.admit(admit, name=body.named)  # RequestError -> the exception handler
        renderer = Renderer(body, self.session.model_name, self.session.engine.admission.tokenizer)
        if body.stream:
            return StreamingResponse(self._stream(state, renderer), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            result = await _until_disconnect(self._complete(state, renderer), request)
        finally:
            self.session.release(state)
        # None: the client left (nobody reads this answer; 499 is nginx's "client closed request").
        return JSONResponse(result) if result is not None else Response(status_code=499)

    async def _complete(self, state: ActiveRequest, r: Renderer) -> dict[str, Any]:
        token_ids: list[int] = []
        logprobs: list[TokenLogprob] = []
        while True:
            out = await self.session.next_output(state)
            token_ids.extend(out.new_token_ids)
            logprobs.extend(out.new_logprobs)
            if out.finished:
                choice = r.choice(out.text, tuple(token_ids), tuple(logprobs), _finish_reason(out, r.body),
                                  stream=False)
                return {**r.envelope([choice], stream=False), "usage": usage_of(out)}

    async def _stream(self, state: ActiveRequest, r: Renderer) -> AsyncIterator[str]:
        # Starlette cancels this generator when the client disconnects: `finally` aborts the request.
        usage: dict[str, Any] = {"usage": None} if r.body.include_usage else {}
        try:
            first = True
            while True:
                try:
                    out = await self.session.next_output(state)
                    finish = _finish_reason(out, r.body)
                except RequestError as exc:  # the status line is sent: report it in-band, as vLLM does
                    yield sse_event(error_json(exc))
                    break
                if out.new_token_ids or out.text_delta or out.finished:
                    choice = r.choice(out.text_delta, out.new_token_ids, out.new_logprobs, finish, stream=True,
                                      first=first)
                    first = False
                    yield sse_event({**r.envelope([choice], stream=True), **usage})
                if out.finished:
                    if usage:
                        yield sse_event({**r.envelope([], stream=True), "usage": usage_of(out)})
                    break
            yield "data: [DONE]\n\n"
        finally:
            self.session.release(state)


async def _until_disconnect(work: Any, request: Request) -> Any:
    """Await `work`; if the client disconnects first, cancel it and return None (the caller's `finally`
    aborts the request)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        return None
    return task.result()


def build_app(session: RequestSession, limits: HttpLimits = HttpLimits(), api_key: str | None = None) -> FastAPI:
    api = _Api(session)
    app = FastAPI(title="sarathi-jax", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodySizeLimit, max_bytes=limits.max_body_bytes)
    if api_key is not None:  # added last: the outermost, a request without the key is refused before anything
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)

    @app.exception_handler(HTTPException)
    async def on_http_error(_: Request, exc: HTTPException) -> JSONResponse:
        if exc.status_code in (400, 413):  # a bad body, as a validation error counts
            session.metrics.request_rejected("invalid_argument")
        return framework_error_response(exc)

    @app.exception_handler(Exception)
    async def on_unexpected_error(_: Request, exc: Exception) -> JSONResponse:  # a bug: still OpenAI's shape
        return ErrorJSONResponse(error_body(f"internal error: {exc!r}", "server_error", None, "internal"),
                                 status_code=500)

    @app.exception_handler(RequestError)
    async def on_request_error(_: Request, exc: RequestError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        session.metrics.request_rejected("invalid_argument")
        return validation_error_response(exc.errors())

    app.post("/v1/completions")(api.completions)
    app.post("/v1/chat/completions")(api.chat_completions)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        info = session.model_info()
        card = {"id": session.model_name, "object": "model", "created": 0, "owned_by": "sarathi-jax",
                "root": str(session.engine_config.model), "max_model_len": info["max_model_len"], "sarathi": info}
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> Response:
        ok = not session.draining and session.worker.alive
        return Response(status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(session.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


class _EmbeddedUvicorn(uvicorn.Server):
    """uvicorn without its own signal handlers: the process's SIGTERM handler drains both front ends."""

    @contextlib.contextmanager
    def capture_signals(self):  # type: ignore[override]
        yield


class HttpFrontEnd:
    """The app on uvicorn, in the running event loop."""

    def __init__(self, session: RequestSession, limits: HttpLimits = HttpLimits(),
                 security: ServerSecurity = ServerSecurity()) -> None:
        self.app = build_app(session, limits, security.api_key)
        self.limits = limits
        self.security = security
        self._uvicorn: _EmbeddedUvicorn | None = None
        self._task: asyncio.Future | None = None

    async def start(self, host: str, port: int) -> int:
        """Serve on host:port (0 picks a free port); returns the bound port once accepting connections."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            sock.close()
            raise OSError(exc.errno, f"could not bind HTTP to {host}:{port}: {exc.strerror}") from None
        config = uvicorn.Config(self.app, lifespan="off", log_level="warning", access_log=False,
                                http=h11_protocol_with_limits(self.limits),
                                h11_max_incomplete_event_size=self.limits.max_header_bytes,
                                **self.security.uvicorn_ssl_options())
        self._uvicorn = _EmbeddedUvicorn(config)
        self._task = asyncio.ensure_future(self._uvicorn.serve(sockets=[sock]))
        while not self._uvicorn.started:  # uvicorn sets a flag, no event: poll the loop briefly
            if self._task.done():
                self._task.result()  # raises the start-up error
                raise RuntimeError("HTTP server exited during start-up")
            await asyncio.sleep(0.01)
        return sock.getsockname()[1]

    async def stop(self, grace: float | None) -> None:
        """Stop accepting; requests in flight get `grace` seconds (None: none), then are cancelled."""
        if self._uvicorn is None or self._task is None:
            return
        # A moment even without grace: uvicorn's wait for its tasks would time out (and log it) at 0.
        self._uvicorn.config.timeout_graceful_shutdown = grace or 0.05
        self._uvicorn.should_exit = True
        await self._task


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

        # Connection: close, as the client may still be sending: the connection closes lingering (reading the
        # rest away) and takes no next request.
        return HTTPException(413, f"the request body ({size} bytes) exceeds the limit of {self.max_bytes} bytes "
                                  "(--max-body-bytes)", headers={"Connection": "close"})
