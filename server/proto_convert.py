"""Conversion between the gRPC messages (`sarathi.v1.Generation`) and the engine's types.

Requests: a `GenerateRequest`'s sampling fields -> `SamplingParams`, and its prompt -> an admission builder
for `GenerationServer.admit`. Responses: a `RequestOutput` -> a `GenerateResponse` (a stream chunk, or the
whole completion accumulated), with its timings, logprobs and finish fields.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from sarathi_jax.admission import Admission, AdmissionError, AdmittedRequest
from sarathi_jax.sampling_params import SamplingParams
from server.proto.sarathi.v1 import generation_pb2 as pb

FINISH_REASONS = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
    "error": pb.FINISH_REASON_ERROR,
}

def sampling_params_from_proto(request: pb.GenerateRequest) -> SamplingParams:
    """SamplingParams from the request's sampling fields (each SamplingParams field has a request field of the
    same name); unset fields keep SamplingParams' defaults.

    Raises AdmissionError naming the bad field (SamplingParams' own validation).
    """
    kwargs: dict[str, Any] = {}
    for field in dataclasses.fields(SamplingParams):
        if request.DESCRIPTOR.fields_by_name[field.name].is_repeated:
            if values := getattr(request, field.name):  # a repeated field is never unset, only empty
                kwargs[field.name] = tuple(values)
        elif request.HasField(field.name):
            kwargs[field.name] = getattr(request, field.name)
    return SamplingParams(**kwargs)


def admission_from_proto(request: pb.GenerateRequest) -> Callable[[Admission], AdmittedRequest]:
    """The request's prompt and sampling fields as a `GenerationServer.admit` builder."""
    which = request.WhichOneof("prompt")

    def build(admission: Admission) -> AdmittedRequest:
        if which is None:
            raise AdmissionError("prompt", "must be set (text, token_ids or messages)")  # the oneof: protocol shape
        params = sampling_params_from_proto(request)
        if which == "messages":
            return admission.admit_chat([{"role": m.role, "content": m.content} for m in request.messages.messages],
                                        params)
        return admission.admit(request.text if which == "text" else list(request.token_ids.ids), params)

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
