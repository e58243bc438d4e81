"""Drive an engine through a workload and collect per-request records and the iteration log.

The driver uses only the engine API (`sarathi_jax.core.engine_api.Engine`, docs/design/core.md) and runs the one driver
loop (`sarathi_jax.core.arrival_loop.drive`): each request is added once its arrival time has passed on the
engine's own clock, with `arrival_time = run start + its offset`; while the engine is idle the clock waits for
the next arrival (a real engine sleeps, the simulator jumps). Offline runs put every arrival at 0.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from sarathi_jax.core.arrival_loop import Arrival, RunState, drive
from sarathi_jax.bench.metrics import RequestRecord
from sarathi_jax.bench.slo_mix import NO_CLASS, SloClass
from sarathi_jax.bench.workload import Workload
from sarathi_jax.core.engine_api import Engine
from sarathi_jax.request.outputs import IterationRecord
from sarathi_jax.request.sampling_params import SamplingParams
from sarathi_jax.spec_decode.speculative import SpeculationStats
from sarathi_jax.request.structured_outputs import StructuredOutputs


# ----------------------------------------------------------------------------------------------- results


@dataclass
class RunResult:
    """One run of one workload on one engine configuration. Times are relative to the run's start."""

    label: str
    records: list[RequestRecord]
    iterations: list[dict]  # IterationRecord fields, start_time relative to the run start
    num_preemptions: int
    wall_time: float  # seconds of real time the run took (the virtual span differs under the simulator)
    stopped_early: bool = False  # the early-stop condition fired; the remaining requests were aborted
    config: dict = field(default_factory=dict)
    summary: dict = field(default_factory=dict)
    pipeline: dict | None = None  # engine.pipeline_stats() of the run (bubble fraction) under pipeline parallelism
    first_completion: str | None = None  # the text of request 0's output, when the engine detokenizes
    prefix_cache: dict | None = None  # this run's prefix-cache "queries" and "hits" (tokens), when the engine counts them
    transfer: dict | None = None  # disaggregation: this run's KV transfers ("num_transfers", "bytes", "seconds")
    speculation: dict | None = None  # speculative decoding: this run's draft, accepted and emitted token counts

    def to_json(self) -> dict:
        """Plain JSON types; `from_json` gives the run back."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> RunResult:
        return cls(**{**d, "records": [RequestRecord(**r) for r in d["records"]]})


# SpeculationStats' counts, named as `RunResult.speculation` holds them (its "num_" dropped)
SPECULATION_COUNTS = tuple(f.name.removeprefix("num_") for f in dataclasses.fields(SpeculationStats))


def sampling_params_for(output_len: int, temperature: float = 0.0, stop_at_eos: bool = False,
                        structured_outputs: StructuredOutputs | None = None) -> SamplingParams:
    """The trace's output length exactly (EOS ignored), or at most that with `stop_at_eos` (real text prompts);
    a constrained request (`structured_outputs`) also ends where its output is complete."""
    return SamplingParams(temperature=temperature, ignore_eos=not stop_at_eos, max_tokens=int(output_len),
                          structured_outputs=structured_outputs)


def workload_requests(
    workload: Workload, prompts: Sequence[Sequence[int]], temperature: float = 0.0, stop_at_eos: bool = False,
    constraints: Sequence[StructuredOutputs | None] | None = None,
) -> list[tuple[float, list[int], SamplingParams]]:
    """Request i of `workload` as (arrival, seconds after the run start; prompt token ids; sampling params):
    what `run_workload` adds to an engine and `sarathi_jax.bench.loadgen` sends to a server. `constraints`: request i's
    structured-outputs constraint (None: all unconstrained; --structured-share)."""
    if len(prompts) != len(workload):
        raise ValueError(f"{len(prompts)} prompts for {len(workload)} requests")
    constraints = [None] * len(workload) if constraints is None else constraints
    if len(constraints) != len(workload):
        raise ValueError(f"{len(constraints)} constraints for {len(workload)} requests")
    return [
        (float(workload.arrivals[i]), list(prompts[i]),
         sampling_params_for(workload.output_lens[i], temperature, stop_at_eos, constraints[i]))
        for i in range(len(workload))
    ]


def workload_record(workload: Workload, i: int, request_id: str) -> RequestRecord:
    """The record of request i of `workload` before anything happened to it: id, scheduled arrival (seconds
    after the run start), prompt length and max_tokens. The caller fills in what happened."""
    return RequestRecord(
        request_id=request_id,
        arrival_time=float(workload.arrivals[i]),
        prompt_len=int(workload.prompt_lens[i]),
        max_tokens=int(workload.output_lens[i]),
    )


def _iteration_dict(it: IterationRecord, t0: float) -> dict:
    return {
        "iteration": it.iteration,
        "start_time": it.start_time - t0,
        "duration": it.duration,
        "num_prefill_tokens": it.num_prefill_tokens,
        "num_decode_tokens": it.num_decode_tokens,
        "num_seqs": it.num_seqs,
        "chunk_sizes": list(it.chunk_sizes),
        "num_preemptions": it.num_preemptions,
        "num_padded_tokens": it.num_padded_tokens,
        "instance": it.instance,
        "transfer_bytes": it.transfer_bytes,
        "transfer_seconds": it.transfer_seconds,
        "token_limit": it.token_limit,
        "predicted_s": it.predicted_s,
        "slack_s": it.slack_s,
    }


def run_workload(
    engine: Engine,
    workload: Workload,
    prompts: Sequence[list[int]],
    *,
    label: str = "run",
    id_prefix: str = "",
    temperature: float = 0.0,
    stop_at_eos: bool = False,
    progress: bool = False,
    early_stop: Callable[[RunState], bool] | None = None,
    early_stop_every: int = 8,
    max_idle_steps: int = 10000,
    request_classes: Sequence[SloClass] | None = None,
    constraints: Sequence[StructuredOutputs | None] | None = None,
) -> RunResult:
    """Run `workload` (with these prompt token ids) on `engine` until every request has finished.

    `early_stop(state)` is checked every `early_stop_every` steps; when it returns True the requests still
    in the engine are aborted, those not yet added are recorded as never run, and the run ends.
    Request ids are `f"{id_prefix}{index}"`: use a fresh prefix when reusing an engine. `stop_at_eos`: requests
    end at EOS (real text prompts) instead of running to their trace output length. `request_classes`: request i's
    SLO class (--slo-mix), whose priority and SLO targets it is sent with (None: priority 0, no targets).
    `constraints`: request i's structured-outputs constraint (None: none; --structured-share).
    """
    ids = [f"{id_prefix}{i}" for i in range(len(workload))]
    classes = [NO_CLASS] * len(ids) if request_classes is None else request_classes
    arrivals = [Arrival(rid, arrival, prompt, params, c.priority, c.ttft, c.tbt) for rid, (arrival, prompt, params), c
                in zip(ids, workload_requests(workload, prompts, temperature, stop_at_eos, constraints), classes)]
    log_start = len(engine.iteration_log)
    engine.reset_pipeline_stats()  # count bubbles of this run only, not warm-up or earlier runs
    engine.reset_prefix_cache()  # every run (and capacity probe) starts cold: no hits on earlier runs' prompts
    before = engine.stats()

    bar = _progress_bar(len(ids), label) if progress else None

    wall0 = time.monotonic()
    loop = drive(engine, arrivals, on_done=None if bar is None else lambda rid: bar.update(1),
                 early_stop=early_stop, early_stop_every=early_stop_every, max_idle_steps=max_idle_steps)
    if bar is not None:
        bar.close()
    wall = time.monotonic() - wall0

    t0 = loop.start
    records = []
    for k, rid in enumerate(ids):
        rec = workload_record(workload, k, rid)
        if rid in loop.refused:
            rec.finish_reason, rec.error = "error", loop.refused[rid]
        out = loop.finished.get(rid) or loop.latest.get(rid)
        if out is not None:
            m = out.metrics
            rel = lambda t: None if t is None else t - t0  # noqa: E731
            rec.arrival_time = m.arrival_time - t0
            rec.first_scheduled_time = rel(m.first_scheduled_time)
            rec.first_token_time = rel(m.first_token_time)
            rec.token_times = [t - t0 for t in m.token_times]
            rec.finished_time = rel(m.finished_time)
            rec.num_preemptions = m.num_preemptions
            rec.num_output_tokens = len(out.token_ids)
            rec.finish_reason = out.finish_reason if out.finished else None
            rec.error = out.error
        records.append(rec)
    after = engine.stats()
    first = loop.finished.get(ids[0]) if ids else None
    return RunResult(
        label=label,
        records=records,
        iterations=[_iteration_dict(it, t0) for it in engine.iteration_log[log_start:]],
        num_preemptions=int(after["num_preemptions"]) - int(before["num_preemptions"]),
        wall_time=wall,
        stopped_early=loop.stopped_early,
        pipeline=engine.pipeline_stats(),
        prefix_cache={k: int(after[f"prefix_cache_{k}"]) - int(before[f"prefix_cache_{k}"])
                      for k in ("queries", "hits")},
        first_completion=(first.text or None) if first is not None else None,
        transfer=({k: after[f"transfer_{k}"] - before[f"transfer_{k}"] for k in ("bytes", "seconds")}
                  | {"num_transfers": after["num_transfers"] - before["num_transfers"]}
                  if "num_transfers" in after else None),
        speculation=({k: int(after[f"spec_num_{k}"]) - int(before[f"spec_num_{k}"]) for k in SPECULATION_COUNTS}
                     if "spec_num_draft_tokens" in after else None),
    )


def measure_decode_iteration_time(
    engine: Engine,
    *,
    batch_size: int = 8,
    prompt_len: int = 32,
    output_len: int = 32,
    vocab_size: int | None = None,
    seed: int = 0,
    id_prefix: str = "decode-probe-",
) -> float:
    """Median duration of the decode-only iterations of `batch_size` requests run together (offline).

    The reference for TBT SLOs given as a multiple (the paper's 5x strict, 25x relaxed).
    """
    from sarathi_jax.bench.metrics import decode_only_iteration_time

    max_len = engine.max_model_len
    o = max(2, min(output_len, max_len // 2))
    p = max(1, min(prompt_len, max_len - o))
    wl = Workload(np.zeros(batch_size), np.full(batch_size, p), np.full(batch_size, o))
    vocab = vocab_size or engine_vocab_size(engine)
    result = run_workload(engine, wl, wl.prompts(vocab, seed), id_prefix=id_prefix, label="decode probe")
    t = decode_only_iteration_time(result.iterations)
    if t is None:
        raise RuntimeError("the decode-only probe ran no decode-only iterations; cannot measure the TBT reference")
    return t


def engine_vocab_size(engine: Engine) -> int:
    """The vocabulary the engine's admission checks prompt token ids against."""
    return engine.admission.vocab_size


_told_no_tqdm = False


def _progress_bar(total: int, label: str):
    """A tqdm bar on stderr; None without tqdm (the `progress` extra), said once: the run's progress lines
    remain."""
    global _told_no_tqdm
    try:
        from tqdm import tqdm
    except ImportError:
        if not _told_no_tqdm:
            _told_no_tqdm = True
            print("(no progress bars: tqdm is not installed, the progress extra: pip install 'sarathi-jax[progress]')",
                  file=sys.stderr, flush=True)
        return None
    return tqdm(total=total, desc=label, unit="req", leave=False, file=sys.stderr, dynamic_ncols=True)
