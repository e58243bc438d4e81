"""The committed generated modules match generation.proto, and import as a package; the conversions between
the messages and the engine's types (server/grpc_service.py)."""

from __future__ import annotations

import pathlib

from server import gen_proto

GENERATED = ("generation_pb2.py", "generation_pb2.pyi", "generation_pb2_grpc.py")


def test_generated_code_is_up_to_date(tmp_path):
    assert gen_proto.main(tmp_path) == 0
    committed = gen_proto.REPO_ROOT / "server/proto/sarathi/v1"
    for name in GENERATED:
        fresh = (tmp_path / "server/proto/sarathi/v1" / name).read_text()
        assert fresh == (committed / name).read_text(), f"{name} is stale: run `python -m server.gen_proto`"


def test_generated_modules_import_as_a_package():
    from server.proto.sarathi.v1 import generation_pb2, generation_pb2_grpc

    assert generation_pb2.DESCRIPTOR.package == "sarathi.v1"
    service = generation_pb2.DESCRIPTOR.services_by_name["Generation"]
    assert [m.name for m in service.methods] == ["Generate", "Complete", "GetModelInfo", "GetStats"]
    assert hasattr(generation_pb2_grpc, "GenerationStub")
    req = generation_pb2.GenerateRequest()
    assert not req.HasField("temperature")  # optional: unset fields take SamplingParams defaults
    assert pathlib.Path(generation_pb2.__file__).parent.name == "v1"


def test_every_sampling_param_is_in_the_request_and_round_trips():
    import dataclasses

    from sarathi_jax.request.sampling_params import SamplingParams
    from server.client import make_request
    from server.proto.sarathi.v1 import generation_pb2
    from server.grpc_service import sampling_params_from_proto

    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    assert fields <= set(generation_pb2.GenerateRequest.DESCRIPTOR.fields_by_name)
    assert sampling_params_from_proto(make_request([1])) == SamplingParams()  # unset -> defaults
    params = SamplingParams(temperature=0.5, top_p=0.9, top_k=7, min_p=0.05, seed=3, max_tokens=9, min_tokens=2,
                            stop=("a", "bc"), stop_token_ids=(4, 5), ignore_eos=True, logprobs=2)
    assert sampling_params_from_proto(make_request([1], params)) == params


def _output(**overrides):
    from sarathi_jax.request.outputs import RequestMetrics, RequestOutput, TokenLogprob

    fields = dict(request_id="r", prompt_token_ids=(1, 2, 3), new_token_ids=(7,), token_ids=(5, 7), text_delta="b",
                  text="ab", new_logprobs=(TokenLogprob(7, -0.5, (7, 9), (-0.5, -1.5)),), finished=False,
                  finish_reason=None,
                  metrics=RequestMetrics(arrival_time=10.0, first_scheduled_time=10.25, first_token_time=11.0,
                                         token_times=[11.0, 11.5], finished_time=12.0))
    fields.update(overrides)
    return RequestOutput(**fields)


def test_stream_response_carries_the_step_and_timings_when_asked():
    from server.proto.sarathi.v1 import generation_pb2 as pb
    from server.grpc_service import stream_response

    chunk = stream_response("r", 10.0, _output(), send_timings=False)
    assert list(chunk.token_ids) == [7] and chunk.text == "b" and not chunk.finished
    assert not chunk.HasField("timings") and not chunk.HasField("usage")
    [lp] = chunk.logprobs
    assert (lp.token_id, lp.logprob, list(lp.top_token_ids), list(lp.top_logprobs)) == (7, -0.5, [7, 9], [-0.5, -1.5])

    first = stream_response("r", 10.0, _output(), send_timings=True)
    assert (first.timings.queue_time_s, first.timings.ttft_s) == (0.25, 1.0)
    assert not first.timings.HasField("e2e_s")  # not finished yet

    last = stream_response("r", 10.0, _output(finished=True, finish_reason="length"), send_timings=False)
    assert last.finished and last.finish_reason == pb.FINISH_REASON_LENGTH and last.timings.e2e_s == 2.0
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (3, 2)


def test_finish_fields_map_every_reason_and_the_error():
    from server.proto.sarathi.v1 import generation_pb2 as pb
    from server.grpc_service import FINISH_REASONS, fill_finish_fields

    for reason, value in FINISH_REASONS.items():
        resp = pb.GenerateResponse()
        fill_finish_fields(resp, _output(finished=True, finish_reason=reason, error="boom" if reason == "error" else None))
        assert resp.finished and resp.finish_reason == value
        assert resp.error == ("boom" if reason == "error" else "")
    resp = pb.GenerateResponse()
    fill_finish_fields(resp, _output(finished=True, finish_reason=None))
    assert resp.finish_reason == pb.FINISH_REASON_UNSPECIFIED


def test_admission_from_proto_refuses_a_request_without_prompt():
    import pytest

    from server.proto.sarathi.v1 import generation_pb2 as pb
    from server.grpc_service import admission_from_proto, request_id_of

    build = admission_from_proto(pb.GenerateRequest())
    with pytest.raises(ValueError, match="prompt: must be set"):
        build(None)
    assert request_id_of(pb.GenerateRequest()) is None and request_id_of(pb.GenerateRequest(request_id="x")) == "x"
