"""`python -m benchmarks.soak`: minutes of mixed traffic against one server, then checks that nothing
leaked and that memory stayed flat.

    python -m benchmarks.soak --duration 600                  # starts its own server on tiny-llama
    python -m benchmarks.soak --model DIR --server-args "--max-num-seqs 16"
    python -m benchmarks.soak --grpc 127.0.0.1:8033 --http http://127.0.0.1:8000 --burst-size 2048

Traffic (seeded, Poisson arrivals at `--rate` per second) goes over gRPC (`Generate` streamed, `Complete`) and
HTTP (`/v1/completions`, `/v1/chat/completions` when the model has a chat template; streamed or not), as token
ids or text (when the model has a tokenizer). `--cancel-fraction` of the requests are cancelled by the client
mid-way (a stream after some of its tokens, a unary request after a fraction of a second); `--slow-fraction` of
the streams are read slowly; every `--burst-interval` seconds `--burst-size` requests arrive at once, more than
the server's queue bound (`--max-waiting-requests`), so that some are refused (429 / RESOURCE_EXHAUSTED).
Each request is sent by sarathi_jax/bench/load_client.py; the server is read by benchmarks/soak_server.py.

Memory: the first `--warmup` seconds are the same traffic, after which the server is let go idle and its
resident memory is the baseline; at the end, idle again, it is compared with that baseline. One-time costs
(allocator arenas and buffers growing to their working size, lazily built paths) land in the warm-up; a leak
grows with the requests served after it. The figure at start (before any traffic) is reported too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc

from sarathi_jax.utils.percentiles import percentiles
from sarathi_jax.request.sampling_params import SamplingParams
from sarathi_jax.bench.load_client import (ClientBehaviour, ClientRequestResult, http_client, http_pool_limits,
                                           new_result, send_grpc, send_http)
from server.proto.sarathi.v1 import generation_pb2_grpc as pb_grpc
from server.security import API_KEY_ENV, ClientSecurity, api_key_from, grpc_aio_channel
from benchmarks.soak_server import LocalServer, ServerProbe, ServerSnapshot, ServerTraits, read_traits

OUTCOMES = ("completed", "cancelled", "refused", "errored")
_WORDS = ("the quick brown fox jumps over the lazy dog hello world how are you today once upon a time there was "
          "a tiny model that predicted the next token").split()


@dataclass(frozen=True)
class SoakConfig:
    duration_s: float = 600.0  # traffic in all, warm-up included
    warmup_s: float | None = None  # None: a quarter of duration_s, at most 60 s
    rate: float = 5.0  # mean arrivals per second (Poisson), bursts not counted
    cancel_fraction: float = 0.25
    slow_fraction: float = 0.1  # of the streamed requests not cancelled
    burst_size: int = 64
    burst_interval_s: float = 60.0
    max_tokens: int = 48
    max_prompt_tokens: int = 48
    request_timeout_s: float = 120.0  # a request still unanswered then is an error (a hang)
    settle_timeout_s: float = 30.0  # after the traffic, how long the server may take to free everything
    max_memory_growth: float = 0.05
    seed: int = 0

    @property
    def warmup(self) -> float:
        return self.warmup_s if self.warmup_s is not None else min(60.0, self.duration_s / 4)


@dataclass(frozen=True)
class SoakRequest:
    arrival: float  # seconds after the phase's start
    route: str
    prompt: str | list[int]
    params: SamplingParams
    behaviour: ClientBehaviour
    burst: bool

    @property
    def kind(self) -> str:
        """e.g. "http chat stream", "grpc unary"."""
        api = ("chat" if self.behaviour.chat else "completions") if self.route == "http" else ""
        return " ".join(filter(None, (self.route, api, "stream" if self.behaviour.stream else "unary")))


def _request(rng: random.Random, arrival: float, config: SoakConfig, traits: ServerTraits, burst: bool) -> SoakRequest:
    route = rng.choice(traits.routes)
    chat = route == "http" and traits.has_chat_template and rng.random() < 0.5
    top_tokens = max(4, min(config.max_tokens, traits.max_model_len // 4))
    top_prompt = max(2, min(config.max_prompt_tokens, traits.max_model_len // 4))
    prompt: str | list[int]
    if chat or (traits.has_tokenizer and rng.random() < 0.5):  # a word is at most a few tokens
        prompt = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, max(1, top_prompt // 4))))
    else:
        prompt = [rng.randrange(3, traits.vocab_size) for _ in range(rng.randint(2, top_prompt))]
    stream = burst or rng.random() < 0.7
    cancel = not burst and rng.random() < config.cancel_fraction
    max_tokens = 8 if burst else (top_tokens if cancel and not stream else rng.randint(4, top_tokens))
    params = SamplingParams(max_tokens=max_tokens, temperature=rng.choice((0.0, 0.8)), ignore_eos=True,
                            logprobs=2 if rng.random() < 0.1 else None)
    if cancel:
        behaviour = (ClientBehaviour(stream=True, chat=chat, cancel_after_tokens=rng.randint(1, max_tokens - 1))
                     if stream else ClientBehaviour(stream=False, chat=chat, cancel_after_s=rng.uniform(0.02, 0.3)))
    elif stream and not burst and rng.random() < config.slow_fraction:
        behaviour = ClientBehaviour(stream=True, chat=chat, read_delay_s=rng.uniform(0.05, 0.2))
    else:
        behaviour = ClientBehaviour(stream=stream, chat=chat)
    return SoakRequest(arrival, route, prompt, params, behaviour, burst)


def plan_phase(config: SoakConfig, traits: ServerTraits, length_s: float, rng: random.Random) -> list[SoakRequest]:
    """One phase's requests: Poisson arrivals, plus a burst every `burst_interval_s` (at half an interval, one
    and a half, ...; one in the middle of a phase too short for that)."""
    plan, t = [], rng.expovariate(config.rate)
    while t < length_s:
        plan.append(_request(rng, t, config, traits, burst=False))
        t += rng.expovariate(config.rate)
    bursts = [config.burst_interval_s * (k + 0.5) for k in range(int(length_s / config.burst_interval_s + 0.5))]
    for at in bursts or [length_s / 2]:
        plan.extend(_request(rng, at, config, traits, burst=True) for _ in range(config.burst_size))
    return sorted(plan, key=lambda r: r.arrival)


def outcome(r: ClientRequestResult) -> str:
    if r.cancelled:
        return "cancelled"
    if r.refused:
        return "refused"
    return "completed" if r.error is None and r.finish_reason in ("stop", "length") else "errored"


@dataclass
class SoakReport:
    config: SoakConfig
    targets: dict[str, str | None]
    traits: ServerTraits
    counts: dict[str, int] = field(default_factory=dict)  # sent, completed, cancelled, refused, errored
    by_kind: dict[str, dict[str, int]] = field(default_factory=dict)
    burst: dict[str, int] = field(default_factory=dict)  # sent, refused
    latency_s: dict[str, dict] = field(default_factory=dict)  # refusal, completion: percentiles()
    snapshots: dict[str, ServerSnapshot] = field(default_factory=dict)  # start, after_warmup, end
    rss_peak_bytes: int | None = None
    errors: list[str] = field(default_factory=list)  # the first distinct error messages
    server_exit_status: int | None = None  # when the soak started the server
    wall_s: float = 0.0
    checks: list[tuple[str, bool | None, str]] = field(default_factory=list)  # name, passed (None: skipped), what

    @property
    def memory_growth(self) -> float | None:
        base, end = self.snapshots.get("after_warmup"), self.snapshots.get("end")
        if base is None or end is None or not base.rss_bytes or end.rss_bytes is None:
            return None
        return end.rss_bytes / base.rss_bytes - 1.0

    @property
    def ok(self) -> bool:
        return all(passed is not False for _, passed, _ in self.checks)

    def to_json(self) -> dict[str, Any]:
        return {"config": asdict(self.config), "targets": self.targets, "traits": asdict(self.traits),
                "counts": self.counts, "by_kind": self.by_kind, "burst": self.burst, "latency_s": self.latency_s,
                "snapshots": {k: s.to_json() for k, s in self.snapshots.items()}, "rss_peak_bytes": self.rss_peak_bytes,
                "memory_growth": self.memory_growth, "errors": self.errors,
                "server_exit_status": self.server_exit_status, "wall_s": self.wall_s,
                "checks": [{"name": n, "passed": p, "detail": d} for n, p, d in self.checks], "ok": self.ok}


def tally(report: SoakReport, plan: Sequence[SoakRequest], results: Sequence[ClientRequestResult]) -> None:
    counts: Counter[str] = Counter()
    for req, r in zip(plan, results):
        o = outcome(r)
        counts[o] += 1
        report.by_kind.setdefault(req.kind, dict.fromkeys(("sent", *OUTCOMES), 0))
        report.by_kind[req.kind]["sent"] += 1
        report.by_kind[req.kind][o] += 1
        if req.burst:
            report.burst["sent"] = report.burst.get("sent", 0) + 1
            report.burst["refused"] = report.burst.get("refused", 0) + (o == "refused")
        if o == "errored" and len(report.errors) < 10:
            message = r.error or f"finish_reason={r.finish_reason}"
            if message not in report.errors:
                report.errors.append(message)
    report.counts = {"sent": len(results), **{o: counts[o] for o in OUTCOMES}}
    report.latency_s = {
        "refusal": percentiles([r.e2e_latency for r in results if outcome(r) == "refused"], (50, 99)),
        "completion": percentiles([r.e2e_latency for r in results if outcome(r) == "completed"], (50, 99)),
    }


def _count(n: int | None) -> str:
    return "n/a" if n is None else str(n)  # None: this server does not say (no gRPC GetStats)


def judge(report: SoakReport) -> None:
    """The checks: no error, nothing left in flight or holding KV blocks, memory within bounds, refusals seen."""
    c, end, refused = report.counts, report.snapshots["end"], report.burst.get("refused", 0)
    report.checks = [
        ("no errors", c["errored"] == 0, f"{c['errored']} errored (5xx, protocol errors, hangs)"),
        ("no leaked requests", end.engine_requests == 0 and not end.server_requests,
         f"{end.engine_requests} in the engine, {_count(end.server_requests)} in the server after the traffic"),
        ("no KV blocks in use", not end.kv_blocks_in_use and end.kv_usage == 0,
         f"{_count(end.kv_blocks_in_use)} blocks in use (kv usage {end.kv_usage:.4f}) after the traffic"),
        ("the bursts were refused in part", refused > 0 if report.config.burst_size else None,
         f"{refused} of {report.burst.get('sent', 0)} burst requests refused"
         + ("" if refused else " (is --burst-size above the server's --max-waiting-requests?)")
         if report.config.burst_size else "no bursts (--burst-size 0)"),
    ]
    growth = report.memory_growth
    limit = report.config.max_memory_growth
    report.checks.append(("memory flat", None if growth is None else growth <= limit,
                          "not measured (no process_resident_memory_bytes: give --metrics)" if growth is None
                          else f"{growth:+.2%} from after the warm-up to the end (limit {limit:.0%})"))
    if report.server_exit_status is not None or "model" in report.targets:
        report.checks.append(("the server drained and exited 0", report.server_exit_status == 0,
                              f"exit status {report.server_exit_status}"))


def format_report(report: SoakReport) -> str:
    def mib(b: int | None) -> str:
        return "n/a" if b is None else f"{b / 2**20:.0f} MiB"

    def ms(stats: dict) -> str:
        if not stats["count"]:
            return "none"
        return f"p50 {stats['p50'] * 1e3:.0f} ms, p99 {stats['p99'] * 1e3:.0f} ms (n={stats['count']})"

    c, snaps, cfg = report.counts, report.snapshots, report.config
    lines = [f"soak: {cfg.duration_s:.0f} s of traffic ({cfg.warmup:.0f} s warm-up) against "
             + ", ".join(f"{k} {v}" for k, v in report.targets.items() if v) + f"; {report.wall_s:.0f} s in all",
             "requests: " + ", ".join(f"{k} {c[k]}" for k in ("sent", *OUTCOMES))
             + f" ({c['cancelled'] / max(1, c['sent'] - report.burst.get('sent', 0)):.0%} of those outside bursts "
             f"cancelled); bursts: {report.burst.get('refused', 0)} of {report.burst.get('sent', 0)} refused"]
    lines += [f"  {kind:26s} " + " ".join(f"{k} {v}" for k, v in n.items())
              for kind, n in sorted(report.by_kind.items())]
    lines += [f"latency: refusals {ms(report.latency_s['refusal'])}; completions {ms(report.latency_s['completion'])}",
              f"after the traffic: {snaps['end'].engine_requests} requests in the engine, "
              f"{_count(snaps['end'].server_requests)} in the server, {_count(snaps['end'].kv_blocks_in_use)} KV "
              "blocks in use",
              f"resident memory: start {mib(snaps['start'].rss_bytes)}, after warm-up "
              f"{mib(snaps['after_warmup'].rss_bytes)}, end {mib(snaps['end'].rss_bytes)}, peak "
              f"{mib(report.rss_peak_bytes)}"]
    lines += [f"errors: {e}" for e in report.errors]
    lines += [f"[{'PASS' if p else 'FAIL' if p is False else 'SKIP'}] {name}: {detail}"
              for name, p, detail in report.checks]
    lines.append("soak " + ("passed" if report.ok else "FAILED"))
    return "\n".join(lines)


async def _settle(probe: ServerProbe, timeout_s: float) -> ServerSnapshot:
    """The server's state once it is idle, or when `timeout_s` has passed."""
    deadline = time.monotonic() + timeout_s
    snap = await probe.snapshot()
    while not snap.idle and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        snap = await probe.snapshot()
    return snap


