"""The gRPC front end of `GenerationServer`: the `sarathi.v1.Generation` servicer, health checking and
reflection on one `grpc.aio` server.

The handlers go through the request session's `admit`, `next_output` and `release` (server/session.py), as the
HTTP front end does. The conversions between the messages and the engine's types come first: a request's
sampling fields -> `SamplingParams` and its prompt -> an admission builder for `admit`; a `RequestOutput` ->
a `GenerateResponse` (a stream chunk, or the whole completion accumulated), with its timings, logprobs and
finish fields. A request whose RPC ends early (client cancel, disconnect, deadline) is aborted in the
engine from the handler's `finally`, which frees its KV blocks before the engine's next iteration. A request
that does not decode (garbage bytes, invalid UTF-8 in a string field) is answered INVALID_ARGUMENT: the
service's handlers are registered here with a decoder that hands the failure to the handler, where grpc's own
would answer UNKNOWN and log an error.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1 import health as grpc_health
from grpc_reflection.v1alpha import reflection

from sarathi_jax.core.admission import Admission, AdmissionError, AdmittedRequest
from sarathi_jax.request.sampling_params import SamplingParams
from server.proto.sarathi.v1 import generation_pb2 as pb
from server.proto.sarathi.v1 import generation_pb2_grpc as pb_grpc
from server.request_state import SHUTDOWN_ABORT_MESSAGE, ActiveRequest, RequestError
from server.security import ApiKeyInterceptor, ServerSecurity, grpc_server_credentials
from server.session import RequestSession

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name  # "sarathi.v1.Generation"

# ----------------------------------------------------------------------------------------- messages <-> engine types

FINISH_REASONS = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
    "error": pb.FINISH_REASON_ERROR,
}

def sampling_params_from_proto(request: pb.GenerateRequest) -> SamplingParams:
    """SamplingParams from the request's sampling fields (each SamplingParams field has a request field of the
    same name); unset fields keep SamplingParams' defaults.

    `structured_outputs` is JSON text (a JSON object with one constraint kind). Raises AdmissionError naming
    the bad field (SamplingParams' own validation).
    """
    kwargs: dict[str, Any] = {}
    for field in dataclasses.fields(SamplingParams):
        if request.DESCRIPTOR.fields_by_name[field.name].is_repeated:
            if values := getattr(request, field.name):  # a repeated field is never unset, only empty
                kwargs[field.name] = tuple(values)
        elif request.HasField(field.name):
            kwargs[field.name] = getattr(request, field.name)
    if "structured_outputs" in kwargs:  # a JSON object in a string
        try:
            kwargs["structured_outputs"] = json.loads(kwargs["structured_outputs"])
        except ValueError as e:
            raise AdmissionError("structured_outputs", f"not a JSON object: {e}") from None
    return SamplingParams(**kwargs)


def admission_from_proto(request: pb.GenerateRequest) -> Callable[[Admission], AdmittedRequest]:
    """The request's prompt and sampling fields as a `GenerationServer.admit` builder."""
    which = request.WhichOneof("prompt")

    def build(admission: Admission) -> AdmittedRequest:
        if which is None:
            raise AdmissionError("prompt", "must be set (text, token_ids or messages)")  # the oneof: protocol shape
        params = sampling_params_from_proto(request)
        priority = request.priority  # 0 when unset: the default
        slo = {name: getattr(request, name) if request.HasField(name) else None for name in ("slo_ttft_s", "slo_tbt_s")}
        if which == "messages":
            return admission.admit_chat([{"role": m.role, "content": m.content} for m in request.messages.messages],
                                        params, priority, **slo)
        return admission.admit(request.text if which == "text" else list(request.token_ids.ids), params, priority,
                               **slo)

    return build


def request_id_of(request: pb.GenerateRequest) -> str | None:
    """The client's request id, or None when unset (the server then makes one)."""
    return request.request_id if request.HasField("request_id") else None


def add_logprobs(resp: pb.GenerateResponse, out: Any) -> None:
    """Append the output's new tokens' logprobs to the response."""
    for lp in out.new_logprobs or ():
        resp.logprobs.add(token_id=lp.token_id, logprob=lp.logprob, top_token_ids=lp.top_token_ids,
                          top_logprobs=lp.top_logprobs)


def fill_timings(msg: pb.Timings, arrival_time: float, out: Any) -> None:
    """Queue time, TTFT and (once finished) end-to-end time, from arrival, as far as the output knows them."""
    rm = out.metrics
    if rm.first_scheduled_time is not None:
        msg.queue_time_s = max(0.0, rm.first_scheduled_time - arrival_time)
    if rm.first_token_time is not None:
        msg.ttft_s = max(0.0, rm.first_token_time - arrival_time)
    if out.finished:
        end = rm.finished_time if rm.finished_time is not None else time.monotonic()
        msg.e2e_s = max(0.0, end - arrival_time)


def fill_finish_fields(resp: pb.GenerateResponse, out: Any) -> None:
    """A finished output's finish reason, usage and error."""
    resp.finished = True
    resp.finish_reason = FINISH_REASONS.get(out.finish_reason or "", pb.FINISH_REASON_UNSPECIFIED)
    resp.usage.prompt_tokens = len(out.prompt_token_ids)
    resp.usage.completion_tokens = len(out.token_ids)
    if out.error:
        resp.error = out.error


def fill_shutdown_fields(resp: pb.GenerateResponse, state: ActiveRequest) -> pb.GenerateResponse:
    """The last message of a request the server ended (drain grace over): FINISH_REASON_ABORT, the usage so far."""
    resp.finished = True
    resp.finish_reason = pb.FINISH_REASON_ABORT
    resp.usage.prompt_tokens = state.num_prompt_tokens
    resp.usage.completion_tokens = state.tokens_seen
    resp.error = SHUTDOWN_ABORT_MESSAGE
    return resp


def stream_response(request_id: str, arrival_time: float, out: Any, send_timings: bool) -> pb.GenerateResponse:
    """One streamed chunk: the output's new tokens and text; timings when `send_timings` (the first chunk with
    tokens) or when it finishes."""
    resp = pb.GenerateResponse(request_id=request_id, token_ids=out.new_token_ids, text=out.text_delta or "")
    add_logprobs(resp, out)
    if send_timings or out.finished:
        fill_timings(resp.timings, arrival_time, out)
    if out.finished:
        fill_finish_fields(resp, out)
    return resp


# ----------------------------------------------------------------------------------------- the service


async def build_grpc_server(session: RequestSession, host: str, port: int, security: ServerSecurity = ServerSecurity()
                            ) -> tuple[grpc.aio.Server, grpc_health.aio.HealthServicer, int]:
    """The gRPC server (not started) with the generation, health (NOT_SERVING for now) and reflection
    services, bound to `host:port` (TLS and the API key as `security` says); returns it, its health servicer and
    the bound port."""
    interceptors = [ApiKeyInterceptor(security.api_key)] if security.api_key is not None else None
    grpc_server = grpc.aio.server(options=[("grpc.so_reuseport", 0)], interceptors=interceptors)
    _add_generation_service(GenerationServicer(session), grpc_server)
    health = grpc_health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, grpc_server)
    await set_health(health, serving=False)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        grpc_server,
    )
    try:
        address = f"{host}:{port}"
        bound = (grpc_server.add_secure_port(address, grpc_server_credentials(security)) if security.tls
                 else grpc_server.add_insecure_port(address))
    except RuntimeError:  # grpc's "Failed to bind": as any other start-up failure to bind, an OSError
        bound = 0
    if bound == 0:
        await grpc_server.stop(None)
        raise OSError(f"could not bind gRPC to {host}:{port} (address in use or not available)")
    return grpc_server, health, bound


