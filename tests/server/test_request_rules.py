"""Validation once, at the edge: the same bad requests are refused alike by `LLMEngine.add_request`, the
`SimulatedEngine` sized like it, and the gRPC and HTTP servers in front of it: the same error class
(`AdmissionError`), the same field and the same message (the servers only map it to a status)."""

from __future__ import annotations

import grpc
import httpx2
import pytest

from grpc_test_utils import all_blocks_free, greedy, serving
from sarathi_jax.core.admission import AdmissionError
from sarathi_jax.request.sampling_params import SamplingParams
from sarathi_jax.sim.simulator import SimulatedEngine
from server.client import make_request

# (case, prompt token ids, sampling fields (SamplingParams' names, which both protocols share), field at fault).
# The shared engine: vocabulary 256, max_model_len 256, EOS 2.
CASES = [
    ("empty-prompt", [], {}, "prompt"),
    ("token-out-of-vocab", [1, 256], {}, "prompt"),
    ("negative-token", [1, -5], {}, "prompt"),
    ("prompt-fills-max-len", [5] * 256, {}, "prompt"),
    ("prompt-too-long", [5] * 300, {"max_tokens": 1}, "prompt"),
    ("prompt+max_tokens-too-long", [5] * 200, {"max_tokens": 57}, "max_tokens"),
    ("temperature", [1, 2], {"temperature": -1.0}, "temperature"),
    ("top_p", [1, 2], {"top_p": 0.0}, "top_p"),
    ("top_k", [1, 2], {"top_k": -2}, "top_k"),
    ("min_p", [1, 2], {"min_p": 2.0}, "min_p"),
    ("seed", [1, 2], {"seed": -1}, "seed"),
    ("max_tokens", [1, 2], {"max_tokens": 0}, "max_tokens"),
    ("min_tokens", [1, 2], {"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ("logprobs", [1, 2], {"logprobs": 21}, "logprobs"),
    ("stop-empty", [1, 2], {"stop": [""]}, "stop"),
    ("stop_token_ids-negative", [1, 2], {"stop_token_ids": [-1]}, "stop_token_ids"),
    ("stop_token_ids-out-of-vocab", [1, 2], {"stop_token_ids": [256]}, "stop_token_ids"),
    ("too-many-banned", [1, 2], {"min_tokens": 1, "stop_token_ids": list(range(3, 20))}, "stop_token_ids"),
]


def _refusal(add_request, prompt: list[int], fields: dict) -> tuple[type, str, str]:
    """How an engine refuses the request: (error class, field, message). Building SamplingParams is part of the
    offline call, so its refusal counts too."""
    with pytest.raises(ValueError) as info:
        add_request("bad", prompt, SamplingParams(**fields))
    return type(info.value), getattr(info.value, "param", None), str(info.value)


@pytest.fixture(scope="module")
def engine_before_server(llama_engine):
    """The engines' verdicts on every case, taken before this module's server owns the shared engine."""
    engine, _ = llama_engine
    bm = engine.block_manager
    sim = SimulatedEngine(engine.scheduler_config, bm.num_total_blocks, bm.block_size,
                          vocab_size=engine.model_config.vocab_size)
    verdicts = {case: (_refusal(engine.add_request, prompt, fields), _refusal(sim.add_request, prompt, fields))
                for case, prompt, fields, _ in CASES}
    assert not engine.has_unfinished_requests() and not sim.has_unfinished_requests()
    assert bm.num_free_blocks == bm.num_total_blocks  # nothing refused held a block
    return verdicts


@pytest.fixture(scope="module")
def server(llama_engine, engine_before_server):
    """Both front ends on one server over the shared engine."""
    with serving(llama_engine, http_port=0) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx2.Client(base_url=f"http://127.0.0.1:{server.http_port}", timeout=60) as client:
        yield client


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_every_edge_refuses_alike(engine_before_server, stub, http, case):
    name, prompt, fields, field = case
    engine, sim = engine_before_server[name]
    assert engine == sim
    error_class, param, message = engine
    assert error_class is AdmissionError and param == field and message.startswith(f"{field}: ")

    for call in (lambda: stub.Complete(make_request(prompt, **fields), timeout=30),
                 lambda: list(stub.Generate(make_request(prompt, **fields), timeout=30))):
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert (info.value.code(), info.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, message)

    resp = http.post("/v1/completions", json={"prompt": prompt, **fields})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert (err["param"], err["message"], err["type"]) == (field, message, "invalid_request_error")


def test_servers_keep_serving_and_nothing_leaks(stub, http):
    resp = stub.Complete(make_request([3, 4, 5], max_tokens=3, **greedy()), timeout=30)
    assert len(resp.token_ids) == 3
    assert all_blocks_free(stub)
