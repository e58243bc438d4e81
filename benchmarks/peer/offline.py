"""The offline part of `python -m benchmarks.peer`: every request at t=0, total tokens per second.

This engine runs in this process (`LLMEngine`, fully compiled before the clock starts, driven by the bench's
`run_workload`); vLLM runs `vllm.LLM.generate` in a subprocess of its own interpreter
(`vllm_offline.py`). Both first run the same two warm-up requests, then time passes over the same
requests: prompt + generated tokens over the wall time of a pass (start-up excluded). With several passes
(`--repeats`) both engines stay up and their passes alternate (A B B A A B ...: neither always goes first),
one engine running at a time, and each reports its median pass: on a shared or throttling machine a single
pass of each, minutes apart, gave ratios that moved by a third.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from sarathi_jax.bench.args import BenchError
from benchmarks.peer.servers import EngineSettings, vllm_engine_kwargs
from benchmarks.peer.workloads import warmup_workload
from sarathi_jax.bench.workload import Workload
from sarathi_jax.engine.gc_heap import startup_heap_frozen

VLLM_SCRIPT = Path(__file__).with_name("vllm_offline.py")


@dataclass(frozen=True)
class OfflineResult:
    engine: str
    num_requests: int
    num_completed: int
    prompt_tokens: int
    output_tokens: int
    wall_s: float  # the median pass's
    startup_s: float | None = None
    passes: tuple[float, ...] = field(default=())  # every pass's wall time, in the order they ran

    @classmethod
    def of_passes(cls, engine: str, num_requests: int, num_completed: int, prompt_tokens: int, output_tokens: int,
                  passes: list[float], startup_s: float | None) -> OfflineResult:
        median = sorted(passes)[(len(passes) - 1) // 2]  # the lower middle one of an even count
        return cls(engine, num_requests, num_completed, prompt_tokens, output_tokens, median, startup_s,
                   tuple(passes))

    @property
    def total_tokens_per_s(self) -> float | None:
        return (self.prompt_tokens + self.output_tokens) / self.wall_s if self.wall_s > 0 else None

    @property
    def output_tokens_per_s(self) -> float | None:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else None

    def to_dict(self) -> dict:
        tokens = self.prompt_tokens + self.output_tokens
        return {**asdict(self), "passes": list(self.passes), "total_tokens_per_s": self.total_tokens_per_s,
                "output_tokens_per_s": self.output_tokens_per_s,
                "passes_total_tokens_per_s": [tokens / w if w > 0 else None for w in self.passes]}


def sarathi_engine_config(s: EngineSettings):
    from sarathi_jax.config.engine_config import EngineConfig

    return EngineConfig(model=s.model, scheduler="sarathi", dtype="float32", token_budget=s.token_budget,
                        slo_tbt_s=s.slo_tbt_s, max_token_budget=s.max_token_budget, max_num_seqs=s.max_num_seqs,
                        max_model_len=s.max_model_len, kv_cache_bytes=s.kv_cache_bytes, enable_prefix_caching=False,
                        seed=s.seed, quantization=s.quantization)


class SarathiOffline:
    """This engine, built (every executable) and warmed up once; `run_pass()` times one pass of the requests."""

    def __init__(self, s: EngineSettings, workload: Workload, prompts: list[list[int]]) -> None:
        from sarathi_jax.bench.driver import run_workload
        from sarathi_jax.factory import build_engine

        t0 = time.monotonic()
        self.engine = build_engine(sarathi_engine_config(s))
        self.engine.wait_until_compiled()  # every executable built before anything is timed
        self.startup_s = time.monotonic() - t0
        warm = warmup_workload()
        run_workload(self.engine, warm, warm.prompts(self.engine.model_config.vocab_size, s.seed), id_prefix="warmup-")
        self.workload, self.prompts, self.walls, self.counts = workload, prompts, [], None
        self._frozen_heap = contextlib.ExitStack()  # no GC pass walks the start-up heap while timed (gc_heap.py)
        self._frozen_heap.enter_context(startup_heap_frozen())

    def run_pass(self) -> float:
        from sarathi_jax.bench.driver import run_workload

        run = run_workload(self.engine, self.workload, self.prompts, label="sarathi-jax offline",
                           id_prefix=f"offline{len(self.walls)}-")
        done = [r for r in run.records if r.completed]
        self.counts = (len(run.records), len(done), sum(r.prompt_len for r in done),
                       sum(r.num_output_tokens for r in done))
        self.walls.append(run.wall_time)
        return run.wall_time

    def finish(self) -> OfflineResult:
        self.engine = None
        self._frozen_heap.close()  # unfreezes and collects: frees the weights and KV cache
        return OfflineResult.of_passes("sarathi-jax", *self.counts, self.walls, self.startup_s)


def run_sarathi_offline(s: EngineSettings, workload: Workload, prompts: list[list[int]]) -> OfflineResult:
    """One timed pass of this engine alone."""
    run = SarathiOffline(s, workload, prompts)
    run.run_pass()
    return run.finish()


def vllm_spec(s: EngineSettings, workload: Workload, prompts: list[list[int]], vocab_size: int) -> dict:
    """What vllm_offline.py runs: vllm.LLM's arguments, the same requests and the same warm-up."""
    warm = warmup_workload()
    return {
        "engine": vllm_engine_kwargs(s),
        "prompts": [list(map(int, p)) for p in prompts],
        "max_tokens": [int(n) for n in workload.output_lens],
        "warmup_prompts": warm.prompts(vocab_size, s.seed),
        "warmup_max_tokens": [int(n) for n in warm.output_lens],
    }


