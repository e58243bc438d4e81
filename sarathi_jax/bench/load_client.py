"""One request as a load client sends it, and what the client saw of it (`ClientRequestResult`).

Over gRPC: a streamed `Generate` or a unary `Complete`. Over the OpenAI-compatible HTTP API (target
`http://HOST:PORT`): `POST /v1/completions` or `/v1/chat/completions`, streamed (server-sent events) or not,
always with vLLM's `return_token_ids`, so each chunk says which tokens it carries. `ClientBehaviour` says how
the client treats the request beyond sending it: streamed or not, cancelled mid-way (after some tokens, or
some seconds), read slowly. sarathi_jax/bench/loadgen.py replays request lists with the default (streamed, read at once,
never cancelled); benchmarks/soak.py drives mixed traffic with the rest.

Times are client-side `time.monotonic()` seconds after the driver's start `t0`; tokens that arrive in one message
share its receipt time. A failed request (e.g. RESOURCE_EXHAUSTED, HTTP 429) comes back with `error` set
("CODE: details", "HTTP STATUS: message") rather than raising.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

import grpc

from sarathi_jax.request.outputs import elapsed, token_gaps
from server.client import finish_reason_name, make_request
from server.security import ClientSecurity

# How each protocol says "over capacity, retry later" (the server's back-pressure, server/session.py).
REFUSAL_PREFIXES = ("RESOURCE_EXHAUSTED:", "HTTP 429:")


@dataclass(frozen=True)
class ClientBehaviour:
    """How the client treats one request. A cancelled request is cancelled by the client alone (gRPC: the call is
    cancelled; HTTP: the connection is closed), as a user who gives up would."""

    stream: bool = True  # gRPC Generate / SSE; False: gRPC Complete / one JSON response
    chat: bool = False  # HTTP: /v1/chat/completions, the (text) prompt as one user message
    cancel_after_tokens: int | None = None  # streamed: cancel once this many tokens have arrived
    cancel_after_s: float | None = None  # cancel if not finished this many seconds after sending
    read_delay_s: float = 0.0  # streamed: pause this long after each message (a slow reader)


STREAMED = ClientBehaviour()


@dataclass
class ClientRequestResult:
    index: int  # position in the input list
    request_id: str
    arrival_time: float  # scheduled, seconds after the driver's start
    send_time: float  # when it was actually sent, seconds after the driver's start
    num_prompt_tokens: int  # from the server's usage (0 if it never finished)
    token_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)  # receipt time of each token, seconds after start
    finish_reason: str | None = None
    error: str | None = None  # "STATUS_CODE: details" when the RPC failed
    server_ttft: float | None = None  # the server's own TTFT / queue time, from the last message's timings
    server_queue_time: float | None = None
    end_time: float | None = None  # seconds after start
    cancelled: bool = False  # the client cancelled it before it finished (ClientBehaviour)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def refused(self) -> bool:
        """The server refused it for capacity (RESOURCE_EXHAUSTED / HTTP 429)."""
        return self.error is not None and self.error.startswith(REFUSAL_PREFIXES)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def first_token_time(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    @property
    def ttft(self) -> float | None:
        return elapsed(self.send_time, self.first_token_time)

    @property
    def tbts(self) -> list[float]:
        return token_gaps(self.token_times)

    @property
    def e2e_latency(self) -> float | None:
        return elapsed(self.send_time, self.end_time)

    @property
    def send_lag(self) -> float:
        """How late the driver sent the request relative to its scheduled arrival."""
        return self.send_time - self.arrival_time


# How long a load client keeps an idle HTTP connection for reuse. Below the servers' own idle timeouts
# (uvicorn's keep-alive, 5 s, on this server and vLLM's alike): with equal timeouts (httpx's default expiry is 5 s
# too) the client may send a request on a connection the server is closing at that moment, and the request
# fails with a ReadError that no server caused. One such request failed a capacity probe at 1 req/s.
HTTP_KEEPALIVE_EXPIRY_S = 2.0


def http_pool_limits() -> Any:
    """The connection-pool limits of the load clients' `httpx2.AsyncClient`: no cap on connections (every
    request in flight has its own), idle ones dropped after `HTTP_KEEPALIVE_EXPIRY_S`."""
    import httpx2

    return httpx2.Limits(max_connections=None, max_keepalive_connections=None,
                         keepalive_expiry=HTTP_KEEPALIVE_EXPIRY_S)


def http_client(base_url: str, security: ClientSecurity = ClientSecurity(), **kwargs: Any) -> Any:
    """An `httpx2.AsyncClient` on `base_url` (http:// or https://) sending `security`'s key, checking the server's
    certificate against its CA file."""
    import httpx2

    return httpx2.AsyncClient(base_url=base_url, headers=security.http_headers(), verify=security.httpx_verify(),
                              **kwargs)


def new_result(index: int, request_id: str, arrival: float, t0: float) -> ClientRequestResult:
    """The record of a request about to be sent now."""
    return ClientRequestResult(index=index, request_id=request_id, arrival_time=arrival,
                               send_time=time.monotonic() - t0, num_prompt_tokens=0)


def is_http(target: str) -> bool:
    return target.startswith(("http://", "https://"))


def request_body(prompt: Any, params: Any, behaviour: ClientBehaviour = STREAMED) -> dict[str, Any]:
    """The HTTP body for (prompt, SamplingParams): the engine's fields are vLLM's names. A chat body carries the
    text prompt as one user message."""
    fields = {k: v for k, v in dataclasses.asdict(params).items() if v is not None and v != ()}
    if params.structured_outputs is not None:  # vLLM's `structured_outputs` object
        fields["structured_outputs"] = params.structured_outputs.as_dict()
    if behaviour.chat:
        fields["messages"] = [{"role": "user", "content": prompt}]
        if "logprobs" in fields:  # chat asks for them as a flag and a count
            fields.update(logprobs=True, top_logprobs=fields["logprobs"])
    else:
        fields["prompt"] = prompt if isinstance(prompt, str) else list(prompt)
    if behaviour.stream:
        fields.update(stream=True, stream_options={"include_usage": True})
    return {**fields, "return_token_ids": True}


def _cancel_now(res: ClientRequestResult, behaviour: ClientBehaviour, finished: bool) -> bool:
    """Whether a streamed request is to be cancelled now (enough tokens have come and it has not finished)."""
    due = behaviour.cancel_after_tokens is not None and res.num_tokens >= behaviour.cancel_after_tokens
    res.cancelled = due and not finished
    return res.cancelled


async def _within_cancel_deadline(work: Awaitable[None], res: ClientRequestResult, behaviour: ClientBehaviour) -> None:
    """Await `work`; with `cancel_after_s`, cancel it when it has not finished by then (the client gives up)."""
    if behaviour.cancel_after_s is None:
        await work
        return
    task = asyncio.ensure_future(work)
    try:
        done, _ = await asyncio.wait({task}, timeout=behaviour.cancel_after_s)
        if not done:
            task.cancel()
            res.cancelled = True
            await asyncio.wait({task})
        elif not task.cancelled():
            task.result()
    except asyncio.CancelledError:
        task.cancel()
        raise


def _take_message(res: ClientRequestResult, msg: Any, now: float) -> None:
    """Record one gRPC GenerateResponse."""
    if msg.token_ids:
        res.token_ids.extend(msg.token_ids)
        res.token_times.extend([now] * len(msg.token_ids))
    if msg.finished:
        res.finish_reason = finish_reason_name(msg.finish_reason)
        res.num_prompt_tokens = msg.usage.prompt_tokens
        if msg.timings.HasField("ttft_s"):
            res.server_ttft = msg.timings.ttft_s
        if msg.timings.HasField("queue_time_s"):
            res.server_queue_time = msg.timings.queue_time_s
        if msg.error:
            res.error = f"ENGINE_ERROR: {msg.error}"


async def send_grpc(stub: Any, res: ClientRequestResult, prompt: Any, params: Any, t0: float,
                    behaviour: ClientBehaviour = STREAMED, timeout: float | None = None) -> None:
    """Send one request over gRPC (`stub`: a `GenerationStub` on an aio channel); fills `res`."""
    request = make_request(prompt, params, request_id=res.request_id)
    call = stub.Generate(request, timeout=timeout) if behaviour.stream else stub.Complete(request, timeout=timeout)

    async def receive() -> None:
        if not behaviour.stream:
            _take_message(res, await call, time.monotonic() - t0)
            return
        async for msg in call:
            _take_message(res, msg, time.monotonic() - t0)
            if _cancel_now(res, behaviour, msg.finished):
                call.cancel()
                return
            if behaviour.read_delay_s:
                await asyncio.sleep(behaviour.read_delay_s)

    try:
        await _within_cancel_deadline(receive(), res, behaviour)
    except grpc.aio.AioRpcError as err:
        res.error = f"{err.code().name}: {err.details()}"
    except asyncio.CancelledError:
        call.cancel()
        raise
    if res.cancelled:
        call.cancel()  # the server sees CANCELLED at once, whatever the call was doing
    res.end_time = time.monotonic() - t0


def _take_chunk(res: ClientRequestResult, chunk: dict[str, Any], now: float) -> None:
    """Record one HTTP response object (a streamed chunk or the whole non-streamed response)."""
    if "error" in chunk:
        res.error = f"ENGINE_ERROR: {chunk['error'].get('message')}"
    for choice in chunk.get("choices", ()):
        ids = choice.get("token_ids") or []
        res.token_ids.extend(ids)
        res.token_times.extend([now] * len(ids))
        res.finish_reason = choice.get("finish_reason") or res.finish_reason
    if chunk.get("usage"):
        res.num_prompt_tokens = chunk["usage"]["prompt_tokens"]


async def send_http(client: Any, res: ClientRequestResult, prompt: Any, params: Any, t0: float,
                    behaviour: ClientBehaviour = STREAMED) -> None:
    """Send one request to the OpenAI-compatible HTTP API (`client`: an `httpx2.AsyncClient` on the server's
    base URL); fills `res`. Connection errors are reported in `error`, as gRPC's are."""
    path = "/v1/chat/completions" if behaviour.chat else "/v1/completions"

    async def receive() -> None:
        async with client.stream("POST", path, json=request_body(prompt, params, behaviour)) as resp:
            if resp.status_code != 200:
                detail = json.loads(await resp.aread() or b"{}").get("error", {}).get("message", "")
                res.error = f"HTTP {resp.status_code}: {detail}"
            elif not behaviour.stream:
                _take_chunk(res, json.loads(await resp.aread()), time.monotonic() - t0)
            else:
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    _take_chunk(res, json.loads(line[len("data: "):]), time.monotonic() - t0)
                    if _cancel_now(res, behaviour, res.finish_reason is not None):
                        return  # leaving the `async with` closes the connection: the server aborts it
                    if behaviour.read_delay_s:
                        await asyncio.sleep(behaviour.read_delay_s)

    try:
        await _within_cancel_deadline(receive(), res, behaviour)
    except asyncio.CancelledError:
        raise
    except Exception as err:  # noqa: BLE001 - connection errors: reported per request, like gRPC's
        res.error = f"{type(err).__name__}: {err}"
    res.end_time = time.monotonic() - t0
