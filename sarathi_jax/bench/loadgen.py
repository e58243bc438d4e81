"""Client-side load driver: replay (arrival_time, prompt, SamplingParams) requests against a server in real time.

    from sarathi_jax.bench.loadgen import run_load
    results = run_load("127.0.0.1:8033", [(0.0, [1, 2, 3], SamplingParams(max_tokens=16)), (0.05, ...), ...])
    for r in results:        # same order as the input
        r.ttft, r.tbts, r.num_tokens, r.finish_reason, r.error

Each request is sent at `start + arrival_time` (seconds, relative to when the driver starts; the list need not
be sorted) over one shared gRPC channel, as a `Generate` stream; or, when the target is a URL
(`http://HOST:PORT`), to the OpenAI-compatible HTTP API as a streamed `POST /v1/completions` (with vLLM's
`return_token_ids`, so each chunk says which tokens it carries). Times are measured at the client with
`time.monotonic()`: `ttft` from the moment the request was sent to the first message carrying tokens, `tbts`
between consecutive tokens. Tokens that arrive in the same message share that message's receipt time (so a
message with k tokens contributes k-1 zero gaps). Failed requests (e.g. RESOURCE_EXHAUSTED) come back with
`error` set ("CODE: details") rather than raising. Each request is sent by sarathi_jax/bench/load_client.py.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, Sequence

import grpc

from sarathi_jax.bench.load_client import (
    ClientRequestResult,
    http_client,
    http_pool_limits,
    is_http,
    new_result,
    send_grpc,
    send_http,
)
from server.proto.sarathi.v1 import generation_pb2_grpc as pb_grpc
from server.security import (
    ClientSecurity,
    add_client_flags,
    client_security_from_args,
    grpc_aio_channel,
    grpc_channel,
)

LoadRequest = tuple  # (arrival_time: float, prompt: list[int] | str, params: SamplingParams)

__all__ = ["ClientRequestResult", "LoadRequest", "load_records", "run_bench_workload", "run_load", "run_load_async"]


async def _sleep_until(when: float) -> None:
    delay = when - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)


async def _one(stub: Any, index: int, arrival: float, prompt: Any, params: Any, t0: float,
               request_timeout: float | None, prefix: str) -> ClientRequestResult:
    await _sleep_until(t0 + arrival)
    res = new_result(index, f"{prefix}-{index}", arrival, t0)
    await send_grpc(stub, res, prompt, params, t0, timeout=request_timeout)
    return res


async def _one_http(client: Any, index: int, arrival: float, prompt: Any, params: Any, t0: float,
                    prefix: str) -> ClientRequestResult:
    await _sleep_until(t0 + arrival)
    res = new_result(index, f"{prefix}-{index}", arrival, t0)
    await send_http(client, res, prompt, params, t0)
    return res


async def _run_load_http(target: str, requests: Sequence[LoadRequest], request_timeout: float | None,
                         prefix: str, security: ClientSecurity) -> list[ClientRequestResult]:
    async with http_client(target, security, timeout=request_timeout, limits=http_pool_limits()) as client:
        t0 = time.monotonic()
        return list(await asyncio.gather(*(
            _one_http(client, i, float(arrival), prompt, params, t0, prefix)
            for i, (arrival, prompt, params) in enumerate(requests))))


async def run_load_async(target: str, requests: Sequence[LoadRequest], *, request_timeout: float | None = None,
                         channel_options: Sequence[tuple[str, Any]] | None = None,
                         request_id_prefix: str | None = None,
                         security: ClientSecurity = ClientSecurity()) -> list[ClientRequestResult]:
    """Send `requests` = [(arrival_time_s, prompt_token_ids_or_text, SamplingParams), ...] to `target`
    ("host:port") concurrently, each at its arrival time; return one ClientRequestResult per request, in input
    order. `request_timeout` is each RPC's deadline in seconds (None: none). A target `http://HOST:PORT` (or
    `https://`) is driven over the OpenAI-compatible HTTP API instead (channel_options do not apply). `security`:
    the API key to send and the TLS settings (server/security.py)."""
    prefix = request_id_prefix or f"load-{uuid.uuid4().hex[:8]}"
    if is_http(target):
        return await _run_load_http(target, requests, request_timeout, prefix, security)
    async with grpc_aio_channel(target, security, options=list(channel_options or [])) as channel:
        await channel.channel_ready()
        stub = pb_grpc.GenerationStub(channel)
        t0 = time.monotonic()
        tasks = [
            asyncio.ensure_future(_one(stub, i, float(arrival), prompt, params, t0, request_timeout, prefix))
            for i, (arrival, prompt, params) in enumerate(requests)
        ]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for t in tasks:
                t.cancel()


def run_load(target: str, requests: Sequence[LoadRequest], **kwargs: Any) -> list[ClientRequestResult]:
    """Blocking wrapper of `run_load_async` (runs its own event loop; call from a thread without one)."""
    return asyncio.run(run_load_async(target, requests, **kwargs))


# ------------------------------------------------------------------------------------ bench harness hook
def _server_info(target: str, security: ClientSecurity) -> tuple[Any, Any]:
    """(model info, stats) with the fields the bench reads: GetModelInfo / GetStats over gRPC; over HTTP the
    /v1/models card's `sarathi` info and /metrics (no block count there: num_total_blocks is 0)."""
    from server.proto.sarathi.v1 import generation_pb2 as pb

    if is_http(target):
        import httpx2
        from prometheus_client.parser import text_string_to_metric_families

        with httpx2.Client(base_url=target, timeout=30, headers=security.http_headers(),
                           verify=security.httpx_verify()) as client:
            card = client.get("/v1/models").raise_for_status().json()["data"][0]
            metrics = client.get("/metrics").raise_for_status().text
        preemptions = sum(s.value for family in text_string_to_metric_families(metrics)
                          for s in family.samples if s.name == "sarathi:num_preemptions_total")
        return pb.ModelInfo(**card["sarathi"]), pb.Stats(num_preemptions=int(preemptions))

    with grpc_channel(target, security) as channel:
        grpc.channel_ready_future(channel).result(timeout=30)
        stub = pb_grpc.GenerationStub(channel)
        return stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30), stub.GetStats(pb.GetStatsRequest(),
                                                                                       timeout=30)


