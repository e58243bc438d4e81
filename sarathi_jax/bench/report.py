"""Console table and files (JSON, CSV, plots) for a set of benchmark runs; `print_report` is the bench's output."""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from sarathi_jax.bench.args import DEFAULT_PROMPT_LEN
from sarathi_jax.bench.driver import RunResult
from sarathi_jax.bench.metrics import fmt_seconds
from sarathi_jax.bench.plots import PLOTS_EXTRA, have_matplotlib, write_plots  # matplotlib loads only to plot
from sarathi_jax.bench.structured import constrained_cell

if TYPE_CHECKING:
    from sarathi_jax.bench.runs import BenchRuns


def _num(x: Any, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def prefix_hit_rate(run: RunResult) -> float | None:
    """Prompt tokens found in the prefix cache / prompt tokens looked up (None: caching off or unknown)."""
    pc = run.prefix_cache
    return pc["hits"] / pc["queries"] if pc and pc["queries"] else None


def table_rows(runs: Sequence[RunResult], capacities: dict | None = None) -> tuple[list[str], list[list[str]]]:
    show_goodput = any(r.summary.get("goodput") for r in runs)
    show_classes = any(r.summary.get("slo_classes") for r in runs)
    show_prefix = any(prefix_hit_rate(r) is not None for r in runs)
    show_constrained = any(r.summary.get("structured_outputs") for r in runs)
    header = ["run", "done", "P50 TTFT", "P99 TTFT", "P50 TBT", "P99 TBT", "P50 sched", "req/s", "out tok/s",
              "preempt", "stalls"]
    if show_prefix:
        header += ["prefill tok", "prefix hit"]
    if show_constrained:
        header.append("constrained")
    if show_goodput:
        header.append("goodput")
    if show_classes:
        header.append("goodput (own SLOs)")
    if capacities:
        header.append("capacity")
    rows = []
    for r in runs:
        s = r.summary
        row = [
            r.label,
            f"{s['num_completed']}/{s['num_requests']}",
            fmt_seconds(s["ttft"]["p50"]),
            fmt_seconds(s["ttft"]["p99"]),
            fmt_seconds(s["tbt"]["p50"]),
            fmt_seconds(s["tbt"]["p99"]),
            fmt_seconds(s["scheduling_delay"]["p50"]),
            _num(s["request_throughput"]),
            _num(s["output_token_throughput"], "{:.1f}"),
            str(s["num_preemptions"]),
            str(s["num_stalls"]),
        ]
        if show_prefix:
            rate = prefix_hit_rate(r)
            row += [str(s["iterations"].get("num_prefill_tokens", "-")), "-" if rate is None else f"{rate:.0%}"]
        if show_constrained:
            row.append(constrained_cell(s.get("structured_outputs")))
        if show_goodput:
            g = s.get("goodput") or {}
            row.append("-" if g.get("goodput") is None else f"{g['goodput']:.2f}/s ({g['good_fraction']:.0%})")
        if show_classes:
            row.append(_goodput_cell((s.get("slo_classes") or {}).get("overall")))
        if capacities:
            c = capacities.get(r.label)
            row.append("-" if c is None else f"{c.capacity_qps:.3g} req/s")
        rows.append(row)
    return header, rows


def _goodput_cell(part: dict | None) -> str:
    if not part or part.get("goodput") is None:
        return "-"
    return f"{part['goodput']:.2f}/s ({part['good_fraction']:.0%})"


def class_table_rows(runs: Sequence[RunResult]) -> tuple[list[str], list[list[str]]]:
    """One row per run and SLO class (--slo-mix): its requests, targets, goodput and TTFT."""
    header = ["run", "class", "requests", "TTFT SLO", "TBT SLO", "goodput", "P50 TTFT", "P99 TTFT"]
    rows = []
    for r in runs:
        for name, c in ((r.summary.get("slo_classes") or {}).get("classes") or {}).items():
            rows.append([r.label, name, str(c["num_requests"]), fmt_seconds(c["slo_ttft"]), fmt_seconds(c["slo_tbt"]),
                         _goodput_cell(c), fmt_seconds(c["ttft"]["p50"]), fmt_seconds(c["ttft"]["p99"])])
    return header, rows


def policy_reading(runs: Sequence[RunResult]) -> str | None:
    """One line reading sarathi against the prefill-first baseline (vllm) on the same requests: stalls and P99
    TBT, and TTFT, which a prefill-first policy buys with them. None unless both policies ran and produced tokens.
    The first run of each policy is read (the first token budget, prefix caching as listed)."""
    first: dict[str, RunResult] = {}
    for r in runs:
        first.setdefault(r.config.get("scheduler"), r)
    sarathi, vllm = first.get("sarathi"), first.get("vllm")
    if sarathi is None or vllm is None:
        return None
    s, v = sarathi.summary, vllm.summary
    if s["tbt"]["p99"] is None or v["tbt"]["p99"] is None:
        return None
    figures = (f"{sarathi.label}: {s['num_stalls']} stalls, P99 TBT {fmt_seconds(s['tbt']['p99'])}; "
               f"vllm: {v['num_stalls']} stalls, P99 TBT {fmt_seconds(v['tbt']['p99'])}")
    # P99 TBT decides: a stall is a TBT above 5x its own run's median, so the counts of two runs with different
    # medians do not compare (a loaded machine gives the run with the shorter median more of them).
    if s["tbt"]["p99"] < v["tbt"]["p99"]:
        price = ""
        if s["num_stalls"] > v["num_stalls"]:
            price = " (more stalls: each run counts the TBTs above 5x its own median TBT)"
        if s["ttft"]["p50"] is not None and v["ttft"]["p50"] is not None and s["ttft"]["p50"] > v["ttft"]["p50"]:
            price += (f"; the price is time to first token (P50 {fmt_seconds(s['ttft']['p50'])} against "
                     f"{fmt_seconds(v['ttft']['p50'])}), as a prompt now takes several iterations")
        return (f"reading: {figures}. vllm runs each new prompt's whole prefill while the running requests wait for "
                f"their next token; sarathi splits prompts into chunks under its token budget and decodes in every "
                f"batch, {v['tbt']['p99'] / s['tbt']['p99']:.1f}x lower P99 TBT{price}")
    return (f"reading: {figures}. No stall-free advantage on this run: on this model and workload a whole prefill "
            f"is too short to hold decodes back (or other load on the machine hid it); longer prompts or a larger "
            f"model (--model llama-50m) show it")


def format_table(runs: Sequence[RunResult], capacities: dict | None = None) -> str:
    return format_rows(*table_rows(runs, capacities))


def format_rows(header: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1) -> str:
    """A plain-text table: the first `left` columns left-aligned, the others right-aligned."""
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) if i < left else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths)))]
    lines.append("  ".join("-" * w for w in widths))
    for row in rows:
        lines.append("  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
    return "\n".join(lines)


def safe_name(label: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in label)


class _Encoder(json.JSONEncoder):
    def default(self, o: Any) -> Any:
        if isinstance(o, np.integer):
            return int(o)
        if isinstance(o, np.floating):
            return float(o)
        if isinstance(o, np.ndarray):
            return o.tolist()
        return super().default(o)


def _clean(x: Any) -> Any:
    """inf/nan -> None so the JSON is standard."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def write_json(path: str, obj: Any, indent: int | None = 1) -> None:
    with open(path, "w") as f:
        json.dump(_clean(obj), f, indent=indent, cls=_Encoder)
        f.write("\n")


REQUEST_COLUMNS = ("request_id", "arrival_time", "prompt_len", "max_tokens", "num_output_tokens", "finish_reason",
                   "ttft", "scheduling_delay", "e2e_latency", "normalized_latency", "tbt_mean", "tbt_max",
                   "num_preemptions", "error")
ITERATION_COLUMNS = ("iteration", "start_time", "duration", "num_prefill_tokens", "num_decode_tokens", "num_seqs",
                     "num_padded_tokens", "num_preemptions", "chunk_sizes", "instance", "transfer_bytes",
                     "transfer_seconds", "token_limit", "predicted_s", "slack_s")


def write_run(out_dir: str, run: RunResult, workload_info: dict, capacity: Any = None) -> list[str]:
    """`<label>.json` (everything), `<label>_requests.csv`, `<label>_iterations.csv`. Returns the paths."""
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, safe_name(run.label))
    doc = {
        "label": run.label,
        "config": run.config,
        "workload": workload_info,
        "summary": run.summary,
        "num_preemptions": run.num_preemptions,
        "wall_time": run.wall_time,
        "stopped_early": run.stopped_early,
        "capacity": None if capacity is None else capacity.to_dict(),
        "requests": [r.to_dict() for r in run.records],
        "iterations": run.iterations,
        "prefix_cache": run.prefix_cache,
        "transfer": run.transfer,
        "speculation": run.speculation,
    }
    write_json(base + ".json", doc, indent=None)  # large: one line
    with open(base + "_requests.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(REQUEST_COLUMNS)
        for r in run.records:
            tbts = r.tbts
            d = r.to_dict()
            d["tbt_mean"] = float(np.mean(tbts)) if tbts else None
            d["tbt_max"] = max(tbts) if tbts else None
            w.writerow(["" if d[c] is None else d[c] for c in REQUEST_COLUMNS])
    with open(base + "_iterations.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(ITERATION_COLUMNS)
        for it in run.iterations:
            w.writerow([" ".join(map(str, it[c])) if c == "chunk_sizes" else it.get(c, "") for c in ITERATION_COLUMNS])
    return [base + ".json", base + "_requests.csv", base + "_iterations.csv"]


SUMMARY_COLUMNS = (
    ("run", lambda r, s: r.label),
    ("num_requests", lambda r, s: s["num_requests"]),
    ("num_completed", lambda r, s: s["num_completed"]),
    ("ttft_p50", lambda r, s: s["ttft"]["p50"]),
    ("ttft_p90", lambda r, s: s["ttft"]["p90"]),
    ("ttft_p99", lambda r, s: s["ttft"]["p99"]),
    ("tbt_p50", lambda r, s: s["tbt"]["p50"]),
    ("tbt_p90", lambda r, s: s["tbt"]["p90"]),
    ("tbt_p99", lambda r, s: s["tbt"]["p99"]),
    ("tbt_max", lambda r, s: s["tbt"]["max"]),
    ("e2e_p50", lambda r, s: s["e2e_latency"]["p50"]),
    ("e2e_p99", lambda r, s: s["e2e_latency"]["p99"]),
    ("sched_delay_p50", lambda r, s: s["scheduling_delay"]["p50"]),
    ("sched_delay_p99", lambda r, s: s["scheduling_delay"]["p99"]),
    ("normalized_latency_p50", lambda r, s: s["normalized_latency"]["p50"]),
    ("request_throughput", lambda r, s: s["request_throughput"]),
    ("output_token_throughput", lambda r, s: s["output_token_throughput"]),
    ("total_token_throughput", lambda r, s: s["total_token_throughput"]),
    ("num_preemptions", lambda r, s: s["num_preemptions"]),
    ("num_stalls", lambda r, s: s["num_stalls"]),
    ("goodput", lambda r, s: (s.get("goodput") or {}).get("goodput")),
    ("num_prefill_tokens", lambda r, s: s["iterations"].get("num_prefill_tokens")),
    ("prefix_cache_hit_rate", lambda r, s: prefix_hit_rate(r)),
    ("num_iterations", lambda r, s: s["iterations"].get("num_iterations")),
    ("wall_time", lambda r, s: r.wall_time),
)


def write_summary(out_dir: str, runs: Sequence[RunResult], capacities: dict | None, meta: dict) -> list[str]:
    """`summary.csv` (one row per run) and `summary.json` (the run summaries, capacities and the invocation)."""
    os.makedirs(out_dir, exist_ok=True)
    cols = list(SUMMARY_COLUMNS)
    if capacities:
        cols.append(("capacity_qps", lambda r, s: capacities[r.label].capacity_qps if r.label in capacities else None))
    csv_path = os.path.join(out_dir, "summary.csv")
    with open(csv_path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow([c for c, _ in cols])
        for r in runs:
            w.writerow(["" if (v := fn(r, r.summary)) is None else v for _, fn in cols])
    json_path = os.path.join(out_dir, "summary.json")
    write_json(json_path, {
        **meta,
        "runs": [{"label": r.label, "config": r.config, "summary": r.summary, "prefix_cache": r.prefix_cache}
                 for r in runs],
        "capacity": {k: v.to_dict() for k, v in (capacities or {}).items()},
    })
    return [csv_path, json_path]


def transfer_line(transfer: dict, *, virtual: bool) -> str:
    """A disaggregated run's KV transfers: count, bytes, time (the link model's, or measured), mean rate."""
    n, nbytes, seconds = transfer["num_transfers"], transfer["bytes"], transfer["seconds"]
    rate = f", {nbytes / seconds / 1e9:.3g} GB/s" if seconds > 0 else ""
    each = seconds / n if n else 0.0
    each_text = f"{each * 1e6:.3g} us" if each < 1e-3 else fmt_seconds(each)
    mean = f" (mean {each_text}, {nbytes / n / 2**20:.3g} MiB each{rate})" if n else ""
    how = "the link model's time" if virtual else "measured from the gather's dispatch to the copy seen done"
    return f"transfer: {n} KV moves, {nbytes / 2**20:.4g} MiB, {fmt_seconds(seconds)} in all{mean}; {how}"


def speculation_line(spec: dict) -> str:
    """A speculating run's drafts: proposed, accepted (the acceptance rate), and the tokens each verification
    step emitted on average (accepted drafts plus the target's own token)."""
    drafts, accepted, steps, emitted = (spec[k] for k in ("draft_tokens", "accepted_tokens", "verify_steps",
                                                          "emitted_tokens"))
    rate = f" (acceptance {accepted / drafts:.2f})" if drafts else ""
    per_step = f", {emitted / steps:.2f} tokens per verification step" if steps else ""
    return f"speculation: {drafts} draft tokens, {accepted} accepted{rate}; {steps} verification steps{per_step}"


def print_report(args: argparse.Namespace, results: BenchRuns) -> None:
    """The comparison table and notes on stdout; with --out, per-run JSON/CSV, the summary and plots."""
    runs, capacities, fitted, slo_tbt = results.runs, results.capacities, results.fitted, results.slo_tbt
    decode_time, workload_info = results.decode_time, results.workload_info
    print()
    print(f"workload: {fitted.describe()}")
    if slo_tbt is not None:
        extra = f" ({args.slo_tbt_multiple:g}x decode-only iteration {fmt_seconds(decode_time)})" if decode_time else ""
        print(f"TBT SLO: {fmt_seconds(slo_tbt)}{extra}")
    print(format_table(runs, capacities))
    if any(r.summary.get("slo_classes") for r in runs):
        print("SLO classes (a request is good when it completes within both its TTFT and every-token TBT targets):")
        print(format_rows(*class_table_rows(runs), left=2))
    for run in runs:
        if run.pipeline and run.pipeline.get("bubble_fraction") is not None:
            p = run.pipeline
            print(f"[{run.label}] pipeline: bubble fraction {p['bubble_fraction']:.2f} over {p['num_stages']} stages, "
                  f"max micro-batches in flight {p['max_in_flight']}")
    for run in runs:
        if run.transfer:
            print(f"[{run.label}] {transfer_line(run.transfer, virtual=bool(args.simulate))}")
        if run.speculation:
            print(f"[{run.label}] {speculation_line(run.speculation)}")
    for run in runs:
        setup = (run.config or {}).get("token_budget_setup")
        if setup and setup["mode"] != "fixed":  # "auto"/"dynamic": the choice, its prediction, the measured P99 TBT
            print(f"[{run.label}] {setup['words']}; measured P99 TBT {fmt_seconds(run.summary['tbt']['p99'])}"
                  f"{prediction_line(run.summary.get('iterations', {}))}")
    for run in runs:
        if args.prompts_file and run.first_completion is not None:
            print(f"[{run.label}] first completion: {run.first_completion!r}")
    print(f"stalls: TBTs above {args.stall_factor:g}x the run's median TBT"
          + ("; virtual time (simulator)" if args.simulate else ""))
    line = policy_reading(runs)
    if line:
        print(line)
        if args.prompt_len == DEFAULT_PROMPT_LEN and not (args.trace or args.prompts_file):
            print(f"(the default prompts, {DEFAULT_PROMPT_LEN}, are long on purpose: a small model's step is short, "
                  "and a short prefill barely holds the running decodes back)")

    if args.out:
        meta = {
            "argv": args.argv if args.argv is not None else sys.argv[1:],
            "workload": fitted.summary(),
            "slo_tbt": slo_tbt,
            "slo_ttft": args.slo_ttft,
            "decode_only_iteration_time": decode_time,
            "simulate": args.simulate,
            "cost_model": args.cost_model,
        }
        paths = []
        for r in runs:
            paths += write_run(args.out, r, workload_info.get(r.label, fitted.summary()), capacities.get(r.label))
        paths += write_summary(args.out, runs, capacities, meta)
        if not args.no_plots and not have_matplotlib():
            print(f"(no PNG plots: matplotlib is not installed, the plots extra: {PLOTS_EXTRA}; --no-plots skips them)")
        elif not args.no_plots:
            paths += write_plots(args.out, runs, capacities, slo_tbt, args.stall_factor)
        print(f"wrote {len(paths)} files to {args.out}/")
    else:
        print("(pass --out DIR to save JSON, CSV and PNG plots)")


def prediction_line(iteration_stats: dict) -> str:
    """The report's words on a dynamic budget's iterations: the median budget, and the P5 / P50 / P95 of each
    step's time against its prediction (empty without predictions)."""
    err, limit = iteration_stats.get("prediction_error"), iteration_stats.get("token_limit") or {}
    if not err:
        return ""
    budgets = f"; budget P50 {limit['p50']:.0f} tokens" if limit.get("p50") is not None else ""
    return (f"{budgets}; step time against its prediction {err['p5']:+.0%} / {err['p50']:+.0%} / {err['p95']:+.0%} "
            f"(P5 / P50 / P95)")
