"""The soak (`python -m benchmarks.soak`, benchmarks/soak.py): a minute of mixed traffic against its own
`python -m server` on the tiny test Llama (with a tokenizer and a chat template, so text and chat requests are
in the mix), which must end with 0 errors, 0 requests and 0 KV blocks left and memory within 5%; and its
checks, which must fail on what they guard against."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys

from tests.server.grpc_test_utils import ENGINE_KW, PLAIN_CHAT_TEMPLATE
from sarathi_jax.bench.load_client import ClientRequestResult
from benchmarks.soak import SoakConfig, SoakReport, judge, outcome, plan_phase
from benchmarks.soak_server import REPO_ROOT, ServerSnapshot, ServerTraits

TRAITS = ServerTraits(routes=("grpc", "http"), vocab_size=256, max_model_len=256, has_tokenizer=True,
                      has_chat_template=True)


def test_a_minute_of_soak_leaves_nothing_behind(hf_checkpoint, tmp_path):
    model = shutil.copytree(hf_checkpoint("llama"), tmp_path / "llama")
    (model / "chat_template.jinja").write_text(PLAIN_CHAT_TEMPLATE)
    server_args = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in ENGINE_KW.items())
    out, log = tmp_path / "soak.json", tmp_path / "server.log"
    cmd = [sys.executable, "-m", "benchmarks.soak", "--model", str(model), "--server-args", server_args,
           "--duration", "60", "--warmup", "15", "--burst-interval", "20", "--burst-size", "48",
           "--json", str(out), "--server-log", str(log)]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\n{log.read_text()[-3000:]}"
    report = json.loads(out.read_text())
    counts, end = report["counts"], report["snapshots"]["end"]
    assert report["ok"] and all(check["passed"] for check in report["checks"]), report["checks"]
    assert counts["errored"] == 0, report["errors"]
    assert (end["engine_requests"], end["server_requests"], end["kv_blocks_in_use"]) == (0, 0, 0)
    assert report["memory_growth"] is not None and report["memory_growth"] <= 0.05
    assert counts["sent"] == sum(counts[o] for o in ("completed", "cancelled", "refused", "errored"))
    outside_bursts = counts["sent"] - report["burst"]["sent"]
    assert counts["completed"] > 100 and 0.15 <= counts["cancelled"] / outside_bursts <= 0.35
    assert 0 < report["burst"]["refused"] < report["burst"]["sent"] == 48 * 3  # one in the warm-up, two after it
    assert {"grpc stream", "grpc unary", "http completions stream", "http completions unary", "http chat stream",
            "http chat unary"} <= set(report["by_kind"])
    assert "soak passed" in proc.stdout


def test_the_plan_mixes_protocols_cancellations_slow_readers_and_bursts():
    config = SoakConfig(rate=20.0, burst_size=10, burst_interval_s=30.0)
    plan = plan_phase(config, TRAITS, 60.0, random.Random(0))
    bursts = [r for r in plan if r.burst]
    assert sorted({r.arrival for r in bursts}) == [15.0, 45.0] and len(bursts) == 20
    steady = [r for r in plan if not r.burst]
    assert 1000 < len(steady) < 1400  # Poisson at 20/s for 60 s
    cancelled = [r for r in steady if r.behaviour.cancel_after_tokens or r.behaviour.cancel_after_s]
    assert 0.2 < len(cancelled) / len(steady) < 0.3
    assert all(r.behaviour.cancel_after_tokens < r.params.max_tokens for r in cancelled if r.behaviour.stream)
    assert any(r.behaviour.read_delay_s > 0 for r in steady)
    assert {r.kind for r in plan} == {"grpc stream", "grpc unary", "http completions stream", "http completions unary",
                                      "http chat stream", "http chat unary"}
    assert all(isinstance(r.prompt, str) for r in plan if r.behaviour.chat)
    assert plan == plan_phase(config, TRAITS, 60.0, random.Random(0))  # seeded


def _result(**fields) -> ClientRequestResult:
    return ClientRequestResult(index=0, request_id="r", arrival_time=0.0, send_time=0.0, num_prompt_tokens=1, **fields)


def test_outcomes():
    assert outcome(_result(finish_reason="length")) == "completed"
    assert outcome(_result(cancelled=True)) == "cancelled"
    assert outcome(_result(error="RESOURCE_EXHAUSTED: server overloaded")) == "refused"
    assert outcome(_result(error="HTTP 429: server overloaded")) == "refused"
    assert outcome(_result(error="HTTP 500: internal error")) == "errored"
    assert outcome(_result(error="DEADLINE_EXCEEDED: Deadline Exceeded")) == "errored"
    assert outcome(_result(finish_reason="abort")) == "errored"  # aborted, and not by this client
    assert outcome(_result()) == "errored"  # a stream that ended without finishing


def _report(end: ServerSnapshot, errored: int = 0, burst_refused: int = 5, burst_size: int = 64) -> SoakReport:
    report = SoakReport(SoakConfig(burst_size=burst_size), {"grpc": "127.0.0.1:1"}, TRAITS)
    report.counts = {"sent": 10, "completed": 10 - errored, "cancelled": 0, "refused": 0, "errored": errored}
    report.burst = {"sent": 8, "refused": burst_refused}
    idle = ServerSnapshot(0, 0, 0, 0.0, 1000)
    report.snapshots = {"start": idle, "after_warmup": idle, "end": end}
    judge(report)
    return report


def test_each_check_fails_on_what_it_guards_against():
    def failed(report: SoakReport) -> list[str]:
        return [name for name, passed, _ in report.checks if passed is False]

    assert failed(_report(ServerSnapshot(0, 0, 0, 0.0, 1040))) == []
    assert failed(_report(ServerSnapshot(0, 0, 0, 0.0, 1000), errored=1)) == ["no errors"]
    assert failed(_report(ServerSnapshot(0, 1, 0, 0.0, 1000))) == ["no leaked requests"]
    assert failed(_report(ServerSnapshot(1, 0, 2, 0.01, 1000))) == ["no leaked requests", "no KV blocks in use"]
    assert failed(_report(ServerSnapshot(0, 0, 0, 0.0, 1060))) == ["memory flat"]
    assert failed(_report(ServerSnapshot(0, 0, 0, 0.0, 1000), burst_refused=0)) == ["the bursts were refused in part"]
    def skipped(report: SoakReport) -> list[str]:
        return [name for name, passed, _ in report.checks if passed is None]

    unmeasured = _report(ServerSnapshot(0, 0, 0, 0.0, None))
    assert unmeasured.ok and skipped(unmeasured) == ["memory flat"]
    no_bursts = _report(ServerSnapshot(0, 0, 0, 0.0, 1000), burst_refused=0, burst_size=0)
    assert no_bursts.ok and skipped(no_bursts) == ["the bursts were refused in part"]
