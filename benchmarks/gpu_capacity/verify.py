"""Real-engine spot checks of a simulated grid (`--simulate --verify N`): N points (trace, SLO, policy), each
searched twice on the same `verify_sample` requests and the same SLO in seconds, once in the simulator over the
grid's cost model and once on the real engine (its search starting at the simulator's capacity, so that it
brackets the prediction in few probes); `verify.md` and `verify.json` put the capacities side by side."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
from typing import Any, Callable

from benchmarks.gpu_capacity.report import reported_capacity
from benchmarks.gpu_capacity.settings import Experiment, bench_argv, labels
from sarathi_jax.bench.__main__ import main as bench_main
from sarathi_jax.bench.traces import SHIPPED_TRACES as TRACE_FILES

TOLERANCE = 0.15  # the simulator's capacity within 15% of the real engine's
SIMULATED_PROBES = 10  # the simulator's side searches to a tight bracket: its probes cost seconds


def points(exp: Experiment, n: int) -> list[tuple[str, str, str]]:
    """`n` (trace, slo, label) points spread over the grid: the policies in turn (first sarathi budget, vllm,
    orca, the other budgets), each starting from another trace and SLO, the strict SLO first."""
    order = labels(exp)
    first = [x for x in order if x.startswith("sarathi")][:1]
    order = first + [x for x in order if not x.startswith("sarathi")] + [x for x in order if x not in first
                                                                        and x.startswith("sarathi")]
    pairs = [(t, s) for s in exp.slos for t in exp.traces]
    queues = [[(*pairs[(i + j) % len(pairs)], label) for j in range(len(pairs))] for i, label in enumerate(order)]
    chosen = [q[r] for r in range(len(pairs)) for q in queues]
    return chosen[:n]


def point_experiment(exp: Experiment, label: str, *, simulate: bool, start_qps: float | None) -> Experiment:
    """One policy (one sarathi budget) of `exp` at the verify sample; vllm and orca keep the grid's budgets. The
    simulated side gets at least `SIMULATED_PROBES` probes; the real side the grid's count."""
    policy, _, budget = label.partition("-")
    probes = max(exp.capacity_probes, SIMULATED_PROBES) if simulate else exp.capacity_probes
    return dataclasses.replace(exp, policies=(policy,), sample=exp.verify_sample, simulate=simulate,
                               capacity_probes=probes,
                               sarathi_budgets=(int(budget),) if budget else exp.sarathi_budgets,
                               start_qps=start_qps, devices=None)


def capacity_of(run_dir: str, label: str) -> dict:
    with open(os.path.join(run_dir, "summary.json")) as f:
        c = json.load(f)["capacity"][label]
    capacity, bound = reported_capacity(c)
    return {"capacity": capacity, "bound": bound, "probes": len(c["probes"])}


def verify(exp: Experiment, args: argparse.Namespace, table: dict, cost_model: str,
           engine_factory: Callable[[dict], Any] | None) -> int:
    """Run the points, write `verify.md` / `verify.json` in DIR; exit status 0 unless a run failed."""
    rows = []
    commands = []
    for trace, slo, label in points(exp, exp.verify):
        slo_tbt = table[trace][slo]["slo_tbt"]
        trace_path = os.path.join(args.trace_dir, TRACE_FILES[trace]) if args.trace_dir else trace
        base = os.path.join(args.out, "verify", f"{trace}-{slo}-{label}")
        result = {"trace": trace, "slo": slo, "label": label, "slo_tbt": slo_tbt}
        start = None
        for side, simulate in (("sim", True), ("real", False)):
            pexp = point_experiment(exp, label, simulate=simulate, start_qps=start)
            argv = bench_argv(pexp, trace_path, os.path.join(base, side), slo, slo_tbt, cost_model)
            commands.append("python -m sarathi_jax.bench " + shlex.join(argv))
            print(f"[verify {trace}, {slo}, {label}, {side}] {commands[-1]}", flush=True)
            rc = bench_main(argv, engine_factory=engine_factory)
            if rc != 0:
                print(f"[verify {trace}, {slo}, {label}] the bench failed (exit {rc})", file=sys.stderr)
                return rc
            result[side] = capacity_of(os.path.join(base, side), label)
            start = result["sim"]["capacity"] or None  # the real search starts at the prediction
        sim, real = result["sim"]["capacity"], result["real"]["capacity"]
        result["error"] = sim / real - 1 if real else None
        rows.append(result)
    with open(os.path.join(args.out, "commands.sh"), "a") as f:
        f.write("\n".join(commands) + "\n")
    with open(os.path.join(args.out, "verify.json"), "w") as f:
        json.dump({"tolerance": TOLERANCE, "sample": exp.verify_sample, "rows": rows}, f, indent=1)
    report = format_verify(rows, exp)
    with open(os.path.join(args.out, "verify.md"), "w") as f:
        f.write(report + "\n")
    print()
    print(report)
    print(f"wrote {args.out}/verify.md, verify.json and verify/")
    return 0


def format_verify(rows: list[dict], exp: Experiment) -> str:
    lines = [f"Simulated against real capacity, {exp.verify_sample} requests per probe, the same requests and SLO "
             f"on both sides (bounds: see capacity.md).", "",
             "| trace | SLO | policy | simulated req/s | real req/s | simulated / real - 1 |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        cells = [f"{r[side]['bound']}{r[side]['capacity']:.3g}" for side in ("sim", "real")]
        err = "-" if r["error"] is None else f"{r['error']:+.0%}"
        if r["error"] is not None and abs(r["error"]) <= TOLERANCE and not (r["sim"]["bound"] or r["real"]["bound"]):
            err += " (within 15%)"
        lines.append(f"| {r['trace']} | {r['slo']} ({r['slo_tbt'] * 1e3:.1f} ms) | {r['label']} | {cells[0]} | "
                     f"{cells[1]} | {err} |")
    return "\n".join(lines)
