"""`python -m sarathi_jax.bench.fidelity [bench flags] [--traces A,B] [--rates R1,R2]`: how far the simulator's
predictions are from the real engine's, on the same requests.

    python -m sarathi_jax.bench.fidelity --model llama-50m --scheduler sarathi,vllm,orca --token-budget 128,512 \\
        --traces conversation,arxiv --rates 0.5,2 --num-requests 48 --length-scale 0.25

1. The cost model: `--cost-model PATH` (a `step_cost --mode calibrate` JSON), else calibrated here, on this device,
   for the model, dtype and largest token budget of the runs (`step_cost.main`), and saved in `--out` when given.
2. For each trace and rate, the bench's configurations (every `--scheduler` x `--token-budget`, `runs.run_all`)
   on the real engine, then the same configurations with `--simulate --cost-model`, on the same requests (the
   workload is a function of the flags and `--seed`).
3. Per configuration: P50 and P99 TBT, P50 and P90 TTFT and output-token throughput, real and simulated, and the
   relative error (simulated / real - 1); last, the largest error of each metric. `--json PATH` writes the rows.

Every other flag is the bench's (`python -m sarathi_jax.bench --help`); `--trace` and `--qps` are taken from
`--traces` and `--rates` (default: the bench's own, one run).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import sys
import tempfile
from collections.abc import Sequence

from sarathi_jax.bench.args import build_parser, check_args
from sarathi_jax.bench.driver import RunResult

# (name, path into a run's summary)
METRICS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("TBT p50", ("tbt", "p50")), ("TBT p99", ("tbt", "p99")), ("TTFT p50", ("ttft", "p50")),
    ("TTFT p90", ("ttft", "p90")), ("output tok/s", ("output_token_throughput",)),
)


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, argparse.Namespace]:
    """(this command's own flags, the bench's flags)."""
    own = argparse.ArgumentParser(prog="python -m sarathi_jax.bench.fidelity", add_help=False)
    own.add_argument("--traces", default=None, help="comma-separated --trace values (default: the bench's workload)")
    own.add_argument("--rates", default=None, help="comma-separated --qps values (default: the bench's)")
    own.add_argument("--json", default=None, metavar="PATH", help="write the comparison rows here")
    own.add_argument("-h", "--help", action="store_true")
    mine, rest = own.parse_known_args(argv)
    if mine.help:
        print(__doc__)
        own.print_help()
        raise SystemExit(0)
    bench = build_parser().parse_args(rest)
    if bench.simulate or bench.endpoint:
        own.error("--simulate and --endpoint are this command's to set: it runs both the real engine and the simulator")
    return mine, bench


def calibrate(bench: argparse.Namespace, path: str) -> None:
    """`step_cost --mode calibrate` for the runs' model, dtype, largest budget, batch size and model length: the
    cost model. Decodes are timed at contexts 128, 512 and half the model length, so that long prompts' decodes
    are measured, not extrapolated."""
    from sarathi_jax.bench.args import DEFAULT_MAX_MODEL_LEN
    from sarathi_jax.bench.step_cost import main as step_cost

    budgets = [int(b) for b in str(bench.token_budget or "128").split(",") if b.strip().isdigit()]
    max_len = bench.max_model_len or DEFAULT_MAX_MODEL_LEN
    contexts = sorted(c for c in {128, 512, max_len // 2} if 0 < c < max_len)
    argv = ["--mode", "calibrate", "--model", bench.model, "--token-budget", str(max(budgets or [128])),
            "--max-model-len", str(max_len), "--calib-contexts", ",".join(map(str, contexts)),
            "--cost-model-out", path, "--quiet"]
    if bench.dtype:
        argv += ["--dtype", bench.dtype if bench.dtype != "auto" else "float32"]
    if bench.max_num_seqs:
        argv += ["--max-num-seqs", str(bench.max_num_seqs)]
    with contextlib.redirect_stdout(sys.stderr):  # its tables are progress here; stdout is the comparison
        if step_cost(argv) != 0:
            raise SystemExit("calibration failed")


def value(run: RunResult, path: tuple[str, ...]) -> float | None:
    node = run.summary
    for key in path:
        node = node.get(key) if isinstance(node, dict) else None
    return node


def compare(real: RunResult, sim: RunResult) -> dict:
    """One configuration's row: each metric real, simulated and the relative error."""
    row: dict = {"label": real.label, "completed": [real.summary["num_completed"], sim.summary["num_completed"]]}
    for name, path in METRICS:
        r, s = value(real, path), value(sim, path)
        row[name] = {"real": r, "sim": s, "error": None if not r or s is None else s / r - 1}
    return row


