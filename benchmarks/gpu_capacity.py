"""`python -m benchmarks.gpu_capacity --out DIR`: the paper's capacity experiment (Sarathi-Serve, Fig. 10)
on a real device with the real engine, as bench invocations, then one report.

For each trace (arxiv_summarization, conversation) and SLO (strict: P99 TBT <= 5x the decode-only iteration
time; relaxed: 25x), one `python -m sarathi_jax.bench --capacity` run searches the highest request rate each
policy sustains: sarathi at two token budgets (the paper's 512 and 2048), vllm and orca (whole prompts, at most
`--max-num-seqs` sequences, the paper's largest vLLM batch). The decode-only iteration time is measured once,
by the first run into DIR (kept in `decode_time.json`), and every later run gets the same SLO in seconds.

The experiment can be run in pieces (`--traces`, `--slos`, `--policies`; for example one trace, SLO and policy
per command where a command may run only minutes) into the same DIR: every invocation rebuilds the report from
all the runs there. Writes, under DIR:

- `<trace>-<slo>/<policies>/`: the bench's own output for one run (per-run JSON/CSV, summary.json, TBT CDF
  and capacity PNGs);
- `commands.sh`: every bench command, as run (appended to);
- `machine.json`: platform, device, versions, git commit, `nvidia-smi` when there is one;
- `capacity.md`, `capacity.json` and `capacity.png`: the capacities side by side, sarathi's best over vllm per
  trace and SLO.

`--smoke` runs the same pipeline in a few minutes on a CPU (tiny-llama, six requests, two probes), so the script
is known to work before a GPU is spent on it. A capacity marked ">=" passed every probe (the search found no
failing rate: a lower bound); "<" failed every probe (below the lowest rate probed); "<=" passed probes above the
fastest completion rate measured (too short to build a queue), so the capacity is at most that rate.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from sarathi_jax.bench.__main__ import main as bench_main
from sarathi_jax.bench.traces import SHIPPED_TRACES as TRACE_FILES
from sarathi_jax.config.engine_config import resolve_dtype
from sarathi_jax.utils.paths import cli_path

SLO_MULTIPLES = {"strict": 5.0, "relaxed": 25.0}  # x the decode-only iteration time (the paper's section 5)
POLICIES = ("sarathi", "vllm", "orca")
DECODE_TIME_FILE = "decode_time.json"
PAPER_NOTE = ("Sarathi-Serve (OSDI'24): Mistral-7B on one A100, up to 2.6x the capacity of vLLM under the strict "
              "P99-TBT SLO, with sarathi token budgets of 512 and 2048")


@dataclass(frozen=True)
class Experiment:
    """One full experiment's settings (the GPU defaults, or `--smoke`'s)."""

    model: str = "mistral-7b"
    dtype: str = "bfloat16"
    traces: tuple[str, ...] = ("arxiv", "conversation")
    slos: tuple[str, ...] = ("strict", "relaxed")
    sarathi_budgets: tuple[int, ...] = (512, 2048)
    max_num_seqs: int = 128
    max_model_len: int = 4096
    sample: int = 128  # requests per probe; the paper replays more
    length_scale: float = 1.0
    capacity_probes: int = 6
    decode_probe_batch: int = 32
    kv_cache_bytes: int | None = None  # None: sized from the device's free memory (gpu_memory_utilization)
    start_qps: float | None = None  # the capacity search's first probe (None: the bench's default, 1 req/s)
    seed: int = 0
    policies: tuple[str, ...] = POLICIES


def _names(text: str | None) -> tuple[str, ...] | None:
    return tuple(x.strip() for x in text.split(",") if x.strip()) if text else None


SMOKE = Experiment(model="tiny-llama", dtype="auto", sarathi_budgets=(32, 64), max_num_seqs=8, max_model_len=256,
                   sample=6, length_scale=0.05, capacity_probes=2, decode_probe_batch=4)


def bench_argv(exp: Experiment, trace_path: str, out_dir: str, slo: str, slo_tbt: float | None) -> list[str]:
    """The bench command line for one trace and SLO; `slo_tbt`: seconds, or None to measure the decode time."""
    argv = ["--model", exp.model, "--dtype", exp.dtype, "--trace", trace_path, "--sample", str(exp.sample),
            "--length-scale", f"{exp.length_scale:g}", "--seed", str(exp.seed),
            "--scheduler", ",".join(exp.policies), "--token-budget", ",".join(map(str, exp.sarathi_budgets)),
            "--max-num-seqs", str(exp.max_num_seqs), "--max-model-len", str(exp.max_model_len),
            "--capacity", "--capacity-probes", str(exp.capacity_probes),
            "--decode-probe-batch", str(exp.decode_probe_batch), "--out", out_dir]  # not --quiet: start-up lines, probes
    if exp.start_qps is not None:
        argv += ["--capacity-start-qps", f"{exp.start_qps:g}"]
    if exp.kv_cache_bytes is not None:
        argv += ["--kv-cache-bytes", str(exp.kv_cache_bytes)]
    if slo_tbt is None:
        argv += ["--slo-tbt-multiple", f"{SLO_MULTIPLES[slo]:g}"]
    else:
        argv += ["--slo-tbt", repr(slo_tbt)]
    return argv


def run_name(exp: Experiment) -> str:
    """One run's folder name: its engines' labels (sarathi once per budget), so runs made piece by piece
    (one policy or budget per command) land in folders of their own."""
    return "-".join(f"sarathi-{b}" if p == "sarathi" else p for p in exp.policies
                    for b in (exp.sarathi_budgets if p == "sarathi" else (None,)))


def machine_info() -> dict:
    import importlib.metadata

    import jax

    info = {
        "platform": jax.default_backend(),
        "devices": [d.device_kind for d in jax.devices()],
        "python": platform.python_version(),
        "os": platform.platform(),
        "versions": {},
    }
    for pkg in ("jax", "jaxlib", "flax", "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin",
                "jax-cuda12-pjrt", "torch", "transformers"):
        try:
            info["versions"][pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            pass
    for key, cmd in (("git_commit", ["git", "rev-parse", "HEAD"]),
                     ("nvidia_smi", ["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                     "--format=csv,noheader"])):
        try:
            info[key] = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            info[key] = None
    return info


def collect(out: str) -> dict:
    """{trace: {slo: {"slo_tbt": s, "capacity": {label: req/s}, "bound": {label: "", ">=", "<" or "<="},
    "probes": {label: [...]}, "throughput": {label: req/s}}}} from every run folder in `out` (`<trace>-<slo>/<policies>/summary.json`), so
    runs made piece by piece, by several invocations, make one report."""
    table: dict = {}
    for trace in TRACE_FILES:
        for slo in SLO_MULTIPLES:
            folder = os.path.join(out, f"{trace}-{slo}")
            for group in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
                path = os.path.join(folder, group, "summary.json")
                if not os.path.exists(path):
                    continue
                with open(path) as f:
                    doc = json.load(f)
                entry = table.setdefault(trace, {}).setdefault(
                    slo, {"slo_tbt": doc["slo_tbt"], "capacity": {}, "bound": {}, "probes": {}, "throughput": {}})
                for label, c in doc["capacity"].items():
                    top = c.get("max_throughput")
                    beyond = c.get("beyond_throughput", False)
                    # A pass above the fastest completion rate proves nothing: the capacity is at most that rate.
                    entry["capacity"][label] = top if beyond else c["capacity_qps"]
                    entry["bound"][label] = "<=" if beyond else _bound(c)
                    entry["probes"][label] = c["probes"]
                    entry["throughput"][label] = top
    return table


def _bound(capacity: dict) -> str:
    """">=" when no probe failed (the search stopped below the capacity), "<" when none passed, else ""."""
    if capacity["bracket"][1] is None:
        return ">="
    if capacity["capacity_qps"] == 0:
        return "<"
    return ""


def _cell(r: dict, label: str) -> str:
    if label not in r["capacity"]:
        return "-"
    if r["bound"][label] == "<":
        return f"< {min(p['qps'] for p in r['probes'][label]):.3g}"
    return f"{r['bound'][label]}{r['capacity'][label]:.3g}"


def sarathi_over_vllm(capacity: dict) -> float | None:
    best = max((q for label, q in capacity.items() if label.startswith("sarathi")), default=None)
    vllm = capacity.get("vllm")
    return best / vllm if best is not None and vllm else None


def format_report(table: dict, exp: Experiment, decode_time: float, info: dict) -> str:
    lines = [f"Model {exp.model} ({resolve_dtype(exp.dtype, info['platform'])}) on {info['platform']} [{', '.join(sorted(set(info['devices'])))}]; "
             f"{exp.sample} requests per probe, length scale {exp.length_scale:g}, at most {exp.capacity_probes} "
             f"probes per configuration; decode-only iteration time (batch {exp.decode_probe_batch}) "
             f"{decode_time * 1e3:.1f} ms.", "", f"Paper: {PAPER_NOTE}.", ""]
    for trace, by_slo in table.items():
        labels = list(dict.fromkeys(label for r in by_slo.values() for label in r["capacity"]))
        slos = list(by_slo)
        lines += [f"### {trace}", "",
                  "| policy | " + " | ".join(f"{s} ({by_slo[s]['slo_tbt'] * 1e3:.1f} ms) req/s" for s in slos) + " |",
                  "| --- |" + " --- |" * len(slos)]
        for label in labels:
            lines.append(f"| {label} | " + " | ".join(_cell(by_slo[s], label) for s in slos) + " |")
        cells = []
        for s in slos:
            ratio = sarathi_over_vllm(by_slo[s]["capacity"])
            bounded = any(by_slo[s]["bound"].values())  # a ratio of bounds says little: say so
            cells.append("-" if ratio is None else f"**{ratio:.2f}x**" + (" (from bounds)" if bounded else ""))
        lines += ["| best sarathi / vllm | " + " | ".join(cells) + " |", ""]
    return "\n".join(lines)


def plot(table: dict, path: str) -> str:
    from sarathi_jax.bench.plots import pyplot

    plt = pyplot()
    fig, axes = plt.subplots(1, len(table), figsize=(5.5 * len(table), 4), squeeze=False)
    for ax, (trace, by_slo) in zip(axes[0], table.items()):
        labels = list(dict.fromkeys(label for r in by_slo.values() for label in r["capacity"]))
        width = 0.8 / len(by_slo)
        for i, (slo, r) in enumerate(by_slo.items()):
            xs = [j + i * width for j in range(len(labels))]
            ax.bar(xs, [r["capacity"].get(label, 0.0) for label in labels], width, label=f"{slo} SLO")
        ax.set_xticks([j + width * (len(by_slo) - 1) / 2 for j in range(len(labels))], labels, rotation=20)
        ax.set_title(trace)
        ax.set_ylabel("capacity (req/s)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def build_parser() -> argparse.ArgumentParser:
    d = Experiment()
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_capacity", description=__doc__,
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
    p.add_argument("--sample", type=int, default=None, help=f"requests per probe (default {d.sample})")
    p.add_argument("--capacity-probes", type=int, default=None, help=f"default {d.capacity_probes}")
    p.add_argument("--token-budgets", default=None,
                   help=f"sarathi's token budgets, comma-separated (default {','.join(map(str, d.sarathi_budgets))})")
    p.add_argument("--start-qps", type=float, default=None, help="the capacity search's first probed rate")
    p.add_argument("--kv-cache-bytes", type=int, default=None, help="a fixed KV cache size (default: from free memory)")
    p.add_argument("--dry-run", action="store_true", help="print the bench commands and stop")
    return p


def main(argv: Sequence[str] | None = None, *, engine_factory: Callable[[dict], Any] | None = None) -> int:
    """`engine_factory`: passed to the bench (tests drive the pipeline with a simulated engine)."""
    args = build_parser().parse_args(argv)
    exp = SMOKE if args.smoke else Experiment()
    overrides = {"traces": _names(args.traces), "slos": _names(args.slos), "policies": _names(args.policies),
                 "model": args.model, "sample": args.sample, "capacity_probes": args.capacity_probes,
                 "sarathi_budgets": tuple(int(b) for b in _names(args.token_budgets)) if args.token_budgets else None,
                 "start_qps": args.start_qps, "kv_cache_bytes": args.kv_cache_bytes}
    exp = dataclasses.replace(exp, **{k: v for k, v in overrides.items() if v is not None})
    for name, known in (("traces", TRACE_FILES), ("slos", SLO_MULTIPLES), ("policies", POLICIES)):
        unknown = [x for x in getattr(exp, name) if x not in known]
        if unknown:
            print(f"--{name}: unknown {unknown}; choose from {', '.join(known)}", file=sys.stderr)
            return 2
    os.makedirs(args.out, exist_ok=True)
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
            argv = bench_argv(exp, trace_path, run_dir, slo, slo_tbt)
            commands.append("python -m sarathi_jax.bench " + shlex.join(argv))
            print(f"[{trace}, {slo}] {commands[-1]}", flush=True)
            if args.dry_run:  # (a real run passes the first run's measured SLO to the later ones as --slo-tbt)
                continue
            t0 = time.monotonic()
            rc = bench_main(argv, engine_factory=engine_factory)
            if rc != 0:
                print(f"[{trace}, {slo}] the bench failed (exit {rc})", file=sys.stderr)
                return rc
            print(f"[{trace}, {slo}] done in {time.monotonic() - t0:.0f} s", flush=True)
            if decode_time is None:
                with open(os.path.join(run_dir, "summary.json")) as f:
                    decode_time = json.load(f)["decode_only_iteration_time"]
                with open(decode_path, "w") as f:
                    json.dump({"decode_only_iteration_time": decode_time, "measured_by": commands[-1]}, f, indent=1)
    with open(os.path.join(args.out, "commands.sh"), "a") as f:
        f.write("\n".join(commands) + "\n")
    if args.dry_run:
        return 0
    info = machine_info()
    table = collect(args.out)
    with open(os.path.join(args.out, "machine.json"), "w") as f:
        json.dump({**info, "experiment": dataclasses.asdict(exp), "decode_only_iteration_time": decode_time},
                  f, indent=1)
    with open(os.path.join(args.out, "capacity.json"), "w") as f:
        json.dump(table, f, indent=1)
    report = format_report(table, exp, decode_time, info)
    with open(os.path.join(args.out, "capacity.md"), "w") as f:
        f.write(report + "\n")
    plot(table, os.path.join(args.out, "capacity.png"))
    print()
    print(report)
    print(f"wrote {args.out}/capacity.md, capacity.json, capacity.png, machine.json, commands.sh and one folder per run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
