"""The gRPC front end of `GenerationServer`: the `sarathi.v1.Generation` servicer, health checking and
reflection on one `grpc.aio` server.

The handlers go through the request session's `admit`, `next_output` and `release` (server/session.py), as the
HTTP front end does. A request whose RPC ends early (client cancel, disconnect, deadline) is aborted in the
engine from the handler's `finally`, which frees its KV blocks before the engine's next iteration.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1 import health as grpc_health
from grpc_reflection.v1alpha import reflection

from server.proto.sarathi.v1 import generation_pb2 as pb
from server.proto.sarathi.v1 import generation_pb2_grpc as pb_grpc
from server.proto_convert import (
    add_logprobs,
    admission_from_proto,
    fill_finish_fields,
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
    pb_grpc.add_GenerationServicer_to_server(GenerationServicer(session), grpc_server)
    health = grpc_health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, grpc_server)
    await set_health(health, serving=False)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        grpc_server,
    )
    bound = grpc_server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"could not bind {host}:{port}")
    return grpc_server, health, bound


async def set_health(health: grpc_health.aio.HealthServicer, serving: bool) -> None:
    """SERVING or NOT_SERVING, for the server as a whole and for the generation service."""
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    await health.set("", status)
    await health.set(SERVICE_NAME, status)


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, session: RequestSession) -> None:
        self._session = session

    async def _admit(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        try:
            return self._session.admit(admission_from_proto(request), request_id_of(request))
        except RequestError as exc:
            await context.abort(exc.code, exc.message)

    async def _next(self, state, context: grpc.aio.ServicerContext):
        try:
            return await self._session.next_output(state)
        except RequestError as exc:
            await context.abort(exc.code, exc.message)

    async def Generate(self, request, context):
        # Writes with context.write() rather than being an async generator, so that a cancellation (client
        # cancel, disconnect, deadline) always lands inside this coroutine and its `finally` aborts the request.
        state = await self._admit(request, context)
        try:
            while True:
                out = await self._next(state, context)
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
        return pb.ModelInfo(**self._session.model_info())

    async def GetStats(self, request, context):
        if not self._session.worker.alive:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "engine stopped")
        s = await self._session.engine_stats()
        return pb.Stats(**{name: s.get(name, 0) for name in pb.Stats.DESCRIPTOR.fields_by_name})