def load_records(workload: Any, results: Sequence[ClientRequestResult]) -> list:
    """The bench's RequestRecords (`sarathi_jax.bench.metrics`) of `run_load`'s results for `workload`'s
    requests, in order: client-side times relative to the run start, arrival_time the scheduled arrival, and
    first_scheduled_time from the server's reported queue time (gRPC only; None over HTTP)."""
    from sarathi_jax.bench.driver import workload_record

    records = []
    for i, r in enumerate(results):
        rec = workload_record(workload, i, r.request_id)
        rec.num_output_tokens = r.num_tokens
        rec.first_scheduled_time = None if r.server_queue_time is None else r.send_time + r.server_queue_time
        rec.first_token_time = r.first_token_time
        rec.token_times = list(r.token_times)
        rec.finished_time = r.end_time if r.finish_reason is not None else None
        rec.finish_reason = r.finish_reason if r.error is None else "error"
        rec.error = r.error
        records.append(rec)
    return records


def run_bench_workload(target: str, workload: Any, prompts: Sequence[Sequence[int]], *, temperature: float = 0.0,
                       progress: bool = False, request_timeout: float | None = None,
                       security: ClientSecurity = ClientSecurity()) -> Any:
    """`python -m sarathi_jax.bench --endpoint HOST:PORT` (gRPC) or `--endpoint http://HOST:PORT` (the
    OpenAI-compatible HTTP API): replay a bench Workload against a running server.

    Request i is sent at workload.arrivals[i] with prompts[i], max_tokens = workload.output_lens[i],
    ignore_eos, `temperature`. Returns a `sarathi_jax.bench.driver.RunResult` whose RequestRecords hold
    client-side times relative to the run start; arrival_time is the scheduled arrival (as in-process runs),
    first_scheduled_time comes from the server's reported queue time. Token ids outside the server model's
    vocabulary are folded into it (modulo), noted in `config["notes"]`. No iteration records (the server's
    iterations are not visible to a client); num_preemptions is the server's counter difference over the run.
    """
    from sarathi_jax.bench.driver import RunResult, workload_requests

    info, before = _server_info(target, security)
    notes: list[str] = []
    vocab = int(info.vocab_size) or None
    prompts = [list(map(int, p)) for p in prompts]
    if vocab is not None and any(t >= vocab for p in prompts for t in p):
        prompts = [[t % vocab for t in p] for p in prompts]
        notes.append(f"prompt token ids folded into the server model's vocabulary ({vocab})")
    requests = workload_requests(workload, prompts, temperature)
    t_wall = time.monotonic()
    results = run_load(target, requests, request_timeout=request_timeout, security=security)
    wall = time.monotonic() - t_wall
    _, after = _server_info(target, security)
    records = load_records(workload, results)
    config = {
        "endpoint": target,
        "model_name": info.model_name,
        "architecture": info.architecture,
        "scheduler": info.scheduler,
        "token_budget": info.token_budget,
        "max_num_seqs": info.max_num_seqs,
        "max_model_len": info.max_model_len,
        "num_total_blocks": after.num_total_blocks,
        "max_send_lag_s": max((r.send_lag for r in results), default=0.0),
        "notes": notes,
    }
    return RunResult(label=target, records=records, iterations=[],
                     num_preemptions=int(after.num_preemptions - before.num_preemptions), wall_time=wall,
                     config=config)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m sarathi_jax.bench.loadgen --bench-job JOB --bench-result RESULT`: what `python -m sarathi_jax.bench
    --endpoint` runs in a child process (`sarathi_jax.bench.endpoint`): replay the job's requests against its
    endpoint and write the run as JSON; a failure is one line on stderr and exit status 1."""
    import argparse
    import sys
    from pathlib import Path

    args_given = list(sys.argv[1:] if argv is None else argv)
    from sarathi_jax.bench.endpoint import job_workload

    parser = argparse.ArgumentParser(prog="python -m sarathi_jax.bench.loadgen", description=main.__doc__.split(":")[0])
    parser.add_argument("--bench-job", required=True, help="the requests (sarathi_jax.bench.endpoint.bench_job)")
    parser.add_argument("--bench-result", required=True, help="where to write the run (RunResult.to_json)")
    add_client_flags(parser)
    args = parser.parse_args(args_given)
    job = json.loads(Path(args.bench_job).read_text())
    try:
        security = client_security_from_args(args)
        run = run_bench_workload(job["endpoint"], job_workload(job), job["prompts"], temperature=job["temperature"],
                                 security=security)
    except Exception as e:  # noqa: BLE001 - connection failures etc.: one clear line for the bench
        print(f"{type(e).__name__}: {e or 'no details'}", file=sys.stderr)
        return 1
    Path(args.bench_result).write_text(json.dumps(run.to_json()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