class VllmOffline:
    """vllm_offline.py under `python` (from a scratch directory: see its docstring), kept up for
    `spec["passes"]` passes, each started by `run_pass()`; the constructor returns once vLLM is warm."""

    def __init__(self, python: str, spec: dict, env: dict[str, str], log_dir: Path, timeout: float) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path, self.timeout = log_dir / "vllm-offline.log", timeout
        self._scratch = tempfile.TemporaryDirectory(prefix="peer-vllm-")
        spec_path, self._out_path = Path(self._scratch.name, "spec.json"), Path(self._scratch.name, "out.json")
        spec_path.write_text(json.dumps(spec))
        go_r, self._go = os.pipe()
        self._done, done_w = os.pipe()
        with open(self.log_path, "w") as log:
            self._proc = subprocess.Popen(
                [python, "-c", VLLM_SCRIPT.read_text(), str(spec_path), str(self._out_path), str(go_r), str(done_w)],
                cwd=self._scratch.name, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT,
                pass_fds=(go_r, done_w))
        os.close(go_r)
        os.close(done_w)  # ours closed: EOF on `_done` once the script exits
        self._wait_for("ready")

    def _wait_for(self, what: str) -> None:
        ready, _, _ = select.select([self._done], [], [], self.timeout)
        line = os.read(self._done, 4096).decode() if ready else ""
        if not line.startswith(what):
            self._fail("timed out" if not ready else f"stopped before it said {what!r}")

    def _fail(self, why: str) -> None:
        self._proc.kill()
        self._proc.wait()
        tail = "\n".join(self.log_path.read_text(errors="replace").splitlines()[-30:])
        raise BenchError(f"vLLM's offline run {why} (status {self._proc.returncode}); log {self.log_path}:\n{tail}")

    def run_pass(self) -> None:
        os.write(self._go, b"go\n")
        self._wait_for("pass")

    def finish(self) -> OfflineResult:
        os.close(self._go)
        try:
            self._proc.wait(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            self._fail("did not exit")
        os.close(self._done)
        if self._proc.returncode != 0 or not self._out_path.exists():
            self._fail("failed")
        out = json.loads(self._out_path.read_text())
        self._scratch.cleanup()
        return OfflineResult.of_passes("vllm", out["num_requests"], out["num_completed"], out["prompt_tokens"],
                                       out["output_tokens"], out["passes"], out["startup_s"])


def run_vllm_offline(python: str, spec: dict, env: dict[str, str], log_dir: Path, timeout: float) -> OfflineResult:
    """`spec["passes"]` (default 1) timed passes of vLLM alone."""
    run = VllmOffline(python, spec, env, log_dir, timeout)
    for _ in range(int(spec.get("passes", 1))):
        run.run_pass()
    return run.finish()
