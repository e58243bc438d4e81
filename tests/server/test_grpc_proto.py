"""The committed generated modules match generation.proto, and import as a package."""

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

    from sarathi_jax.sampling_params import SamplingParams
    from server.client import make_request
    from server.proto.sarathi.v1 import generation_pb2
    from server.service import sampling_params_from_proto

    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    assert fields <= set(generation_pb2.GenerateRequest.DESCRIPTOR.fields_by_name)
    assert sampling_params_from_proto(make_request([1])) == SamplingParams()  # unset -> defaults
    params = SamplingParams(temperature=0.5, top_p=0.9, top_k=7, min_p=0.05, seed=3, max_tokens=9, min_tokens=2,
                            stop=("a", "bc"), stop_token_ids=(4, 5), ignore_eos=True, logprobs=2)
    assert sampling_params_from_proto(make_request([1], params)) == params
