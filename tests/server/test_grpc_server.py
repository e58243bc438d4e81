"""End-to-end tests of the gRPC generation service: a real engine (tiny random Llama checkpoint with a
tokenizer) behind a real server on 127.0.0.1, driven by real gRPC clients. One server for the whole module."""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import time
import urllib.request

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from grpc_test_utils import all_blocks_free, assert_parks_when_idle, fail_next_step, get_stats, stub_for, wait_until
from sarathi_jax.sampling_params import SamplingParams
from server.client import finish_reason_name, make_request
from server.loadgen import run_load
from server.proto.sarathi.v1 import generation_pb2 as pb
from server.proto.sarathi.v1 import generation_pb2_grpc as pb_grpc
from server.service import GenerationServer

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GREEDY_PROMPT_LENGTHS = (1, 5, 17, 40, 70, 100)  # crossing block (16) and budget (64) boundaries
GREEDY_MAX_TOKENS = 12


# --------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def engine_and_config(llama_engine):
    return llama_engine


@pytest.fixture(scope="module")
def vocab(engine_and_config):
    return engine_and_config[0].model_config.vocab_size


@pytest.fixture(scope="module")
def offline_reference(engine_and_config, vocab):
    """Greedy outputs of the offline engine (driven directly, before the server owns it)."""
    engine, _ = engine_and_config
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
def server(engine_and_config, offline_reference):
    engine, config = engine_and_config
    srv = GenerationServer(engine, engine_config=config, host="127.0.0.1", port=0, metrics_port=0)
    srv.start_in_thread()
    yield srv
    srv.stop(grace=0, timeout=60)


@pytest.fixture(scope="module")
def stub(server):
    channel, stub = stub_for(server.target)
    yield stub
    channel.close()


def greedy(**kw):
    return dict(temperature=0.0, ignore_eos=True, **kw)


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
    # (id, prompt, sampling kwargs, a word the message must contain)
    ("no-prompt", None, {}, "prompt"),
    ("empty-token-ids", [], {}, "prompt"),
    ("empty-text", "", {}, "prompt"),
    ("token-out-of-vocab", [1, 2, 10**6], {}, "prompt"),
    ("negative-token", [1, -5], {}, "prompt"),
    ("prompt-too-long", [5] * 300, {}, "prompt"),
    ("prompt-fills-max-len", [5] * 256, {}, "prompt"),
    ("max_tokens-beyond-max-model-len", [5] * 200, {"max_tokens": 57}, "max_tokens"),
    ("temperature", [1, 2], {"temperature": -1.0}, "temperature"),
    ("temperature-nan", [1, 2], {"temperature": float("nan")}, "temperature"),
    ("top_p-zero", [1, 2], {"top_p": 0.0}, "top_p"),
    ("top_p-big", [1, 2], {"top_p": 1.5}, "top_p"),
    ("top_k", [1, 2], {"top_k": -2}, "top_k"),
    ("min_p", [1, 2], {"min_p": 2.0}, "min_p"),
    ("seed", [1, 2], {"seed": -1}, "seed"),
    ("max_tokens", [1, 2], {"max_tokens": 0}, "max_tokens"),
    ("min_tokens", [1, 2], {"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ("logprobs", [1, 2], {"logprobs": 21}, "logprobs"),
    ("stop-empty", [1, 2], {"stop": [""]}, "stop"),
    ("stop_token_ids-negative", [1, 2], {"stop_token_ids": [-1]}, "stop_token_ids"),
    ("stop_token_ids-out-of-vocab", [1, 2], {"stop_token_ids": [10**6]}, "stop_token_ids"),
    ("request_id-empty", [1, 2], {"request_id": ""}, "request_id"),
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


# --------------------------------------------------------------------------------------------- cancellation
def test_200_concurrent_streams_with_random_cancellations(server, stub, vocab):
    n = 200
    rng = random.Random(1234)
    cancelled = set(rng.sample(range(n), n // 5))
    specs = []
    for i in range(n):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 40))]
        if i in cancelled:  # long enough to be mid-generation when cancelled
            specs.append((prompt, 100, rng.randint(1, 4)))
        else:
            specs.append((prompt, rng.randint(4, 16), None))

    async def drive():
        async with grpc.aio.insecure_channel(server.target) as channel:
            astub = pb_grpc.GenerationStub(channel)

            async def one(i):
                prompt, max_tokens, cancel_after = specs[i]
                call = astub.Generate(make_request(prompt, max_tokens=max_tokens, temperature=0.8, seed=i,
                                                   ignore_eos=True), timeout=120)
                tokens, last = [], None
                async for msg in call:
                    tokens.extend(msg.token_ids)
                    last = msg
                    if cancel_after is not None and len(tokens) >= cancel_after:
                        call.cancel()
                        break
                return tokens, last, call

            return await asyncio.gather(*(one(i) for i in range(n)))

    results = asyncio.run(drive())
    for i, (tokens, last, call) in enumerate(results):
        prompt, max_tokens, cancel_after = specs[i]
        if i in cancelled:
            assert cancel_after <= len(tokens) < max_tokens
            assert not last.finished
            assert call.cancelled()
        else:
            assert len(tokens) == max_tokens, f"stream {i}"
            assert last.finished and finish_reason_name(last.finish_reason) == "length"
            assert last.usage.completion_tokens == max_tokens and last.usage.prompt_tokens == len(prompt)
    # The cancelled requests were aborted in the engine: nothing left running, every KV block free.
    wait_until(lambda: server.num_active_requests == 0, what="all handlers to finish")
    wait_until(lambda: all_blocks_free(stub), timeout=10, what="all KV blocks to be free")
    assert get_stats(stub).num_pending_requests == 0


def test_cancel_frees_blocks_without_another_iteration(server, stub, engine_resumed):
    call = stub.Generate(make_request([11, 12, 13, 14], max_tokens=240, **greedy()), timeout=60)
    next(call)
    server.pause_engine()
    paused = get_stats(stub)  # answered after the pause took effect
    assert paused.num_running == 1 and paused.num_free_blocks < paused.num_total_blocks
    call.cancel()
    wait_until(lambda: server.num_active_requests == 0, what="the handler to see the cancellation")
    after = get_stats(stub)
    assert after.num_free_blocks == after.num_total_blocks and after.num_running == 0
    assert after.num_iterations == paused.num_iterations  # freed by the abort itself, no step in between


def test_expired_deadline_frees_blocks(server, stub, engine_resumed):
    call = stub.Generate(make_request([21, 22, 23], max_tokens=240, **greedy()), timeout=1.0)
    next(call)  # the request is running and holds blocks
    server.pause_engine()  # ... and now stalls, so the deadline expires mid-generation
    with pytest.raises(grpc.RpcError) as info:
        for _ in call:
            pass
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: server.num_active_requests == 0, what="the server to drop the expired request")
    assert all_blocks_free(stub)


