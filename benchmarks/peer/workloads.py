"""The requests of `python -m benchmarks.peer`: one list per measurement, the same for both engines.

Lengths and arrivals come from the bench's workload code (`workload.py`): the offline part is
`synthetic_workload` (all at t=0), the rate and capacity parts are rows of the conversation trace with Poisson
arrivals at each rate (`trace_workload`, seeded: every rate replays the same rows and the same prompts, only the
arrival times change). Every workload is fitted to max_model_len. Prompts are random token ids
(`Workload.prompts`, seeded) in the model's vocabulary; outputs are greedy, EOS ignored, exactly the
workload's output length (min_tokens = max_tokens).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from sarathi_jax.bench.args import BenchError
from sarathi_jax.bench.driver import workload_requests
from sarathi_jax.bench.traces import SHIPPED_TRACES, load_trace, trace_file
from sarathi_jax.bench.workload import Workload, synthetic_workload, trace_workload

DEFAULT_TRACE = "conversation"  # shipped with the package (bench/trace_data)

LoadRequest = tuple  # (arrival seconds, prompt token ids, SamplingParams): what sarathi_jax.bench.loadgen sends


def check_model_dir(path: str) -> dict:
    """The HF config of `path`, refusing what neither engine could load: a missing folder, no config.json, no
    safetensors weights."""
    folder = Path(path)
    if not folder.is_dir():
        raise BenchError(f"--model {path}: not a folder (an HF checkpoint folder; --make-model DIR writes one)")
    config = folder / "config.json"
    if not config.is_file():
        raise BenchError(f"--model {path}: no config.json (an HF checkpoint folder; --make-model DIR writes one)")
    if not any(folder.glob("*.safetensors")):
        raise BenchError(f"--model {path}: no *.safetensors weights")
    try:
        return json.loads(config.read_text())
    except json.JSONDecodeError as e:
        raise BenchError(f"--model {path}: config.json is not JSON ({e})") from None


def resolve_trace(path: str | None) -> str:
    """The absolute file of `path` (a CSV, or a shipped trace's name; default the conversation trace); a clear
    error when it is not there."""
    trace = Path(trace_file(path or DEFAULT_TRACE))
    if not trace.is_file():
        raise BenchError(f"trace not found: {path}; give a trace CSV or a shipped trace "
                         f"({', '.join(SHIPPED_TRACES)}) with --trace, or run only the offline part "
                         "(--parts offline)")
    return str(trace)


def offline_workload(num_requests: int, prompt_len: str, output_len: str, max_model_len: int,
                     seed: int) -> Workload:
    return synthetic_workload(num_requests, qps=None, prompt_len=prompt_len, output_len=output_len,
                              seed=seed).fit(max_model_len)


def rate_workload(trace: str, num_requests: int, qps: float, max_model_len: int, seed: int,
                  length_scale: float = 1.0) -> Workload:
    """`num_requests` trace rows (the same rows at every rate) with seeded Poisson arrivals at `qps`."""
    wl = trace_workload(load_trace(trace), sample=num_requests, qps=qps, arrival="poisson", seed=seed)
    return wl.scale_lengths(length_scale).fit(max_model_len)


def peer_requests(workload: Workload, prompts: list[list[int]]) -> list[LoadRequest]:
    """The requests both servers are sent: the bench driver's (arrival, prompt, greedy ignore_eos params) with
    min_tokens = max_tokens, so that neither engine can stop early."""
    return [(arrival, prompt, dataclasses.replace(params, min_tokens=params.max_tokens))
            for arrival, prompt, params in workload_requests(workload, prompts)]


def warmup_workload() -> Workload:
    """Two short requests run on each engine before anything is timed (lazy initialisation, first batches)."""
    return Workload([0.0, 0.0], [16, 24], [4, 4], info={"source": "warm-up", "arrival": "offline"})


def describe_requests(workload: Workload, arrivals: str) -> dict[str, Any]:
    """The report's account of a part's requests: `arrivals` in words, then their lengths."""
    p, o = workload.prompt_lens, workload.output_lens
    text = (f"{len(workload)} requests ({workload.info.get('source', '?')}), {arrivals}; prompt mean {p.mean():.0f} "
            f"(max {p.max()}), output mean {o.mean():.0f} (max {o.max()}) tokens")
    return {"description": text, **workload.summary()}
