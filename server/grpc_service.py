"""The gRPC front end of `GenerationServer`: the `sarathi.v1.Generation` servicer, health checking and
reflection on one `grpc.aio` server.

The handlers go through the request session's `admit`, `next_output` and `release` (server/session.py), as the
HTTP front end does. A request whose RPC ends early (client cancel, disconnect, deadline) is aborted in the
engine from the handler's `finally`, which frees its KV blocks before the engine's next iteration. A request
that does not decode (garbage bytes, invalid UTF-8 in a string field) is answered INVALID_ARGUMENT: the
service's handlers are registered here with a decoder that hands the failure to the handler, where grpc's own
would answer UNKNOWN and log an error.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1 import health as grpc_health
from grpc_reflection.v1alpha import reflection

from server.proto.sarathi.v1 import generation_pb2 as pb
from server.proto.sarathi.v1 import generation_pb2_grpc as pb_grpc
from server.proto_convert import (
    add_logprobs,
    admission_from_proto,
    fill_finish_fields,
    fill_shutdown_fields,
    fill_timings,
    request_id_of,
    stream_response,
)
from server.request_state import RequestError
from server.session import RequestSession

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name  # "sarathi.v1.Generation"


async def build_grpc_server(session: RequestSession, host: str, port: int
                            ) -> tuple[grpc.aio.Server, grpc_health.aio.HealthServicer, int]:
    """The gRPC server (not started) with the generation, health (NOT_SERVING for now) and reflection
    services, bound to `host:port`; returns it, its health servicer and the bound port."""
    grpc_server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    _add_generation_service(GenerationServicer(session), grpc_server)
    health = grpc_health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, grpc_server)
    await set_health(health, serving=False)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        grpc_server,
    )
    try:
        bound = grpc_server.add_insecure_port(f"{host}:{port}")
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
            return self._session.admit(admission_from_proto(request), request_id_of(request))
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