def run_pair(bench: argparse.Namespace, cost_model: str) -> list[dict]:
    """The bench's configurations on the real engine and in the simulator, compared by label."""
    from sarathi_jax.bench.runs import run_all

    real_args = copy.copy(bench)
    real_args.cost_model = None  # the simulator's alone
    check_args(real_args)
    real = {r.label: r for r in run_all(real_args).runs}
    sim_args = copy.copy(bench)
    sim_args.simulate, sim_args.cost_model = True, cost_model
    check_args(sim_args)
    sim = {r.label: r for r in run_all(sim_args).runs}
    return [compare(real[label], sim[label]) for label in real if label in sim]


def format_rows(rows: list[dict]) -> str:
    head = f"{'workload':<22} {'config':<16}" + "".join(f" {name:>24}" for name, _ in METRICS)
    lines = [head, " " * 39 + "".join(f" {'real / sim / err':>24}" for _ in METRICS)]
    for row in rows:
        cells = []
        for name, _ in METRICS:
            m = row[name]
            scale = 1 if name.startswith("output") else 1e3
            real = "-" if m["real"] is None else f"{m['real'] * scale:.1f}"
            sim = "-" if m["sim"] is None else f"{m['sim'] * scale:.1f}"
            err = "-" if m["error"] is None else f"{m['error']:+.0%}"
            cells.append(f" {real + ' / ' + sim + ' / ' + err:>24}")
        lines.append(f"{row['workload']:<22} {row['label']:<16}" + "".join(cells))
    worst = {name: max((abs(r[name]["error"]) for r in rows if r[name]["error"] is not None), default=None)
             for name, _ in METRICS}
    lines.append("largest |error|: " + ", ".join(f"{n} {'-' if e is None else f'{e:.0%}'}" for n, e in worst.items()))
    lines.append("(times in ms; error = simulated / real - 1)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    mine, bench = parse_args(argv)
    if bench.model is None:
        import jax

        from sarathi_jax.bench.args import default_model

        bench.model = default_model(jax.default_backend())
    cost_model = bench.cost_model
    with tempfile.TemporaryDirectory() as tmp:
        if cost_model is None:
            cost_model = os.path.join(bench.out or tmp, "cost_model.json")
            if bench.out:
                os.makedirs(bench.out, exist_ok=True)
            print(f"calibrating the cost model on this device -> {cost_model}", file=sys.stderr, flush=True)
            calibrate(bench, cost_model)
        rows = []
        traces = mine.traces.split(",") if mine.traces else [bench.trace]
        rates = [float(r) for r in mine.rates.split(",")] if mine.rates else [bench.qps]
        for trace in traces:
            for rate in rates:
                pair = copy.copy(bench)
                pair.trace, pair.qps, pair.out = trace, rate, None
                workload = f"{trace or 'synthetic'} @{rate if rate is not None else 'default'}"
                rows += [{"workload": workload, **row} for row in run_pair(pair, cost_model)]
    print(format_rows(rows))
    if mine.json:
        with open(mine.json, "w") as f:
            json.dump({"cost_model": bench.cost_model or "calibrated here", "rows": rows}, f, indent=1)
        print(f"wrote {mine.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
