"""End-to-end tests of the gRPC generation service under operation: cancellations and deadlines that free KV
blocks, back-pressure, Prometheus metrics, the load generator, the client CLI and the bench hook, the idle
engine thread, and recovery from a failed step. A real engine (tiny random Llama checkpoint with a
tokenizer) behind a real server on 127.0.0.1, driven by real gRPC clients; one server for the module
(`server` in conftest.py)."""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest

from grpc_test_utils import all_blocks_free, assert_parks_when_idle, fail_next_step, get_stats, greedy, wait_until
from sarathi_jax.request.sampling_params import SamplingParams
from server.client import finish_reason_name, make_request
from sarathi_jax.bench.loadgen import run_load
from server.proto.sarathi.v1 import generation_pb2 as pb
from server.proto.sarathi.v1 import generation_pb2_grpc as pb_grpc

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
    server.session.max_waiting_requests, server.session.max_waiting_prompt_tokens = 4, None
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
    server.session.max_waiting_requests, server.session.max_waiting_prompt_tokens = None, 50
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
    from sarathi_jax.bench.loadgen import run_bench_workload

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