@dataclass(frozen=True)
class UndecodableRequest:
    """What a handler receives for request bytes that are not a valid message (`reason`: protobuf's)."""

    reason: str


def _decoder(message_type: type[Message]) -> Callable[[bytes], Message | UndecodableRequest]:
    def decode(data: bytes) -> Message | UndecodableRequest:
        try:
            return message_type.FromString(data)
        except DecodeError as exc:
            return UndecodableRequest(str(exc))

    return decode


def _add_generation_service(servicer: GenerationServicer, server: grpc.aio.Server) -> None:
    """generation_pb2_grpc's `add_GenerationServicer_to_server`, with `_decoder`s."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate, _decoder(pb.GenerateRequest), pb.GenerateResponse.SerializeToString),
        "Complete": grpc.unary_unary_rpc_method_handler(
            servicer.Complete, _decoder(pb.GenerateRequest), pb.GenerateResponse.SerializeToString),
        "GetModelInfo": grpc.unary_unary_rpc_method_handler(
            servicer.GetModelInfo, _decoder(pb.GetModelInfoRequest), pb.ModelInfo.SerializeToString),
        "GetStats": grpc.unary_unary_rpc_method_handler(
            servicer.GetStats, _decoder(pb.GetStatsRequest), pb.Stats.SerializeToString),
    }
    assert set(handlers) == set(pb.DESCRIPTOR.services_by_name["Generation"].methods_by_name)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


async def _refuse_undecodable(request: object, context: grpc.aio.ServicerContext) -> None:
    if isinstance(request, UndecodableRequest):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: could not be decoded: {request.reason}")


async def set_health(health: grpc_health.aio.HealthServicer, serving: bool) -> None:
    """SERVING or NOT_SERVING, for the server as a whole and for the generation service."""
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    await health.set("", status)
    await health.set(SERVICE_NAME, status)


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, session: RequestSession) -> None:
        self._session = session

    async def _admit(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        await _refuse_undecodable(request, context)
        try:
            return await self._session.admit(admission_from_proto(request), request_id_of(request))
        except RequestError as exc:
            await context.abort(exc.code, exc.message)

    async def _next(self, state, context: grpc.aio.ServicerContext):
        """The request's next output, or None when the server ended it (drain grace over: the caller answers
        FINISH_REASON_ABORT in-band, as the proto promises); aborts the RPC on any other error."""
        try:
            return await self._session.next_output(state)
        except RequestError as exc:
            if state.ended_by_shutdown:
                return None
            await context.abort(exc.code, exc.message)

    async def Generate(self, request, context):
        # Writes with context.write() rather than being an async generator, so that a cancellation (client
        # cancel, disconnect, deadline) always lands inside this coroutine and its `finally` aborts the request.
        state = await self._admit(request, context)
        try:
            while True:
                out = await self._next(state, context)
                if out is None:
                    await context.write(fill_shutdown_fields(pb.GenerateResponse(request_id=state.request_id), state))
                    return
                send_timings = bool(out.new_token_ids) and not state.first_timings_sent
                if send_timings or out.finished:
                    state.first_timings_sent = True
                await context.write(stream_response(state.request_id, state.arrival_time, out, send_timings))
                if out.finished:
                    return
        finally:
            self._session.release(state)

    async def Complete(self, request, context):
        state = await self._admit(request, context)
        resp = pb.GenerateResponse(request_id=state.request_id)
        try:
            while True:
                out = await self._next(state, context)
                if out is None:
                    return fill_shutdown_fields(resp, state)
                resp.token_ids.extend(out.new_token_ids)
                add_logprobs(resp, out)
                if out.finished:
                    resp.text = out.text or ""
                    fill_timings(resp.timings, state.arrival_time, out)
                    fill_finish_fields(resp, out)
                    return resp
        finally:
            self._session.release(state)

    async def GetModelInfo(self, request, context):
        await _refuse_undecodable(request, context)
        return pb.ModelInfo(**self._session.model_info())

    async def GetStats(self, request, context):
        await _refuse_undecodable(request, context)
        if not self._session.worker.alive:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "engine stopped")
        s = await self._session.engine_stats()
        return pb.Stats(**{name: s.get(name, 0) for name in pb.Stats.DESCRIPTOR.fields_by_name})