async def run_soak(config: SoakConfig, grpc_target: str | None, http_target: str | None, metrics_url: str | None,
                   report_targets: dict[str, str | None], security: ClientSecurity = ClientSecurity()) -> SoakReport:
    """Drive the traffic against a running server (a gRPC "HOST:PORT" and/or an HTTP "http://HOST:PORT"), read the
    server through `metrics_url` (its /metrics) and GetStats, sending `security`'s API key; the report has no
    checks yet (`judge`)."""
    t_wall = time.monotonic()
    routes = tuple(r for r, t in (("grpc", grpc_target), ("http", http_target)) if t)
    rng = random.Random(config.seed)
    probe = ServerProbe(grpc_target, metrics_url, security)
    http = (http_client(http_target, security, timeout=config.request_timeout_s, limits=http_pool_limits())
            if http_target else None)
    channel = grpc_aio_channel(grpc_target, security) if grpc_target else None
    stub = pb_grpc.GenerationStub(channel) if channel is not None else None
    rss_peak = 0
    try:
        report = SoakReport(config, report_targets, await read_traits(routes, http, stub))
        report.snapshots["start"] = await probe.snapshot()
        all_plans: list[SoakRequest] = []
        all_results: list[ClientRequestResult] = []
        for phase, length in (("after_warmup", config.warmup), ("end", config.duration_s - config.warmup)):
            plan = plan_phase(config, report.traits, length, rng)
            t0 = time.monotonic()

            async def send(i: int, req: SoakRequest) -> ClientRequestResult:
                await asyncio.sleep(max(0.0, t0 + req.arrival - time.monotonic()))
                res = new_result(i, f"soak-{phase}-{i}", req.arrival, t0)
                if req.route == "grpc":
                    await send_grpc(stub, res, req.prompt, req.params, t0, req.behaviour, config.request_timeout_s)
                else:
                    await send_http(http, res, req.prompt, req.params, t0, req.behaviour)
                return res

            traffic = asyncio.ensure_future(asyncio.gather(*(send(i, r) for i, r in enumerate(plan))))
            while not traffic.done():  # the peak memory, sampled while the traffic runs
                rss_peak = max(rss_peak, (await probe.snapshot()).rss_bytes or 0)
                await asyncio.wait({traffic}, timeout=5.0)
            all_plans += plan
            all_results += traffic.result()
            report.snapshots[phase] = await _settle(probe, config.settle_timeout_s)
        tally(report, all_plans, all_results)
        report.rss_peak_bytes = rss_peak or None
    finally:
        await probe.close()
        if http is not None:
            await http.aclose()
        if channel is not None:
            await channel.close()
    report.wall_s = time.monotonic() - t_wall
    return report


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    own = p.add_argument_group("the server it starts (when neither --grpc nor --http is given)")
    own.add_argument("--model", default="tiny-llama", help="model preset or folder for `python -m server`")
    own.add_argument("--max-waiting-requests", type=int, default=16, help="the server's queue bound")
    own.add_argument("--server-args", default="", help='more `python -m server` flags, e.g. "--max-num-seqs 16"')
    own.add_argument("--server-log", default=None, help="where the server's output goes (default: a temp file)")
    running = p.add_argument_group("a running server")
    running.add_argument("--grpc", default=None, metavar="HOST:PORT")
    running.add_argument("--http", default=None, metavar="http://HOST:PORT")
    running.add_argument("--metrics", default=None, metavar="URL",
                         help="its Prometheus endpoint (default: the --http server's /metrics)")
    d = SoakConfig()
    for name, help_ in (("duration_s", "seconds of traffic, warm-up included"), ("warmup_s", "seconds (default: "
                        "a quarter of --duration, at most 60)"), ("rate", "mean requests per second"),
                        ("cancel_fraction", None), ("slow_fraction", None), ("burst_size", None),
                        ("burst_interval_s", None), ("max_tokens", None), ("max_prompt_tokens", None),
                        ("request_timeout_s", None), ("settle_timeout_s", None), ("max_memory_growth", None),
                        ("seed", None)):
        flag = "--" + name.removesuffix("_s").replace("_", "-")
        kind = int if isinstance(getattr(d, name), int) else float
        p.add_argument(flag, dest=name, type=kind, default=getattr(d, name), help=help_ or "(default %(default)s)",
                       metavar="SECONDS" if name.endswith("_s") else "N")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the report as JSON")
    p.add_argument("--api-key", default=None, help="the API key: sent to a running server; the server it starts "
                                                   f"requires it (default: ${API_KEY_ENV}, else none)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Exit status 0 when every check passed, 1 when one failed, 2 when the soak could not run."""
    args = build_parser().parse_args(argv)
    config = SoakConfig(**{k: getattr(args, k) for k in SoakConfig.__dataclass_fields__})
    security = ClientSecurity(api_key=api_key_from(args.api_key))
    try:
        if args.grpc or args.http:
            metrics = args.metrics or (f"{args.http}/metrics" if args.http else None)
            targets = {"grpc": args.grpc, "http": args.http}
            report = asyncio.run(run_soak(config, args.grpc, args.http, metrics, targets, security))
        else:
            log = Path(args.server_log or tempfile.mkstemp(prefix="soak-server-", suffix=".log")[1])
            server_args = ["--max-waiting-requests", str(args.max_waiting_requests), *shlex.split(args.server_args)]
            print(f"starting python -m server --model {args.model} (log: {log})", file=sys.stderr, flush=True)
            with LocalServer(args.model, server_args, log, api_key=security.api_key) as server:
                targets = {"model": args.model, "grpc": server.grpc_target, "http": server.http_target}
                report = asyncio.run(run_soak(config, server.grpc_target, server.http_target,
                                              f"{server.http_target}/metrics", targets, security))
            report.server_exit_status = server.exit_status
    except (OSError, RuntimeError, grpc.RpcError) as exc:
        print(f"soak could not run: {exc}", file=sys.stderr)
        return 2
    judge(report)
    print(format_report(report), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_json(), indent=1))
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
