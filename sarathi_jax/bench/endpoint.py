"""`--endpoint`: the bench drives a running server as any client does. The load driver (`python -m
sarathi_jax.bench.loadgen --bench-job JOB --bench-result RESULT`) runs in a child process and talks gRPC or HTTP to the
server; the bench hands it the requests and reads back the run as JSON, and imports nothing of the server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from sarathi_jax.bench.driver import RunResult
from sarathi_jax.bench.workload import Workload

LOAD_DRIVER = "sarathi_jax.bench.loadgen"  # the module the child process runs


class EndpointError(RuntimeError):
    """The load driver could not run the requests against the server (its last line of stderr says why)."""


def bench_job(endpoint: str, workload: Workload, prompts: list[list[int]], temperature: float) -> dict:
    """What the load driver needs to replay `workload` (see `sarathi_jax.bench.loadgen.run_bench_workload`)."""
    return {"endpoint": endpoint, "arrivals": workload.arrivals.tolist(), "prompt_lens": workload.prompt_lens.tolist(),
            "output_lens": workload.output_lens.tolist(), "prompts": [list(map(int, p)) for p in prompts],
            "temperature": temperature}


def job_workload(job: dict) -> Workload:
    """The workload of a `bench_job`, as the load driver rebuilds it."""
    return Workload(job["arrivals"], job["prompt_lens"], job["output_lens"])


def run_endpoint(endpoint: str, workload: Workload, prompts: list[list[int]], temperature: float = 0.0) -> RunResult:
    """Replay `workload` against the server at `endpoint` through the load driver in a child process (with this
    interpreter and its import path). Raises EndpointError when the driver fails."""
    with tempfile.TemporaryDirectory(prefix="sarathi-bench-endpoint-") as tmp:
        job, result = Path(tmp, "job.json"), Path(tmp, "result.json")
        job.write_text(json.dumps(bench_job(endpoint, workload, prompts, temperature)))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        proc = subprocess.run([sys.executable, "-m", LOAD_DRIVER, "--bench-job", str(job), "--bench-result",
                               str(result)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if proc.returncode != 0 or not result.exists():
            lines = proc.stderr.strip().splitlines()
            raise EndpointError(lines[-1] if lines else f"python -m {LOAD_DRIVER} exited with {proc.returncode}")
        return RunResult.from_json(json.loads(result.read_text()))
