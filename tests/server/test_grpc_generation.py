"""End-to-end tests of what the gRPC generation service answers: health and reflection, model info, streamed
and unary tokens (greedy ones equal to the offline engine's), logprobs and sampling fields, and refused input.
A real engine (tiny random Llama checkpoint with a tokenizer) behind a real server on 127.0.0.1, driven by
real gRPC clients; one server for the module (`server` in conftest.py)."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from grpc_test_utils import greedy, wait_until
from sarathi_jax.request.sampling_params import SamplingParams
from server.client import finish_reason_name, make_request
from server.proto.sarathi.v1 import generation_pb2 as pb
from server.proto.sarathi.v1 import generation_pb2_grpc as pb_grpc

GREEDY_PROMPT_LENGTHS = (1, 5, 17, 40, 70, 100)  # crossing block (16) and budget (64) boundaries
GREEDY_MAX_TOKENS = 12


# --------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def offline_reference(llama_engine, vocab):
    """Greedy outputs of the offline engine (driven directly, before the server owns it)."""
    engine, _ = llama_engine
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, vocab, size=n).tolist() for n in GREEDY_PROMPT_LENGTHS]
    params = SamplingParams(temperature=0.0, max_tokens=GREEDY_MAX_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"offline-{i}", prompt, params)
    done: dict[str, list[int]] = {}
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.token_ids)
    assert not engine.has_unfinished_requests()
    return prompts, [done[f"offline-{i}"] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def engine_before_server(offline_reference):
    """The offline reference runs on the engine before this module's `server` takes it over."""
    return offline_reference


def collect_stream(stub, request, timeout=60):
    msgs = list(stub.Generate(request, timeout=timeout))
    tokens = [t for m in msgs for t in m.token_ids]
    return msgs, tokens


# --------------------------------------------------------------------------------------------- basics
def test_health_serving_and_reflection(server):
    from server.grpc_service import SERVICE_NAME

    assert SERVICE_NAME == "sarathi.v1.Generation"  # the name health and reflection report the service under
    with grpc.insecure_channel(server.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", SERVICE_NAME):
            resp = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        (resp,) = list(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                 timeout=10))
        names = {s.name for s in resp.list_services_response.service}
        assert {"sarathi.v1.Generation", "grpc.health.v1.Health"} <= names
        # The service's descriptor is served too (what grpcurl uses).
        (resp,) = list(refl.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(file_containing_symbol="sarathi.v1.Generation")]),
            timeout=10))
        assert resp.file_descriptor_response.file_descriptor_proto


def test_model_info(stub, vocab):
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert info.architecture == "LlamaForCausalLM"
    assert info.vocab_size == vocab
    assert info.max_model_len == 256
    assert info.scheduler == "sarathi"
    assert info.token_budget == 64
    assert info.max_num_seqs == 16
    assert info.has_tokenizer
    assert info.model_name



# --------------------------------------------------------------------------------------------- correctness
def test_streamed_greedy_tokens_match_offline_engine(server, stub, offline_reference):
    prompts, expected = offline_reference

    async def stream_all():
        async with grpc.aio.insecure_channel(server.target) as channel:
            astub = pb_grpc.GenerationStub(channel)

            async def one(prompt):
                msgs = [m async for m in astub.Generate(make_request(prompt, max_tokens=GREEDY_MAX_TOKENS,
                                                                     **greedy()), timeout=60)]
                return msgs

            return await asyncio.gather(*(one(p) for p in prompts))

    all_msgs = asyncio.run(stream_all())
    for prompt, msgs, want in zip(prompts, all_msgs, expected):
        got = [t for m in msgs for t in m.token_ids]
        assert got == want
        assert len(msgs) >= 2  # really streamed, not one lump
        last = msgs[-1]
        assert last.finished and not any(m.finished for m in msgs[:-1])
        assert finish_reason_name(last.finish_reason) == "length"
        assert last.usage.prompt_tokens == len(prompt)
        assert last.usage.completion_tokens == GREEDY_MAX_TOKENS
        assert 0.0 <= last.timings.queue_time_s <= last.timings.ttft_s <= last.timings.e2e_s
        assert msgs[0].timings.HasField("ttft_s")
    # Complete (unary) gives the same tokens.
    resp = stub.Complete(make_request(prompts[2], max_tokens=GREEDY_MAX_TOKENS, **greedy()), timeout=60)
    assert list(resp.token_ids) == expected[2]
    assert resp.finished and resp.usage.completion_tokens == GREEDY_MAX_TOKENS


