"""The capacity experiment's command line (`main`): the grid's runs into DIR, the report, then the `--verify`
points; see the package docstring."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shlex
import sys
import time
from typing import Any, Callable, Sequence

from benchmarks.gpu_capacity.report import collect, format_report, machine_info, plot
from benchmarks.gpu_capacity.settings import (COST_MODEL_FILE, DECODE_TIME_FILE, PAPER_PROBES, PAPER_SAMPLE, POLICIES,
                                              SLO_MULTIPLES, Experiment, bench_argv, defaults, run_name)
from benchmarks.gpu_capacity.verify import verify
from sarathi_jax.bench.__main__ import main as bench_main
from sarathi_jax.bench.plots import PLOTS_EXTRA, have_matplotlib
from sarathi_jax.bench.traces import SHIPPED_TRACES as TRACE_FILES
from sarathi_jax.utils.paths import cli_path

def _names(text: str | None) -> tuple[str, ...] | None:
    return tuple(x.strip() for x in text.split(",") if x.strip()) if text else None


def build_parser() -> argparse.ArgumentParser:
    d = Experiment()
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_capacity",
                                description=sys.modules["benchmarks.gpu_capacity"].__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=cli_path, required=True, metavar="DIR")
    p.add_argument("--trace-dir", type=cli_path, default=None,
                   help=f"a folder with other copies of {' and '.join(TRACE_FILES.values())} (default: the traces "
                        "shipped in the package, by name)")
    p.add_argument("--smoke", action="store_true", help="tiny-llama, a handful of requests: checks the pipeline")
    p.add_argument("--traces", default=None, help=f"comma-separated, from {', '.join(TRACE_FILES)} (default all)")
    p.add_argument("--slos", default=None, help="comma-separated, from strict, relaxed (default both)")
    p.add_argument("--policies", default=None, help=f"comma-separated, from {', '.join(POLICIES)} (default all)")
    p.add_argument("--model", default=None, help=f"default {d.model}")
    p.add_argument("--dtype", default=None, help=f"default {d.dtype}")
    p.add_argument("--max-model-len", type=int, default=None, help=f"default {d.max_model_len}")
    p.add_argument("--max-num-seqs", type=int, default=None, help=f"default {d.max_num_seqs}")
    p.add_argument("--length-scale", type=float, default=None,
                   help="the traces' prompt and output lengths times this (default 1: the paper's lengths)")
    p.add_argument("--sample", type=int, default=None,
                   help=f"requests per probe (default {d.sample}; simulated {PAPER_SAMPLE}, the paper's)")
    p.add_argument("--capacity-probes", type=int, default=None,
                   help=f"default {d.capacity_probes} (simulated {PAPER_PROBES})")
    p.add_argument("--token-budgets", default=None,
                   help=f"sarathi's token budgets, comma-separated (default {','.join(map(str, d.sarathi_budgets))})")
    p.add_argument("--start-qps", type=float, default=None, help="the capacity search's first probed rate")
    p.add_argument("--kv-cache-bytes", type=int, default=None,
                   help="a fixed KV cache size (default: from free memory; simulated: the calibrated engine's)")
    p.add_argument("--simulate", action="store_true", help="the grid on the simulator over a calibrated cost model")
    p.add_argument("--cost-model", type=cli_path, default=None, metavar="PATH",
                   help=f"--simulate: a `step_cost --mode calibrate` JSON (default DIR/{COST_MODEL_FILE}, calibrated "
                        "on this device when missing)")
    p.add_argument("--devices", type=int, default=None, metavar="N",
                   help="--simulate: tensor parallel over N devices (extrapolated through the TP cost model)")
    p.add_argument("--verify", type=int, default=0, metavar="N",
                   help="--simulate: run N points of the grid on the real engine too, beside the simulator")
    p.add_argument("--verify-sample", type=int, default=None,
                   help=f"requests per probe of the --verify points, both sides (default {d.verify_sample})")
    p.add_argument("--dry-run", action="store_true", help="print the bench commands and stop")
    return p


def experiment_of(args: argparse.Namespace) -> Experiment:
    """The settings the command line asks for; ValueError naming the flag for one that cannot work."""
    overrides = {"traces": _names(args.traces), "slos": _names(args.slos), "policies": _names(args.policies),
                 "model": args.model, "dtype": args.dtype, "max_model_len": args.max_model_len,
                 "max_num_seqs": args.max_num_seqs, "length_scale": args.length_scale,
                 "sample": args.sample, "capacity_probes": args.capacity_probes,
                 "sarathi_budgets": tuple(int(b) for b in _names(args.token_budgets)) if args.token_budgets else None,
                 "start_qps": args.start_qps, "kv_cache_bytes": args.kv_cache_bytes, "devices": args.devices,
                 "verify": args.verify or None, "verify_sample": args.verify_sample}
    exp = dataclasses.replace(defaults(args.smoke, args.simulate),
                              **{k: v for k, v in overrides.items() if v is not None})
    # The decode probe's prompts and their 32 outputs fit the model length (the bench caps them): say the context.
    context = min(exp.decode_probe_context, exp.max_model_len - min(32, exp.max_model_len // 2))
    exp = dataclasses.replace(exp, decode_probe_context=context)
    for name, known in (("traces", TRACE_FILES), ("slos", SLO_MULTIPLES), ("policies", POLICIES)):
        unknown = [x for x in getattr(exp, name) if x not in known]
        if unknown:
            raise ValueError(f"--{name}: unknown {unknown}; choose from {', '.join(known)}")
    if not exp.simulate and (args.cost_model or exp.devices or exp.verify):
        raise ValueError("--cost-model, --devices and --verify are for the simulated grid: add --simulate")
    if exp.verify < 0 or exp.verify_sample < 1 or (exp.devices is not None and exp.devices < 1):
        raise ValueError("--verify must be >= 0, --verify-sample and --devices >= 1")
    if exp.verify and (exp.devices or 1) > 1:
        raise ValueError("--verify runs the real engine on one device: not with --devices N > 1")
    return exp


def cost_model_path(exp: Experiment, args: argparse.Namespace) -> str:
    """The simulated grid's cost model: --cost-model, else DIR's, else calibrated here on this device into DIR."""
    if args.cost_model:
        return args.cost_model
    path = os.path.join(args.out, COST_MODEL_FILE)
    if not os.path.exists(path):
        from sarathi_jax.bench.fidelity import calibrate

        print(f"calibrating the cost model on this device -> {path}", flush=True)
        t0 = time.monotonic()
        calibrate(argparse.Namespace(model=exp.model, dtype=exp.dtype, max_num_seqs=exp.max_num_seqs,
                                     max_model_len=exp.max_model_len,
                                     token_budget=",".join(map(str, exp.sarathi_budgets))), path)
        print(f"calibrated in {time.monotonic() - t0:.0f} s", flush=True)
    return path


def with_calibrated_kv(exp: Experiment, source: dict) -> Experiment:
    """A simulated grid without --kv-cache-bytes holds the KV cache of the engine its cost model was calibrated
    on (`source`: the cost model's, which records it), as the real engine on that device would."""
    kv = source.get("kv_cache_bytes")
    return exp if exp.kv_cache_bytes is not None or kv is None else dataclasses.replace(exp, kv_cache_bytes=int(kv))


def finished(run_dir: str, argv: list[str], slo_tbt: float | None) -> bool:
    """`run_dir` holds a run of `argv` at the TBT SLO `slo_tbt` (None: not known yet). The simulator is
    deterministic: a later invocation, for example one adding --verify on a GPU, keeps the run instead of
    simulating it again. The SLO is compared in seconds (the first run was given it as a multiple)."""
    path = os.path.join(run_dir, "summary.json")
    if slo_tbt is None or not os.path.exists(path):
        return False
    with open(path) as f:
        doc = json.load(f)
    return (_without_slo(doc.get("argv") or []) == _without_slo(argv) and doc.get("slo_tbt") is not None
            and math.isclose(doc["slo_tbt"], slo_tbt, rel_tol=1e-9))


def _without_slo(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--slo-tbt", "--slo-tbt-multiple"):
            skip = True
        else:
            out.append(a)
    return out


def run_grid(exp: Experiment, args: argparse.Namespace, cost_model: str | None,
             engine_factory: Callable[[dict], Any] | None) -> tuple[int, float | None]:
    """Every trace x SLO of `exp` into DIR; returns (exit status, the decode iteration time)."""
    decode_path = os.path.join(args.out, DECODE_TIME_FILE)
    decode_time = None  # measured by the first run into DIR, reused by every later one (also across invocations)
    if os.path.exists(decode_path):
        with open(decode_path) as f:
            decode_time = json.load(f)["decode_only_iteration_time"]
    commands = []
    for trace in exp.traces:
        trace_path = os.path.join(args.trace_dir, TRACE_FILES[trace]) if args.trace_dir else trace
        for slo in exp.slos:
            run_dir = os.path.join(args.out, f"{trace}-{slo}", run_name(exp))
            slo_tbt = None if decode_time is None else SLO_MULTIPLES[slo] * decode_time
            argv = bench_argv(exp, trace_path, run_dir, slo, slo_tbt, cost_model)
            if exp.simulate and not args.dry_run and finished(run_dir, argv, slo_tbt):
                print(f"[{trace}, {slo}] kept: {run_dir} holds this simulated run", flush=True)
                continue
            commands.append("python -m sarathi_jax.bench " + shlex.join(argv))
            print(f"[{trace}, {slo}] {commands[-1]}", flush=True)
            if args.dry_run:  # (a real run passes the first run's measured SLO to the later ones as --slo-tbt)
                continue
            t0 = time.monotonic()
            rc = bench_main(argv, engine_factory=engine_factory)
            if rc != 0:
                print(f"[{trace}, {slo}] the bench failed (exit {rc})", file=sys.stderr)
                return rc, decode_time
            print(f"[{trace}, {slo}] done in {time.monotonic() - t0:.0f} s", flush=True)
            if decode_time is None:
                with open(os.path.join(run_dir, "summary.json")) as f:
                    decode_time = json.load(f)["decode_only_iteration_time"]
                with open(decode_path, "w") as f:
                    json.dump({"decode_only_iteration_time": decode_time, "measured_by": commands[-1]}, f, indent=1)
    with open(os.path.join(args.out, "commands.sh"), "a") as f:
        f.write("\n".join(commands) + "\n")
    return 0, decode_time


def main(argv: Sequence[str] | None = None, *, engine_factory: Callable[[dict], Any] | None = None) -> int:
    """`engine_factory`: passed to the bench (tests drive the pipeline with a simulated engine)."""
    args = build_parser().parse_args(argv)
    try:
        exp = experiment_of(args)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    cost_model, cost_doc = None, None
    if exp.simulate:
        cost_model = (args.cost_model or os.path.join(args.out, COST_MODEL_FILE) if args.dry_run
                      else cost_model_path(exp, args))
        if os.path.exists(cost_model):  # (a dry run may name one not calibrated yet)
            from sarathi_jax.sim.cost_model import BucketCostModel

            cost_doc = BucketCostModel.load(cost_model).to_dict()
            exp = with_calibrated_kv(exp, cost_doc["source"])
    rc, decode_time = run_grid(exp, args, cost_model, engine_factory)
    if rc != 0 or args.dry_run:
        return rc
    info = machine_info()
    table = collect(args.out)
    with open(os.path.join(args.out, "machine.json"), "w") as f:
        json.dump({**info, "experiment": dataclasses.asdict(exp), "cost_model": cost_doc,
                   "decode_only_iteration_time": decode_time}, f, indent=1)
    with open(os.path.join(args.out, "capacity.json"), "w") as f:
        json.dump(table, f, indent=1)
    report = format_report(table, exp, decode_time, info, cost_doc)
    with open(os.path.join(args.out, "capacity.md"), "w") as f:
        f.write(report + "\n")
    png = ""
    if have_matplotlib():
        png = os.path.basename(plot(table, os.path.join(args.out, "capacity.png"))) + ", "
    else:
        print(f"(no capacity.png: the plot needs matplotlib, {PLOTS_EXTRA})", file=sys.stderr)
    print()
    print(report)
    print(f"wrote {args.out}/capacity.md, capacity.json, {png}machine.json, commands.sh and one folder per run")
    if exp.verify:
        return verify(exp, args, table, cost_model, engine_factory)
    return 0
