"""Latency and throughput metrics: plain functions over per-request records and iteration records.

Definitions (all times in seconds, relative to the start of a run):
  TTFT                 first token time - arrival time
  TBT                  time between consecutive output tokens of one request (the first token excluded);
                       run-level TBT percentiles pool every TBT of every completed request
  end-to-end latency   finish time - arrival time
  scheduling delay     first time the request was scheduled (any prefill chunk) - arrival time
  normalized latency   end-to-end latency / number of output tokens (seconds per token)
  throughput           completed requests (or their tokens) / (last finish - first arrival)
  goodput              completed requests with TTFT <= slo_ttft and every TBT <= slo_tbt, per second (a
                       TBT target is a deadline on every token, counted from the token before it; not a P99)
  class goodput        the same with each request's own targets (`RequestSlo`, the bench's --slo-mix), over
                       all requests and per SLO class, over the run's span
  stall                a TBT above `stall_factor` x the run's median TBT (default 5)
Percentiles use numpy's default (linear interpolation between closest ranks). Only completed requests
(finish_reason "stop" or "length") count towards latency percentiles; errors and aborts are counted apart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from sarathi_jax.request.outputs import RequestLatencies
from sarathi_jax.utils.percentiles import percentiles

COMPLETED_REASONS = ("stop", "length")
DEFAULT_STALL_FACTOR = 5.0


@dataclass
class RequestRecord(RequestLatencies):
    """What happened to one request, times relative to the start of the run (None: never happened).
    ttft, tbts, e2e_latency and scheduling_delay: see `RequestLatencies`."""

    request_id: str
    arrival_time: float
    prompt_len: int
    max_tokens: int
    num_output_tokens: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished_time: float | None = None
    num_preemptions: int = 0
    finish_reason: str | None = None
    error: str | None = None

    @property
    def completed(self) -> bool:
        return self.finish_reason in COMPLETED_REASONS

    @property
    def normalized_latency(self) -> float | None:
        e2e = self.e2e_latency
        if e2e is None or self.num_output_tokens < 1:
            return None
        return e2e / self.num_output_tokens

    def to_dict(self) -> dict:
        d = {
            "request_id": self.request_id,
            "arrival_time": self.arrival_time,
            "prompt_len": self.prompt_len,
            "max_tokens": self.max_tokens,
            "num_output_tokens": self.num_output_tokens,
            "first_scheduled_time": self.first_scheduled_time,
            "first_token_time": self.first_token_time,
            "token_times": list(self.token_times),
            "finished_time": self.finished_time,
            "num_preemptions": self.num_preemptions,
            "finish_reason": self.finish_reason,
            "error": self.error,
        }
        d.update(
            ttft=self.ttft,
            e2e_latency=self.e2e_latency,
            scheduling_delay=self.scheduling_delay,
            normalized_latency=self.normalized_latency,
        )
        return d


def completed(records: Iterable[RequestRecord]) -> list[RequestRecord]:
    return [r for r in records if r.completed]


def all_tbts(records: Iterable[RequestRecord]) -> list[float]:
    return [t for r in records for t in r.tbts]


def count_stalls(tbts: Sequence[float], factor: float = DEFAULT_STALL_FACTOR, reference: float | None = None) -> int:
    """Number of TBTs above `factor` x `reference` (default: the median of `tbts`)."""
    if len(tbts) == 0:
        return 0
    ref = float(np.median(tbts)) if reference is None else float(reference)
    return int(np.sum(np.asarray(tbts, dtype=np.float64) > factor * ref))


def run_span(records: Sequence[RequestRecord]) -> float:
    """First arrival to last finish among completed requests (0 when none finished)."""
    done = completed(records)
    if not done:
        return 0.0
    return max(r.finished_time for r in done) - min(r.arrival_time for r in done)


def throughput(records: Sequence[RequestRecord], duration: float | None = None) -> dict:
    """Completed requests, output tokens and prompt+output tokens per second over `duration` (default: span)."""
    done = completed(records)
    dur = run_span(records) if duration is None else duration
    out_tokens = sum(r.num_output_tokens for r in done)
    all_tokens = out_tokens + sum(r.prompt_len for r in done)
    ok = dur > 0
    return {
        "duration": dur,
        "num_completed": len(done),
        "output_tokens": out_tokens,
        "request_throughput": len(done) / dur if ok else None,
        "output_token_throughput": out_tokens / dur if ok else None,
        "total_token_throughput": all_tokens / dur if ok else None,
    }


def meets_slo(record: RequestRecord, slo_ttft: float | None, slo_tbt: float | None) -> bool:
    """A completed request whose TTFT <= slo_ttft and every TBT <= slo_tbt (a None SLO is not checked)."""
    if not record.completed:
        return False
    if slo_ttft is not None and (record.ttft is None or record.ttft > slo_ttft):
        return False
    if slo_tbt is not None and any(t > slo_tbt for t in record.tbts):
        return False
    return True


def goodput(
    records: Sequence[RequestRecord], slo_ttft: float | None, slo_tbt: float | None, duration: float | None = None
) -> dict:
    dur = run_span(records) if duration is None else duration
    good = sum(meets_slo(r, slo_ttft, slo_tbt) for r in records)
    return {
        "slo_ttft": slo_ttft,
        "slo_tbt": slo_tbt,
        "num_good": good,
        "good_fraction": good / len(records) if records else None,
        "goodput": good / dur if dur > 0 else None,
    }


@dataclass(frozen=True)
class RequestSlo:
    """One request's SLO class and targets (seconds; None: not checked)."""

    slo_class: str
    ttft: float | None
    tbt: float | None


