"""The tables of `python -m benchmarks.peer`: one per measurement, a row per engine and their ratio.

Everything here works on the JSON-able report (`--out FILE.json`): `offline` {engine: OfflineResult.to_dict()},
`rates` {engine: {qps: metrics.summarize() dict}}, `capacity` {engine: CapacityResult.to_dict()}. A ratio is
this engine's number over vLLM's, whatever the number (above 1: more throughput, or a longer latency).
"""

from __future__ import annotations

import math
from typing import Any, Callable

from sarathi_jax.bench.metrics import fmt_seconds
from sarathi_jax.bench.report import format_rows

SARATHI, VLLM = "sarathi-jax", "vllm"
ENGINES = (SARATHI, VLLM)
RATIO_LABEL = f"{SARATHI} / {VLLM}"


def ratio(ours: float | None, theirs: float | None) -> float | None:
    """ours / theirs; None when either is missing or theirs is 0."""
    if ours is None or theirs is None or theirs == 0 or not (math.isfinite(ours) and math.isfinite(theirs)):
        return None
    return ours / theirs


def _x(r: float | None) -> str:
    return "-" if r is None else f"{r:.3g}x"


def _num(x: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def _engines(part: dict) -> list[str]:
    return [e for e in ENGINES if e in part] + [e for e in part if e not in ENGINES]


def _ratio_row(first: list[str], values: dict[str, list[float | None]], skip: int) -> list[str] | None:
    """The ratio row under a table: `first` cells, `skip` blank cells, then ours/theirs per numeric column."""
    if SARATHI not in values or VLLM not in values:
        return None
    return first + [""] * skip + [_x(ratio(a, b)) for a, b in zip(values[SARATHI], values[VLLM])]


# ----------------------------------------------------------------------------------------------- offline

OFFLINE_COLUMNS: tuple[tuple[str, str, Callable[[float | None], str]], ...] = (
    ("wall", "wall_s", lambda v: fmt_seconds(v)),
    ("total tok/s", "total_tokens_per_s", _num),
    ("gen tok/s", "output_tokens_per_s", _num),
)


def offline_table(offline: dict[str, dict]) -> str:
    header = ["engine", "done", "prompt tok", "gen tok"] + [name for name, _, _ in OFFLINE_COLUMNS]
    rows, values = [], {}
    for engine in _engines(offline):
        r = offline[engine]
        nums = [r.get(key) for _, key, _ in OFFLINE_COLUMNS]
        values[engine] = nums
        rows.append([engine, f"{r['num_completed']}/{r['num_requests']}", str(r["prompt_tokens"]),
                     str(r["output_tokens"])] + [fmt(v) for (_, _, fmt), v in zip(OFFLINE_COLUMNS, nums)])
    extra = _ratio_row([RATIO_LABEL], values, 3)
    table = format_rows(header, rows + ([extra] if extra else []))
    passes = {e: offline[e].get("passes_total_tokens_per_s") or [] for e in _engines(offline)}
    if any(len(p) > 1 for p in passes.values()):  # --repeats: every pass, in the order they ran
        table += "\n" + "\n".join(f"{e} passes (total tok/s): " + ", ".join(_num(v) for v in p)
                                   for e, p in passes.items())
    return table


# ----------------------------------------------------------------------------------------------- rates

def rate_numbers(summary: dict) -> list[float | None]:
    """TTFT P50, P99, TBT P50, P99, generated tokens/s of one run."""
    return [summary["ttft"]["p50"], summary["ttft"]["p99"], summary["tbt"]["p50"], summary["tbt"]["p99"],
            summary["output_token_throughput"]]


def rates_table(rates: dict[str, dict[str, dict]]) -> str:
    header = ["req/s", "engine", "done", "P50 TTFT", "P99 TTFT", "P50 TBT", "P99 TBT", "gen tok/s"]
    qps_all = sorted({q for per_engine in rates.values() for q in per_engine}, key=float)
    rows = []
    for q in qps_all:
        values = {}
        for engine in _engines(rates):
            s = rates[engine].get(q)
            if s is None:
                continue
            nums = values[engine] = rate_numbers(s)
            rows.append([f"{float(q):g}", engine, f"{s['num_completed']}/{s['num_requests']}"]
                        + [fmt_seconds(v) for v in nums[:4]] + [_num(nums[4])])
        extra = _ratio_row([f"{float(q):g}", RATIO_LABEL], values, 1)
        if extra:
            rows.append(extra)
    return format_rows(header, rows, left=2)


# ----------------------------------------------------------------------------------------------- capacity

def capacity_table(capacity: dict[str, dict]) -> str:
    """The table, then each search's note (bracket not closed, probes too short) on a line of its own."""
    header = ["engine", "capacity", "bracket", "probes", "fastest done"]
    rows, values, notes = [], {}, []
    for engine in _engines(capacity):
        c = capacity[engine]
        lo, hi = c["bracket"]
        values[engine] = [c["capacity_qps"]]
        rows.append([engine, f"{c['capacity_qps']:.3g} req/s", f"[{lo:.3g}, {'inf' if hi is None else f'{hi:.3g}'})",
                     str(len(c["probes"])), _num(c.get("max_throughput"), "{:.3g} req/s")])
        if c.get("note"):
            notes.append(f"  {engine}: {c['note']}")
    extra = _ratio_row([RATIO_LABEL], values, 0)
    if extra:
        rows.append(extra + [""] * 3)
    return "\n".join([format_rows(header, rows), *notes])


def ratios(report: dict[str, Any]) -> dict[str, Any]:
    """The ratios the tables print, for the JSON file."""
    out: dict[str, Any] = {}
    off = report.get("offline") or {}
    if SARATHI in off and VLLM in off:
        out["offline"] = {key: ratio(off[SARATHI][key], off[VLLM][key]) for _, key, _ in OFFLINE_COLUMNS}
    rates = report.get("rates") or {}
    if SARATHI in rates and VLLM in rates:
        names = ("ttft_p50", "ttft_p99", "tbt_p50", "tbt_p99", "output_token_throughput")
        out["rates"] = {q: dict(zip(names, map(ratio, rate_numbers(rates[SARATHI][q]), rate_numbers(rates[VLLM][q]))))
                        for q in rates[SARATHI] if q in rates[VLLM]}
    cap = report.get("capacity") or {}
    if SARATHI in cap and VLLM in cap:
        out["capacity"] = ratio(cap[SARATHI]["capacity_qps"], cap[VLLM]["capacity_qps"])
    return out


def budgets_line(settings: dict[str, Any]) -> str:
    """Each engine's token budget: equal unless the run gave each its own (--vllm-token-budget)."""
    ours, theirs = settings.get("token_budget"), settings.get("vllm_token_budget", "same")
    if isinstance(ours, str):
        ours = f"{ours} (TBT target {fmt_seconds(settings.get('slo_tbt_s'))})"
    theirs = ours if theirs == "same" else "vLLM's default" if theirs is None else theirs
    return f"token budget: {SARATHI} {ours}, {VLLM} {theirs}"


def format_report(report: dict[str, Any]) -> str:
    workloads = report.get("workloads", {})
    parts = [budgets_line(report["settings"])] if "settings" in report else []
    if report.get("offline"):
        parts += [f"offline: {workloads.get('offline', {}).get('description', '')}",
                  offline_table(report["offline"]), ""]
    if report.get("rates"):
        parts += [f"rates: {workloads.get('rates', {}).get('description', '')}", rates_table(report["rates"]), ""]
    if report.get("capacity"):
        slo = next(iter(report["capacity"].values()))
        parts += [f"capacity: P99 TBT <= {fmt_seconds(slo['slo_tbt'])}, at least half the requests queued <= "
                  f"{fmt_seconds(slo['max_sched_delay'])}, all finished", capacity_table(report["capacity"]), ""]
    return "\n".join(parts).rstrip()
