"""Client-side load driver: replay (arrival_time, prompt, SamplingParams) requests against a server in real time.

    from server.loadgen import run_load
    results = run_load("127.0.0.1:50051", [(0.0, [1, 2, 3], SamplingParams(max_tokens=16)), (0.05, ...), ...])
    for r in results:        # same order as the input
        r.ttft, r.tbts, r.num_tokens, r.finish_reason, r.error

Each request is sent at `start + arrival_time` (seconds, relative to when the driver starts; the list need not
be sorted) over one shared gRPC channel, as a `Generate` stream; or, when the target is a URL
(`http://HOST:PORT`), to the OpenAI-compatible HTTP API as a streamed `POST /v1/completions` (with vLLM's
`return_token_ids`, so each chunk says which tokens it carries). Times are measured at the client with
`time.monotonic()`: `ttft` from the moment the request was sent to the first message carrying tokens, `tbts`
between consecutive tokens. Tokens that arrive in the same message share that message's receipt time (so a
message with k tokens contributes k-1 zero gaps). Failed requests (e.g. RESOURCE_EXHAUSTED) come back with
`error` set ("CODE: details") rather than raising.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence

import grpc

from sarathi_jax.outputs import elapsed, token_gaps
from server.client import finish_reason_name, make_request
from server.proto.sarathi.v1 import generation_pb2_grpc as pb_grpc

LoadRequest = tuple  # (arrival_time: float, prompt: list[int] | str, params: SamplingParams)


@dataclass
class ClientRequestResult:
    index: int  # position in the input list
    request_id: str
    arrival_time: float  # scheduled, seconds after the driver's start
    send_time: float  # when it was actually sent, seconds after the driver's start
    num_prompt_tokens: int  # from the server's usage (0 if it never finished)
    token_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)  # receipt time of each token, seconds after start
    finish_reason: str | None = None
    error: str | None = None  # "STATUS_CODE: details" when the RPC failed
    server_ttft: float | None = None  # the server's own TTFT / queue time, from the last message's timings
    server_queue_time: float | None = None
    end_time: float | None = None  # seconds after start

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def first_token_time(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    @property
    def ttft(self) -> float | None:
        return elapsed(self.send_time, self.first_token_time)

    @property
    def tbts(self) -> list[float]:
        return token_gaps(self.token_times)

    @property
    def e2e_latency(self) -> float | None:
        return elapsed(self.send_time, self.end_time)

    @property
    def send_lag(self) -> float:
        """How late the driver sent the request relative to its scheduled arrival."""
        return self.send_time - self.arrival_time


async def _one(stub: Any, index: int, arrival: float, prompt: Any, params: Any, t0: float,
               request_timeout: float | None, prefix: str) -> ClientRequestResult:
    delay = t0 + arrival - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)
    rid = f"{prefix}-{index}"
    res = ClientRequestResult(index=index, request_id=rid, arrival_time=arrival,
                              send_time=time.monotonic() - t0, num_prompt_tokens=0)
    call = stub.Generate(make_request(prompt, params, request_id=rid), timeout=request_timeout)
    try:
        async for msg in call:
            now = time.monotonic() - t0
            if msg.token_ids:
                res.token_ids.extend(msg.token_ids)
                res.token_times.extend([now] * len(msg.token_ids))
            if msg.finished:
                res.finish_reason = finish_reason_name(msg.finish_reason)
                res.num_prompt_tokens = msg.usage.prompt_tokens
                if msg.timings.HasField("ttft_s"):
                    res.server_ttft = msg.timings.ttft_s
                if msg.timings.HasField("queue_time_s"):
                    res.server_queue_time = msg.timings.queue_time_s
                if msg.error:
                    res.error = f"ENGINE_ERROR: {msg.error}"
    except grpc.aio.AioRpcError as err:
        res.error = f"{err.code().name}: {err.details()}"
    except asyncio.CancelledError:
        call.cancel()
        raise
    res.end_time = time.monotonic() - t0
    return res


def is_http(target: str) -> bool:
    return target.startswith(("http://", "https://"))


def completion_body(prompt: Any, params: Any) -> dict[str, Any]:
    """A streamed /v1/completions body for (prompt, SamplingParams): the engine's fields are vLLM's names."""
    fields = {k: v for k, v in dataclasses.asdict(params).items() if v is not None and v != ()}
    return {**fields, "prompt": prompt if isinstance(prompt, str) else list(prompt), "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True}


async def _one_http(client: Any, index: int, arrival: float, prompt: Any, params: Any, t0: float,
                    prefix: str) -> ClientRequestResult:
    delay = t0 + arrival - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)
    res = ClientRequestResult(index=index, request_id=f"{prefix}-{index}", arrival_time=arrival,
                              send_time=time.monotonic() - t0, num_prompt_tokens=0)
    try:
        async with client.stream("POST", "/v1/completions", json=completion_body(prompt, params)) as resp:
            if resp.status_code != 200:
                detail = json.loads(await resp.aread() or b"{}").get("error", {}).get("message", "")
                res.error = f"HTTP {resp.status_code}: {detail}"
            else:
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[len("data: "):])
                    now = time.monotonic() - t0
                    if "error" in chunk:
                        res.error = f"ENGINE_ERROR: {chunk['error'].get('message')}"
                    for choice in chunk.get("choices", ()):
                        ids = choice.get("token_ids") or []
                        res.token_ids.extend(ids)
                        res.token_times.extend([now] * len(ids))
                        res.finish_reason = choice.get("finish_reason") or res.finish_reason
                    if chunk.get("usage"):
                        res.num_prompt_tokens = chunk["usage"]["prompt_tokens"]
    except Exception as err:  # noqa: BLE001 - connection errors: reported per request, like gRPC's
        res.error = f"{type(err).__name__}: {err}"
    res.end_time = time.monotonic() - t0
    return res


async def _run_load_http(target: str, requests: Sequence[LoadRequest], request_timeout: float | None,
                         prefix: str) -> list[ClientRequestResult]:
    import httpx2

    limits = httpx2.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx2.AsyncClient(base_url=target, timeout=request_timeout, limits=limits) as client:
        t0 = time.monotonic()
        return list(await asyncio.gather(*(
            _one_http(client, i, float(arrival), prompt, params, t0, prefix)
            for i, (arrival, prompt, params) in enumerate(requests))))


async def run_load_async(target: str, requests: Sequence[LoadRequest], *, request_timeout: float | None = None,
                         channel_options: Sequence[tuple[str, Any]] | None = None,
                         request_id_prefix: str | None = None) -> list[ClientRequestResult]:
    """Send `requests` = [(arrival_time_s, prompt_token_ids_or_text, SamplingParams), ...] to `target`
    ("host:port") concurrently, each at its arrival time; return one ClientRequestResult per request, in input
    order. `request_timeout` is each RPC's deadline in seconds (None: none). A target `http://HOST:PORT` is
    driven over the OpenAI-compatible HTTP API instead (channel_options do not apply)."""
    prefix = request_id_prefix or f"load-{uuid.uuid4().hex[:8]}"
    if is_http(target):
        return await _run_load_http(target, requests, request_timeout, prefix)
    async with grpc.aio.insecure_channel(target, options=list(channel_options or [])) as channel:
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
def _server_info(target: str) -> tuple[Any, Any]:
    """(model info, stats) with the fields the bench reads: GetModelInfo / GetStats over gRPC; over HTTP the
    /v1/models card's `sarathi` info and /metrics (no block count there: num_total_blocks is 0)."""
    from server.proto.sarathi.v1 import generation_pb2 as pb

    if is_http(target):
        import httpx2
        from prometheus_client.parser import text_string_to_metric_families

        with httpx2.Client(base_url=target, timeout=30) as client:
            card = client.get("/v1/models").raise_for_status().json()["data"][0]
            metrics = client.get("/metrics").raise_for_status().text
        preemptions = sum(s.value for family in text_string_to_metric_families(metrics)
                          for s in family.samples if s.name == "sarathi:num_preemptions_total")
        return pb.ModelInfo(**card["sarathi"]), pb.Stats(num_preemptions=int(preemptions))

    with grpc.insecure_channel(target) as channel:
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
                       progress: bool = False, request_timeout: float | None = None) -> Any:
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

    info, before = _server_info(target)
    notes: list[str] = []
    vocab = int(info.vocab_size) or None
    prompts = [list(map(int, p)) for p in prompts]
    if vocab is not None and any(t >= vocab for p in prompts for t in p):
        prompts = [[t % vocab for t in p] for p in prompts]
        notes.append(f"prompt token ids folded into the server model's vocabulary ({vocab})")
    requests = workload_requests(workload, prompts, temperature)
    t_wall = time.monotonic()
    results = run_load(target, requests, request_timeout=request_timeout)
    wall = time.monotonic() - t_wall
    _, after = _server_info(target)
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
    """`python -m server.loadgen --bench-job JOB --bench-result RESULT`: what `python -m sarathi_jax.bench
    --endpoint` runs in a child process (`sarathi_jax.bench.endpoint`): replay the job's requests against its
    endpoint and write the run as JSON; a failure is one line on stderr and exit status 1."""
    import argparse
    import sys
    from pathlib import Path

    from sarathi_jax.bench.endpoint import job_workload

    parser = argparse.ArgumentParser(prog="python -m server.loadgen", description=main.__doc__.split(":")[0])
    parser.add_argument("--bench-job", required=True, help="the requests (sarathi_jax.bench.endpoint.bench_job)")
    parser.add_argument("--bench-result", required=True, help="where to write the run (RunResult.to_json)")
    args = parser.parse_args(argv)
    job = json.loads(Path(args.bench_job).read_text())
    try:
        run = run_bench_workload(job["endpoint"], job_workload(job), job["prompts"], temperature=job["temperature"])
    except Exception as e:  # noqa: BLE001 - connection failures etc.: one clear line for the bench
        print(f"{type(e).__name__}: {e or 'no details'}", file=sys.stderr)
        return 1
    Path(args.bench_result).write_text(json.dumps(run.to_json()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