def class_goodput(records: Sequence[RequestRecord], slos: Sequence[RequestSlo], duration: float | None = None) -> dict:
    """Goodput with each request's own targets (`slos[i]` is `records[i]`'s): {"overall": ..., "classes": {name:
    ...}} (classes in order of first appearance), each with num_requests, num_good, good_fraction, goodput (good
    requests per second of the run's span) and the TTFT percentiles of its completed requests."""
    if len(slos) != len(records):
        raise ValueError(f"{len(slos)} SLOs for {len(records)} requests")
    dur = run_span(records) if duration is None else duration

    def part(pairs: list[tuple[RequestRecord, RequestSlo]]) -> dict:
        good = sum(meets_slo(r, s.ttft, s.tbt) for r, s in pairs)
        return {"num_requests": len(pairs), "num_good": good, "good_fraction": good / len(pairs) if pairs else None,
                "goodput": good / dur if dur > 0 else None,
                "ttft": percentiles(r.ttft for r, _ in pairs if r.completed)}

    pairs = list(zip(records, slos))
    by_class: dict[str, list] = {}
    for r, s in pairs:
        by_class.setdefault(s.slo_class, []).append((r, s))
    classes = {name: {"slo_ttft": p[0][1].ttft, "slo_tbt": p[0][1].tbt, **part(p)} for name, p in by_class.items()}
    return {"overall": part(pairs), "classes": classes}


def decode_only_iteration_time(iterations: Sequence) -> float | None:
    """Median duration of iterations that ran decodes and no prefill tokens (None when there are none)."""
    d = [_get(it, "duration") for it in iterations if _get(it, "num_prefill_tokens") == 0 and _get(it, "num_decode_tokens") > 0]
    return float(np.median(d)) if d else None


def _get(it, name):
    """A field of an IterationRecord or its dict (None for a field a record saved by an older build lacks)."""
    return it.get(name) if isinstance(it, dict) else getattr(it, name, None)