def test_text_prompt_streams_text(stub):
    req = make_request("The quick brown fox", max_tokens=10, **greedy())
    msgs, tokens = collect_stream(stub, req)
    assert len(tokens) == 10
    streamed_text = "".join(m.text for m in msgs)
    resp = stub.Complete(req, timeout=60)
    assert list(resp.token_ids) == tokens
    assert resp.text == streamed_text and streamed_text


def test_logprobs_and_sampling_fields(stub):
    msgs, tokens = collect_stream(stub, make_request([5, 6, 7, 8], max_tokens=6, logprobs=3, **greedy()))
    lps = [lp for m in msgs for lp in m.logprobs]
    assert [lp.token_id for lp in lps] == tokens
    for lp in lps:
        assert len(lp.top_token_ids) == 3 and len(lp.top_logprobs) == 3
        assert lp.top_token_ids[0] == lp.token_id  # greedy: the sampled token is the most likely one
        assert lp.logprob <= 1e-6 and lp.top_logprobs[0] >= lp.top_logprobs[1] >= lp.top_logprobs[2]
    # Seeded sampling is reproducible; stop_token_ids stops and keeps the token; min_tokens is honoured.
    seeded = make_request([9, 10, 11], max_tokens=8, temperature=1.0, top_p=0.9, top_k=50, min_p=0.01, seed=123,
                          ignore_eos=True)
    a = stub.Complete(seeded, timeout=60)
    b = stub.Complete(seeded, timeout=60)
    assert list(a.token_ids) == list(b.token_ids) and len(a.token_ids) == 8
    stop_at = a.token_ids[3]
    first_hit = list(a.token_ids).index(stop_at)
    c = stub.Complete(make_request([9, 10, 11], max_tokens=8, temperature=1.0, top_p=0.9, top_k=50, min_p=0.01,
                                   seed=123, ignore_eos=True, stop_token_ids=[stop_at]), timeout=60)
    assert list(c.token_ids) == list(a.token_ids[: first_hit + 1])
    assert finish_reason_name(c.finish_reason) == "stop"



# --------------------------------------------------------------------------------------------- bad input
INVALID_CASES = [
    # (id, prompt, sampling kwargs, a word the message must contain). The request rules every entry point shares
    # (lengths, vocabulary, each sampling field's range) are in test_request_rules.py, checked through gRPC's
    # Generate and Complete, HTTP and both engines; these are the cases only a gRPC request can make.
    ("no-prompt", None, {}, "prompt"),
    ("empty-text", "", {}, "prompt"),
    ("temperature-nan", [1, 2], {"temperature": float("nan")}, "temperature"),
    ("top_p-big", [1, 2], {"top_p": 1.5}, "top_p"),
    ("request_id-empty", [1, 2], {"request_id": ""}, "request_id"),
    ("slo_ttft_s-zero", [1, 2], {"slo_ttft_s": 0.0}, "slo_ttft_s"),
    ("slo_tbt_s-negative", [1, 2], {"slo_tbt_s": -0.5}, "slo_tbt_s"),
    ("slo_tbt_s-nan", [1, 2], {"slo_tbt_s": float("nan")}, "slo_tbt_s"),
]


@pytest.mark.parametrize("case", INVALID_CASES, ids=[c[0] for c in INVALID_CASES])
def test_invalid_argument(stub, case):
    _, prompt, kwargs, word = case
    kwargs = dict(kwargs)
    rid = kwargs.pop("request_id", None)
    if prompt is None:
        req = pb.GenerateRequest(max_tokens=4)
    else:
        req = make_request(prompt, request_id=rid, **kwargs)
    for call in (lambda: list(stub.Generate(req, timeout=30)), lambda: stub.Complete(req, timeout=30)):
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        assert word in info.value.details()
    # ... and the server keeps serving.
    resp = stub.Complete(make_request([3, 4, 5], max_tokens=3, **greedy()), timeout=30)
    assert len(resp.token_ids) == 3


def test_duplicate_request_id_in_flight(server, stub):
    call = stub.Generate(make_request([7, 8, 9], request_id="dup-id", max_tokens=240, **greedy()), timeout=60)
    next(call)  # running
    with pytest.raises(grpc.RpcError) as info:
        stub.Complete(make_request([7, 8], request_id="dup-id", max_tokens=2), timeout=30)
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
    call.cancel()
    wait_until(lambda: server.num_active_requests == 0, what="the cancelled request to end")
    # Once done, the id can be reused.
    assert len(stub.Complete(make_request([7, 8], request_id="dup-id", max_tokens=2), timeout=30).token_ids) == 2

