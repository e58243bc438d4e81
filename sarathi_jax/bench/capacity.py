"""Capacity: the highest request rate an engine sustains within latency SLOs (Sarathi-Serve, section 5).

A rate passes when the run's P99 TBT <= `slo_tbt` and its median scheduling delay <= `max_sched_delay`
(the paper's 2 s bound, which keeps a queue from growing without limit), or, searching on goodput
(`goodput_target`, --capacity-goodput), when at least a given fraction of its requests (of one SLO class, or of
all) meet their own SLO targets (--slo-mix). The search probes a start rate,
doubles (or halves) until the verdict flips, then bisects, with a bounded number of probes in all.
Every probe replays the same requests with the arrival pattern stretched to the probed rate.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from sarathi_jax.core.arrival_loop import RunState
from sarathi_jax.bench.driver import RunResult, run_workload
from sarathi_jax.bench.metrics import summarize
from sarathi_jax.bench.slo_mix import GoodputTarget, SloClass
from sarathi_jax.bench.workload import Workload
from sarathi_jax.core.engine_api import Engine

if TYPE_CHECKING:
    from sarathi_jax.request.structured_outputs import StructuredOutputs

DEFAULT_MAX_SCHED_DELAY = 2.0
BEYOND_THROUGHPUT_FACTOR = 1.25  # see CapacityResult.beyond_throughput


@dataclass
class Probe:
    qps: float
    passed: bool
    p99_tbt: float | None = None
    p50_sched_delay: float | None = None
    stopped_early: bool = False
    throughput: float | None = None  # requests completed per second over the probe; None when it stopped early
    good_fraction: float | None = None  # searching on goodput: the fraction of requests meeting their SLO
    result: Any = field(default=None, repr=False)  # the RunResult, when the probe ran an engine

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("result")
        return d


@dataclass
class CapacityResult:
    capacity_qps: float  # highest passing rate found; 0.0 when even the lowest probed rate failed
    slo_tbt: float | None  # None: searched on goodput alone
    max_sched_delay: float
    probes: list[Probe]
    bracket: tuple[float, float]  # (highest pass, lowest fail); fail is inf when no probe failed
    note: str = ""

    @property
    def max_throughput(self) -> float | None:
        """The fastest completion rate any full probe reached. No rate above it can be sustained, whatever a
        probe too short to build a queue says."""
        rates = [float(p.throughput) for p in self.probes if p.throughput is not None]
        return max(rates) if rates else None

    @property
    def beyond_throughput(self) -> bool:
        """True when the capacity found is above the fastest completion rate measured by over a quarter
        (margin for a probe whose completion rate trails its arrival rate by the last requests' own latency):
        the probes were too short for the scheduling-delay bound to see a queue grow."""
        top = self.max_throughput
        return top is not None and bool(self.capacity_qps > BEYOND_THROUGHPUT_FACTOR * top)

    @property
    def best(self) -> Probe | None:
        passing = [p for p in self.probes if p.passed and p.qps == self.capacity_qps]
        return passing[-1] if passing else None

    def to_dict(self) -> dict:
        return {
            "capacity_qps": self.capacity_qps,
            "slo_tbt": self.slo_tbt,
            "max_sched_delay": self.max_sched_delay,
            "bracket": [self.bracket[0], None if math.isinf(self.bracket[1]) else self.bracket[1]],
            "note": self.note,
            "max_throughput": self.max_throughput,
            "beyond_throughput": self.beyond_throughput,
            "probes": [p.to_dict() for p in self.probes],
        }


def meets_slos(summary: dict, slo_tbt: float, max_sched_delay: float = DEFAULT_MAX_SCHED_DELAY) -> bool:
    """P99 TBT <= slo_tbt and median scheduling delay <= max_sched_delay; a run with unfinished, aborted
    or failed requests fails."""
    if summary["num_completed"] < summary["num_requests"]:
        return False
    p99 = summary["tbt"]["p99"]
    p50 = summary["scheduling_delay"]["p50"]
    return (p99 is None or p99 <= slo_tbt) and (p50 is not None and p50 <= max_sched_delay)


def search(
    evaluate: Callable[[float], Probe],
    *,
    start_qps: float = 1.0,
    max_probes: int = 10,
    rel_tol: float = 0.05,
    min_qps: float = 1e-3,
    max_qps: float = 1e6,
) -> tuple[float, list[Probe], tuple[float, float], str]:
    """Bracket then bisect the pass/fail boundary of `evaluate` (assumed monotone: passes at low rates).

    Stops after `max_probes` evaluations or when (fail - pass) <= rel_tol * fail. Returns
    (capacity, probes, (pass, fail), note).
    """
    if max_probes < 1:
        raise ValueError("max_probes must be >= 1")
    probes: list[Probe] = []

    def probe(q: float) -> bool:
        p = evaluate(q)
        probes.append(p)
        return p.passed

    lo, hi = 0.0, math.inf  # highest pass, lowest fail
    q = float(start_qps)
    if probe(q):
        lo = q
        while len(probes) < max_probes and q * 2 <= max_qps:
            q *= 2
            if probe(q):
                lo = q
            else:
                hi = q
                break
    else:
        hi = q
        while len(probes) < max_probes and q / 2 >= min_qps:
            q /= 2
            if probe(q):
                lo = q
                break
            hi = q
    while len(probes) < max_probes and lo > 0 and math.isfinite(hi) and hi - lo > rel_tol * hi:
        mid = (lo + hi) / 2
        if probe(mid):
            lo = mid
        else:
            hi = mid
    note = ""
    if math.isinf(hi):
        note = f"no probe failed: capacity is at least {lo:.4g} req/s (raise the start rate or --capacity-probes)"
    elif lo == 0.0:
        note = f"every probe failed: capacity is below {hi:.4g} req/s"
    elif hi - lo > rel_tol * hi:
        note = f"probe limit reached before the {rel_tol:.0%} tolerance: capacity in [{lo:.4g}, {hi:.4g}) req/s"
    return lo, probes, (lo, hi), note


def _early_stop(workload: Workload, slo_tbt: float, max_sched_delay: float) -> Callable[[RunState], bool]:
    """A verdict that can no longer change: more than half the requests already scheduled too late, or enough
    TBTs over the SLO that the P99 (linear interpolation over all TBTs the run will produce) must exceed it."""
    n = len(workload)
    total_tbts = int(np.sum(np.maximum(workload.output_lens - 1, 0)))
    tbt_violations_needed = total_tbts - math.floor(0.99 * (total_tbts - 1)) if total_tbts else math.inf
    sched_violations_needed = n // 2 + 1

    seen: dict[str, int] = {}  # request id -> token times already checked
    counts = {"slow": 0}
    late: set[str] = set()

    def check(state: RunState) -> bool:
        for rid, out in state.latest.items():
            m = out.metrics
            if (rid not in late and m.first_scheduled_time is not None
                    and m.first_scheduled_time - m.arrival_time > max_sched_delay):
                late.add(rid)
            t = m.token_times
            k = seen.get(rid, 0)
            if len(t) > k:
                start = max(k - 1, 0)
                counts["slow"] += sum(1 for a, b in zip(t[start:], t[start + 1:]) if b - a > slo_tbt)
                seen[rid] = len(t)
        return len(late) >= sched_violations_needed or counts["slow"] >= tbt_violations_needed

    return check


def find_capacity(
    engine: Engine,
    base: Workload,
    prompts: list[list[int]],
    *,
    slo_tbt: float | None,
    max_sched_delay: float = DEFAULT_MAX_SCHED_DELAY,
    start_qps: float | None = None,
    max_probes: int = 8,
    rel_tol: float = 0.05,
    label: str = "capacity",
    progress: bool = False,
    early_stop: bool = True,
    summarize_kwargs: dict | None = None,
    on_probe: Callable[[Probe], None] | None = None,
    goodput_target: GoodputTarget | None = None,
    request_classes: Sequence[SloClass] | None = None,
    constraints: Sequence[StructuredOutputs | None] | None = None,
) -> CapacityResult:
    """Search the capacity of `engine` on `base`'s requests, its arrival pattern rescaled to each probed rate.

    `base` must have arrival times (not offline). The engine is reused across probes (request ids get a
    per-probe prefix). `start_qps` defaults to the base workload's own rate. `goodput_target`: a probe passes on
    goodput (summarize_kwargs must carry the requests' `request_slos`) instead of P99 TBT and scheduling delay.
    `request_classes`: each request's SLO class (its priority and SLO targets are sent with it); `constraints`:
    its structured-outputs constraint (None: none).
    """
    if (slo_tbt is None) == (goodput_target is None):
        raise ValueError("search on a TBT SLO (slo_tbt) or on goodput (goodput_target): one of them")
    if not math.isfinite(base.mean_rate):
        raise ValueError("capacity search needs a workload with an arrival pattern, not an offline one")
    counter = [0]

    def evaluate(qps: float) -> Probe:
        counter[0] += 1
        wl = base.at_rate(qps)
        stop = _early_stop(wl, slo_tbt, max_sched_delay) if early_stop and slo_tbt is not None else None
        res: RunResult = run_workload(
            engine, wl, prompts, label=f"{label} @ {qps:.3g} req/s", id_prefix=f"{label}-p{counter[0]}-",
            progress=progress, early_stop=stop, request_classes=request_classes, constraints=constraints,
        )
        res.summary = summarize(res.records, res.iterations, num_preemptions=res.num_preemptions,
                                **(summarize_kwargs or {}))
        p = Probe(
            qps=qps,
            passed=(not res.stopped_early) and (goodput_target.met(res.summary) if goodput_target is not None
                                                else meets_slos(res.summary, slo_tbt, max_sched_delay)),
            p99_tbt=res.summary["tbt"]["p99"],
            p50_sched_delay=res.summary["scheduling_delay"]["p50"],
            stopped_early=res.stopped_early,
            throughput=None if res.stopped_early else res.summary["request_throughput"],
            good_fraction=None if goodput_target is None else goodput_target.good_fraction(res.summary),
            result=res,
        )
        if on_probe is not None:
            on_probe(p)
        return p

    return search_capacity(evaluate, slo_tbt=slo_tbt, max_sched_delay=max_sched_delay,
                           start_qps=start_qps or base.mean_rate, max_probes=max_probes, rel_tol=rel_tol)


def search_capacity(
    evaluate: Callable[[float], Probe],
    *,
    slo_tbt: float | None,
    max_sched_delay: float,
    start_qps: float,
    max_probes: int = 8,
    rel_tol: float = 0.05,
) -> CapacityResult:
    """`search` over `evaluate` (one probe per rate; in-process engines or servers), as a CapacityResult whose
    note also says when the capacity found is beyond the fastest completion rate measured."""
    cap, probes, bracket, note = search(evaluate, start_qps=start_qps, max_probes=max_probes, rel_tol=rel_tol)
    result = CapacityResult(cap, slo_tbt, max_sched_delay, probes, bracket, note)
    if result.beyond_throughput:
        result.note = (f"{note + '; ' if note else ''}capacity is at most about {result.max_throughput:.3g} req/s, "
                       f"the fastest completion rate measured: the probes were too short for a queue to build "
                       f"(replay more requests per probe)")
    return result