# --------------------------------------------------------------------------------------------- back-pressure
def _overload_round(server, prompts, max_tokens):
    """Fire all prompts at a paused engine; return (results, pending count seen while paused)."""

    async def drive():
        async with grpc.aio.insecure_channel(server.target) as channel:
            astub = pb_grpc.GenerationStub(channel)
            calls = [astub.Complete(make_request(p, max_tokens=max_tokens, **greedy()), timeout=60) for p in prompts]
            tasks = [asyncio.ensure_future(c) for c in calls]
            # Wait (bounded) until every request was either refused or admitted.
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                stats = await astub.GetStats(pb.GetStatsRequest(), timeout=10)
                if sum(t.done() for t in tasks) + stats.num_pending_requests == len(tasks):
                    break
                await asyncio.sleep(0.02)
            pending = stats.num_pending_requests
            server.resume_engine()
            return await asyncio.gather(*tasks, return_exceptions=True), pending

    return asyncio.run(drive())


def test_overload_resource_exhausted_and_accepted_requests_complete(server, stub, engine_resumed):
    server.pause_engine()
    server.max_waiting_requests, server.max_waiting_prompt_tokens = 4, None
    results, pending = _overload_round(server, [[30 + i, 31, 32] for i in range(10)], max_tokens=6)
    ok = [r for r in results if isinstance(r, pb.GenerateResponse)]
    refused = [r for r in results if not isinstance(r, pb.GenerateResponse)]
    assert pending == 4 and len(ok) == 4 and len(refused) == 6
    for err in refused:
        assert isinstance(err, grpc.aio.AioRpcError) and err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_waiting_requests" in err.details()
    for resp in ok:  # nothing accepted was lost
        assert len(resp.token_ids) == 6 and finish_reason_name(resp.finish_reason) == "length"

    # Bound on waiting prompt tokens: 20-token prompts, 50 tokens allowed -> 2 admitted.
    server.pause_engine()
    server.max_waiting_requests, server.max_waiting_prompt_tokens = None, 50
    results, pending = _overload_round(server, [[40 + i] * 20 for i in range(6)], max_tokens=5)
    ok = [r for r in results if isinstance(r, pb.GenerateResponse)]
    refused = [r for r in results if not isinstance(r, pb.GenerateResponse)]
    assert pending == 2 and len(ok) == 2 and len(refused) == 4
    assert all(e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_waiting_prompt_tokens" in e.details()
               for e in refused)
    assert all(len(r.token_ids) == 5 for r in ok)
    wait_until(lambda: all_blocks_free(stub), what="all KV blocks to be free")