def iteration_stats(iterations: Sequence) -> dict:
    """Counts and means over a run's IterationRecords (objects or dicts)."""
    n = len(iterations)
    if not n:
        return {"num_iterations": 0}
    dur = np.array([_get(it, "duration") for it in iterations], dtype=np.float64)
    pre = np.array([_get(it, "num_prefill_tokens") for it in iterations], dtype=np.int64)
    dec = np.array([_get(it, "num_decode_tokens") for it in iterations], dtype=np.int64)
    pad = np.array([_get(it, "num_padded_tokens") for it in iterations], dtype=np.int64)
    real = pre + dec
    return {
        "num_iterations": n,
        "iteration_time": percentiles(dur),
        "mean_tokens_per_iteration": float(real.mean()),
        "num_prefill_tokens": int(pre.sum()),
        "num_decode_tokens": int(dec.sum()),
        "num_hybrid_iterations": int(np.sum((pre > 0) & (dec > 0))),
        "num_decode_only_iterations": int(np.sum((pre == 0) & (dec > 0))),
        "padding_efficiency": float(real.sum() / pad.sum()) if pad.sum() > 0 else None,
        "decode_only_iteration_time": decode_only_iteration_time(iterations),
        "token_limit": percentiles(_get(it, "token_limit") for it in iterations),
        "prediction_error": prediction_error(iterations),
    }


def step_times(iterations: Sequence) -> list[float]:
    """Each iteration's own time on the device, in log order: from its start or the previous iteration's end,
    whichever is later, to its end. An overlapped loop dispatches a batch while the one before it runs, so a
    record's duration (dispatch to retirement) also holds the wait for its predecessor."""
    out, previous_end = [], -math.inf
    for it in iterations:
        start = _get(it, "start_time")
        end = start + _get(it, "duration")
        out.append(end - max(start, previous_end))
        previous_end = end
    return out


def prediction_error(iterations: Sequence) -> dict | None:
    """Percentiles of (step time - predicted_s) / predicted_s (`step_times`) over the iterations the budget
    policy predicted (token_budget "dynamic"); None when it predicted none."""
    predictions = [_get(it, "predicted_s") for it in iterations]
    errors = [(step - p) / p for p, step in zip(predictions, step_times(iterations)) if p]
    return percentiles(errors, (5, 50, 95)) if errors else None


def summarize(
    records: Sequence[RequestRecord],
    iterations: Sequence = (),
    *,
    slo_ttft: float | None = None,
    slo_tbt: float | None = None,
    stall_factor: float = DEFAULT_STALL_FACTOR,
    num_preemptions: int | None = None,
    request_slos: Sequence[RequestSlo] | None = None,
) -> dict:
    """All run-level metrics as one JSON-able dict. `request_slos`: each request's SLO class (`class_goodput`,
    under "slo_classes")."""
    done = completed(records)
    tbts = all_tbts(done)
    median_tbt = float(np.median(tbts)) if tbts else None
    summary = {
        "num_requests": len(records),
        "num_completed": len(done),
        "num_aborted": sum(r.finish_reason == "abort" for r in records),
        "num_errors": sum(r.finish_reason == "error" or r.error is not None for r in records),
        "num_unfinished": sum(r.finish_reason is None for r in records),
        "ttft": percentiles(r.ttft for r in done),
        "tbt": percentiles(tbts),
        "e2e_latency": percentiles(r.e2e_latency for r in done),
        "scheduling_delay": percentiles(r.scheduling_delay for r in done),
        "normalized_latency": percentiles(r.normalized_latency for r in done),
        **throughput(records),
        "stall_factor": stall_factor,
        "num_stalls": count_stalls(tbts, stall_factor),
        "stall_threshold": None if median_tbt is None else stall_factor * median_tbt,
        "num_preemptions": (
            num_preemptions if num_preemptions is not None else sum(r.num_preemptions for r in records)
        ),
        "goodput": goodput(records, slo_ttft, slo_tbt) if (slo_ttft is not None or slo_tbt is not None) else None,
        "iterations": iteration_stats(iterations),
    }
    if request_slos is not None:
        summary["slo_classes"] = class_goodput(records, request_slos)
    return summary


def fmt_seconds(x: float | None) -> str:
    """Human-readable duration: ms below 1 s."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x * 1e3:.1f} ms" if abs(x) < 1 else f"{x:.2f} s"
