"""The offline part of `python -m sarathi_jax.bench.peer`: every request at t=0, total tokens per second.

This engine runs in this process (`LLMEngine`, fully compiled before the clock starts, driven by the bench's
`run_workload`); vLLM runs `vllm.LLM.generate` in a subprocess of its own interpreter
(`peer_vllm_offline.py`). Both first run the same two warm-up requests, then time one pass over the same
requests: prompt + generated tokens over the wall time of that pass (start-up excluded).
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from sarathi_jax.bench.args import BenchError
from sarathi_jax.bench.peer_servers import EngineSettings, vllm_engine_kwargs
from sarathi_jax.bench.peer_workloads import warmup_workload
from sarathi_jax.bench.workload import Workload

VLLM_SCRIPT = Path(__file__).with_name("peer_vllm_offline.py")


@dataclass(frozen=True)
class OfflineResult:
    engine: str
    num_requests: int
    num_completed: int
    prompt_tokens: int
    output_tokens: int
    wall_s: float
    startup_s: float | None = None

    @property
    def total_tokens_per_s(self) -> float | None:
        return (self.prompt_tokens + self.output_tokens) / self.wall_s if self.wall_s > 0 else None

    @property
    def output_tokens_per_s(self) -> float | None:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else None

    def to_dict(self) -> dict:
        return {**asdict(self), "total_tokens_per_s": self.total_tokens_per_s,
                "output_tokens_per_s": self.output_tokens_per_s}


def sarathi_engine_config(s: EngineSettings):
    from sarathi_jax.config import EngineConfig

    return EngineConfig(model=s.model, scheduler="sarathi", dtype="float32", token_budget=s.token_budget,
                        max_num_seqs=s.max_num_seqs, max_model_len=s.max_model_len, kv_cache_bytes=s.kv_cache_bytes,
                        enable_prefix_caching=False, seed=s.seed)


def run_sarathi_offline(s: EngineSettings, workload: Workload, prompts: list[list[int]]) -> OfflineResult:
    from sarathi_jax.bench.driver import run_workload
    from sarathi_jax.bench.engines import make_llm_engine

    t0 = time.monotonic()
    engine = make_llm_engine(sarathi_engine_config(s))  # returns once every executable is built
    startup = time.monotonic() - t0
    warm = warmup_workload()
    run_workload(engine, warm, warm.prompts(engine.model_config.vocab_size, s.seed), id_prefix="warmup-")
    run = run_workload(engine, workload, prompts, label="sarathi-jax offline", id_prefix="offline-")
    done = [r for r in run.records if r.completed]
    result = OfflineResult("sarathi-jax", len(run.records), len(done), sum(r.prompt_len for r in done),
                           sum(r.num_output_tokens for r in done), run.wall_time, startup)
    del engine, run
    gc.collect()  # free the weights and KV cache before the other engine starts
    return result


def vllm_spec(s: EngineSettings, workload: Workload, prompts: list[list[int]], vocab_size: int) -> dict:
    """What peer_vllm_offline.py runs: vllm.LLM's arguments, the same requests and the same warm-up."""
    warm = warmup_workload()
    return {
        "engine": vllm_engine_kwargs(s),
        "prompts": [list(map(int, p)) for p in prompts],
        "max_tokens": [int(n) for n in workload.output_lens],
        "warmup_prompts": warm.prompts(vocab_size, s.seed),
        "warmup_max_tokens": [int(n) for n in warm.output_lens],
    }


def run_vllm_offline(python: str, spec: dict, env: dict[str, str], log_dir: Path, timeout: float) -> OfflineResult:
    """Run peer_vllm_offline.py with `python` (from a scratch directory: see its docstring)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / "vllm-offline.log"
    with tempfile.TemporaryDirectory(prefix="peer-vllm-") as scratch:
        spec_path, out_path = Path(scratch, "spec.json"), Path(scratch, "out.json")
        spec_path.write_text(json.dumps(spec))
        with open(log_path, "w") as log:
            try:
                proc = subprocess.run([python, "-c", VLLM_SCRIPT.read_text(), str(spec_path), str(out_path)],
                                      cwd=scratch, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT,
                                      timeout=timeout)
            except subprocess.TimeoutExpired:
                raise BenchError(f"vLLM's offline run took over {timeout:.0f} s; log {log_path}") from None
        if proc.returncode != 0 or not out_path.exists():
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
            raise BenchError(f"vLLM's offline run failed (status {proc.returncode}); log {log_path}:\n{tail}")
        out = json.loads(out_path.read_text())
    return OfflineResult("vllm", out["num_requests"], out["num_completed"], out["prompt_tokens"],
                         out["output_tokens"], out["wall_s"], out["startup_s"])