# --------------------------------------------------------------------------------------------- observability
def test_prometheus_metrics(server, stub):
    stub.Complete(make_request([1, 2, 3, 4], max_tokens=5, **greedy()), timeout=30)
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name_labels, value = line.rsplit(" ", 1)
            samples[name_labels.split("{")[0]] = samples.get(name_labels.split("{")[0], 0.0) + float(value)
    for hist in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds"):
        assert samples[f"sarathi:{hist}_count"] > 0, hist
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert f"sarathi:{gauge}" in samples
    assert "sarathi:num_preemptions_total" in samples
    assert samples["sarathi:prefix_cache_queries_total"] >= 4  # prefix caching is on by default
    assert "sarathi:prefix_cache_hits_total" in samples
    assert samples["sarathi:prompt_tokens_total"] >= 4
    assert samples["sarathi:generation_tokens_total"] >= 5
    assert samples["sarathi:request_success_total"] >= 1


def test_loadgen_reports_client_side_latencies(server, vocab):
    rng = random.Random(5)
    requests = [(0.02 * i, [rng.randrange(3, vocab) for _ in range(rng.randint(2, 30))],
                 SamplingParams(temperature=0.0, max_tokens=4 + i % 5, ignore_eos=True)) for i in range(12)]
    t0 = time.monotonic()
    results = run_load(server.target, requests, request_timeout=60)
    assert time.monotonic() - t0 >= 0.22  # arrivals were spread over real time
    assert [r.index for r in results] == list(range(12))
    for (arrival, prompt, params), r in zip(requests, results):
        assert r.ok, r.error
        assert r.num_tokens == params.max_tokens and r.finish_reason == "length"
        assert r.num_prompt_tokens == len(prompt)
        assert r.send_time >= arrival - 1e-3
        assert r.ttft is not None and r.ttft > 0 and len(r.tbts) == r.num_tokens - 1
        assert all(t >= 0 for t in r.tbts) and r.e2e_latency >= r.ttft


def test_client_cli_streams_text(server, stub):
    cmd = [sys.executable, "-m", "server.client", "Hello world", "--max-tokens", "6", "--temperature", "0",
           "--ignore-eos", "--target", server.target]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    expected = stub.Complete(make_request("Hello world", max_tokens=6, **greedy()), timeout=30)
    assert proc.stdout.rstrip("\n") == expected.text
    assert "finish_reason=length" in proc.stderr


def test_bench_hook_run_bench_workload(server, stub):
    from sarathi_jax.bench.workload import Workload
    from server.loadgen import run_bench_workload

    workload = Workload(arrivals=[0.0, 0.01, 0.02, 0.05], prompt_lens=[3, 10, 20, 5], output_lens=[4, 6, 3, 5])
    prompts = workload.prompts(32000, 0)  # the bench's default vocabulary: folded into the model's 256
    before = get_stats(stub).num_preemptions
    run = run_bench_workload(server.target, workload, prompts)
    assert run.label == server.target and run.config["notes"]
    # the server's counter over the run; 4 short requests in 160 KV blocks are never preempted
    assert run.num_preemptions == get_stats(stub).num_preemptions - before == 0
    assert [r.num_output_tokens for r in run.records] == [4, 6, 3, 5]
    for rec, arrival in zip(run.records, workload.arrivals):
        assert rec.completed and rec.error is None and rec.arrival_time == arrival
        assert rec.ttft > 0 and len(rec.tbts) == rec.num_output_tokens - 1 and rec.e2e_latency >= rec.ttft
        assert rec.first_scheduled_time is not None and rec.first_scheduled_time <= rec.first_token_time


def test_idle_engine_thread_blocks(server, stub):
    stub.Complete(make_request([1, 2, 3], max_tokens=2), timeout=30)
    wait_until(lambda: server.num_active_requests == 0, what="idle")
    assert_parks_when_idle(server.worker)  # blocked on its queue


def test_engine_step_failure_is_internal_and_server_recovers(server, stub):
    fail_next_step(server)
    with pytest.raises(grpc.RpcError) as info:
        stub.Complete(make_request([1, 2, 3], max_tokens=3), timeout=30)
    assert info.value.code() == grpc.StatusCode.INTERNAL and "injected step failure" in info.value.details()
    assert len(stub.Complete(make_request([1, 2, 3], max_tokens=3, **greedy()), timeout=30).token_ids) == 3
    wait_until(lambda: all_blocks_free(stub), what="all KV blocks to be free")
