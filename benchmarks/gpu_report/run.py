"""`python -m benchmarks.gpu_report --out DIR`: everything a lent GPU should tell us, in one command that
writes `DIR/report.md` and `DIR/report.json` (on the device machine: `--out $OUT`).

Parts, in this order (each with a time budget, `PARTS`; no part starts after `--deadline-s`, 525 s by default,
and a part's timeout is cut to the time left, so that the whole run ends within 9 minutes):

1. `machine`: versions (jax, jaxlib, the CUDA plugin, torch, python, GPU name and driver from nvidia-smi when
   there is one) and the measured rates (`bench.roofline.measure_rates`: a bf16 matmul, a large reduction and
   copy), which the later parts use for their floors;
2. `tune`: `python -m pallas_kernels.tune` with a time budget, writing `DIR/tuning_table.json` (measured,
   `"tuned": true` on a GPU; copy it over `pallas_kernels/tuning_table.json` to commit it). The later parts
   run with it (`SARATHI_PALLAS_TUNING_TABLE`) when it was written;
3. `attention`: the Pallas kernel on the six mixes of `pallas_kernels.cases.SUITE` (Mistral-7B heads, bf16),
   with the jnp path and torch SDPA (FlashAttention) on the same work when torch with CUDA imports (when not,
   the report says why), against the floors: bytes for the decode mixes, FLOPs for the prefills;
4. `profile_large`, `profile_small`: a JAX profiler trace of steady decode through `engine.step()` (and, for the
   large model, of mixed steps: the decodes plus a prefill chunk filling the token budget), read into wall and
   device busy time per step, the busy fraction and the busiest kernels (`benchmarks.probes.profile_steps`,
   `benchmarks.probes.trace_summary`), against the floor of the steps dispatched meanwhile (`bench.roofline.work`);
5. `loop`: the synchronous and the overlapped engine loop at 1, 32 and 128 decodes (`benchmarks.probes.loop_cost`): wall
   and device time per step, the device busy fraction;
6. `quantized`: the large model's decode steps with bf16, int8 and fp8 layer weights, alternated
   (`benchmarks.probes.out_major_steps.alternate`), against their byte floors; fp8's refusal where the GPU has no
   FP8 matmul;
7. `cost_model`: the simulator's cost model of the large model calibrated on this device
   (`python -m sarathi_jax.bench.step_cost --mode calibrate`, up to the paper's 2048-token budget) into
   `DIR/cost_model.json`, its fit error, and the decode iteration behind the paper's SLOs (batch 32 at context
   4096) beside its floor: `python -m benchmarks.gpu_capacity --simulate --cost-model DIR/cost_model.json` runs
   the paper's capacity grid on it, on any machine;
8. `startup_small`, `startup_large`: start-up, cold and warm (`benchmarks.probes.startup`). Last: it already has GPU figures.

Each part runs in a process of its own (`python -m benchmarks.gpu_report.parts PART`) with a timeout, so
a part that crashes or hangs (XLA, the driver, out of memory) is recorded as `failed` or `timeout`, with its
seconds and the tail of its log (`DIR/logs/PART.log`), and the others still run. A part saves its result as it
goes, so a part stopped half-way keeps what it had measured, and report.json and report.md are rewritten after
every part, so a run killed from outside leaves everything up to the part that was running. Every time in the
report stands beside its floor (bytes over the measured bandwidth, FLOPs over the measured matmul rate; the
larger of the two unless said otherwise) and the ratio to it.
Also written: `DIR/parts/PART.json` (each part's result), `DIR/logs/PART.log`, `DIR/traces/` (the profiles'
Perfetto traces, for ui.perfetto.dev). Exit status 1 when a part failed or timed out (the report is whole
either way).

`--smoke` runs the same parts on a CPU at toy scale (tiny-llama, a few steps, the Pallas kernel in interpret
mode), so that the whole command is known to work before a GPU is spent on it; its figures say nothing about
any hardware.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sarathi_jax.utils.paths import cli_path

REPO_ROOT = Path(__file__).resolve().parents[2]
TUNING_TABLE_ENV = "SARATHI_PALLAS_TUNING_TABLE"  # pallas_kernels.tuning.TABLE_ENV (not imported: no JAX here)
DEFAULT_DEADLINE_S = 525.0
MIN_PART_S = 15.0  # a part with less time left than this is skipped, not started


@dataclass(frozen=True)
class ReportConfig:
    """What the parts measure: the GPU defaults, or `SMOKE`'s toy scale."""

    dtype: str = "bfloat16"
    small_model: str = "llama-1b"
    large_model: str = "mistral-7b"
    # machine rates (bench.roofline.measure_rates)
    matmul_n: int = 8192
    bandwidth_mb: int = 2048
    rate_repeats: int = 5
    # kernel tuning (pallas_kernels.tune)
    tune_budget_s: float = 60.0
    tune_interpret: bool = False  # tune's --interpret-smoke (a CPU)
    # attention mixes (pallas_kernels.cases.SUITE)
    attention_heads: tuple[int, int, int] = (32, 8, 128)  # Mistral-7B's query heads, KV heads, head_dim
    attention_cases: tuple[int, ...] = (0, 1, 2, 3, 4, 5)  # indices into SUITE
    attention_scale: int = 1  # every size of the mixes divided by this
    attention_iters: int = 20
    attention_repeats: int = 3
    # profiles (engine.step() under jax.profiler)
    profile_batch: int = 32
    profile_context: int = 1024
    profile_steps: int = 32
    mixed_steps: int = 4
    token_budget: int = 512
    # start-up (benchmarks.probes.startup); None: the engine's defaults
    startup_token_budget: int | None = None
    startup_max_num_seqs: int | None = None
    startup_num_blocks: int | None = None
    # engine loop (benchmarks.probes.loop_cost)
    loop_batches: tuple[int, ...] = (1, 32, 128)
    loop_context: int = 256
    loop_token_budget: int = 256
    loop_steps: int = 8
    loop_rounds: int = 3
    # quantized weights: the large model's decode (profile_batch x profile_context) with each kind of weights
    quant_repeats: int = 10
    # the simulator's cost model of the large model (step_cost --mode calibrate) for the paper's capacity grid
    grid_token_budget: int = 2048  # the paper's larger sarathi budget: the calibration covers its buckets
    grid_max_num_seqs: int = 128
    grid_decode_batch: int = 32  # the SLOs' reference decode iteration
    grid_decode_context: int = 4096


SMOKE = ReportConfig(
    dtype="float32", small_model="tiny-llama", large_model="tiny-llama", matmul_n=256, bandwidth_mb=16,
    rate_repeats=2, tune_budget_s=10.0, tune_interpret=True, attention_heads=(4, 2, 64),
    attention_cases=(0, 3),  # a decode mix and the mixed one (a prefill chunk): interpret mode compiles slowly
    attention_scale=32, attention_iters=1, attention_repeats=1, profile_batch=4, profile_context=32,
    profile_steps=3, mixed_steps=2, token_budget=32, startup_token_budget=16, startup_max_num_seqs=2,
    startup_num_blocks=32,
    loop_batches=(1, 2, 4), loop_context=16, loop_token_budget=16, loop_steps=2, loop_rounds=1, quant_repeats=2,
    grid_token_budget=64, grid_max_num_seqs=8, grid_decode_batch=4, grid_decode_context=64,
)


@dataclass(frozen=True)
class Part:
    name: str
    budget_s: float  # timeout of its process (lowered to the time left before the deadline)

    def title(self, cfg: ReportConfig) -> str:
        c = cfg
        return {
            "machine": "Machine: versions and measured rates",
            "tune": f"Kernel tuning (pallas_kernels.tune, {c.tune_budget_s:g} s sweep)",
            "attention": "Attention kernel on {} of the six mixes (heads {}/{}/{}, {})".format(
                len(c.attention_cases), *c.attention_heads, c.dtype),
            "profile_large": f"Profile: {c.large_model} decode x{c.profile_batch} at ctx {c.profile_context}, "
                             f"and mixed {c.token_budget}-token steps",
            "profile_small": f"Profile: {c.small_model} decode x{c.profile_batch} at ctx {c.profile_context}",
            "startup_small": f"Start-up, cold and warm: {c.small_model}",
            "startup_large": f"Start-up, cold and warm: {c.large_model}",
            "loop": f"Engine loop busy fraction: {c.small_model} at "
                    f"{', '.join(map(str, c.loop_batches))} decodes",
            "quantized": f"Quantized weights: {c.large_model} decode x{c.profile_batch} at ctx {c.profile_context}, "
                         f"{c.dtype} against int8 and fp8",
            "cost_model": f"Simulator cost model: {c.large_model} calibrated up to {c.grid_token_budget} tokens",
        }[self.name]


PARTS = (  # the order above: start-up, which already has GPU figures, last
    Part("machine", 60), Part("tune", 110), Part("attention", 90), Part("profile_large", 120),
    Part("profile_small", 75), Part("loop", 100), Part("quantized", 120), Part("cost_model", 180),
    Part("startup_small", 70), Part("startup_large", 90),
)
PART_NAMES = tuple(p.name for p in PARTS)


# ----------------------------------------------------------------------------------------------- running a part


@dataclass
class PartRun:
    """One part's record in report.json."""

    title: str
    status: str = "pending"
    budget_s: float = 0.0
    timeout_s: float | None = None
    seconds: float | None = None
    error: str | None = None
    log: str | None = None
    result: dict = field(default_factory=dict)


def _tail(path: Path, lines: int = 25, chars: int = 3000) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.rstrip().splitlines()[-lines:])[-chars:]


def _kill_group(proc: subprocess.Popen) -> None:
    """End the part's process and whatever it started (its own session), politely first."""
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_part(name: str, run: PartRun, out: Path, child_config: dict, timeout: float, env: dict,
             inject: str | None) -> None:
    """Run one part in its own process (a new session, so that a timeout ends its children too); fills `run`."""
    (out / "logs").mkdir(exist_ok=True)
    (out / "parts").mkdir(exist_ok=True)
    log, result_path = out / "logs" / f"{name}.log", out / "parts" / f"{name}.json"
    result_path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "benchmarks.gpu_report.parts", name, "--out", str(out),
           "--result", str(result_path), "--config", json.dumps(child_config)]
    if inject:
        cmd += ["--inject", inject]
    run.log = str(log.relative_to(out))
    run.timeout_s = timeout
    t0 = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout)
            run.status = "ok" if rc == 0 else "failed"
            if rc != 0:
                run.error = f"exit status {rc}:\n{_tail(log)}"
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            run.status = "timeout"
            run.error = f"no result within {timeout:.0f} s (killed):\n{_tail(log)}"
        except BaseException:  # the report itself stopped (SIGTERM, ^C): its part's processes go with it
            _kill_group(proc)
            raise
    run.seconds = time.monotonic() - t0
    if result_path.exists():  # a part that failed or timed out keeps what it saved on the way
        run.result = json.loads(result_path.read_text())


# ----------------------------------------------------------------------------------------------- the report


def _write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_report(out: Path, doc: dict) -> None:
    from benchmarks.gpu_report.md import render

    _write(out / "report.json", json.dumps(doc, indent=1) + "\n")
    _write(out / "report.md", render(doc))


def _pairs(items: Sequence[str], what: str) -> dict[str, str]:
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or name not in PART_NAMES:
            raise SystemExit(f"{what}: expected PART=VALUE with PART one of {', '.join(PART_NAMES)}, got {item!r}")
        out[name] = value
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=cli_path, required=True, metavar="DIR",
                   help="report.md, report.json, tuning_table.json, logs")
    p.add_argument("--smoke", action="store_true", help="toy scale on a CPU: checks the pipeline")
    p.add_argument("--parts", default=None, help=f"comma-separated subset of {', '.join(PART_NAMES)} (default all)")
    p.add_argument("--budget", action="append", default=[], metavar="PART=SECONDS",
                   help="override a part's time budget (repeatable)")
    p.add_argument("--deadline-s", type=float, default=DEFAULT_DEADLINE_S,
                   help="start no part after this many seconds; a part's timeout is cut to the time left")
    # Tests: make a part fail (raise) or hang in its own process, to check that the others still run.
    p.add_argument("--inject", action="append", default=[], help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    selected = [x.strip() for x in args.parts.split(",") if x.strip()] if args.parts else list(PART_NAMES)
    unknown = [x for x in selected if x not in PART_NAMES]
    if unknown:
        raise SystemExit(f"--parts: unknown {unknown}; choose from {', '.join(PART_NAMES)}")
    budgets = {k: float(v) for k, v in _pairs(args.budget, "--budget").items()}
    inject = _pairs(args.inject, "--inject")
    cfg = SMOKE if args.smoke else ReportConfig()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)

    start = time.monotonic()
    runs = {p.name: PartRun(p.title(cfg), budget_s=budgets.get(p.name, p.budget_s)) for p in PARTS}
    doc = {
        "tool": "benchmarks.gpu_report",
        "command": "python -m benchmarks.gpu_report " + " ".join(argv if argv is not None else sys.argv[1:]),
        "smoke": args.smoke,
        "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "finished": False,
        "elapsed_s": 0.0,
        "deadline_s": args.deadline_s,
        "config": dataclasses.asdict(cfg),
        "tuning_table_used": None,
        "parts": {name: dataclasses.asdict(r) for name, r in runs.items()},
    }
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    # Stopped from outside (the device machine's time limit): exit through run_part, which ends the running part.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        failed = _run_parts(args, cfg, selected, runs, doc, out, env, inject, start)
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(f"[gpu_report] wrote {out / 'report.md'} and {out / 'report.json'} in {doc['elapsed_s']:.0f} s"
          + (f"; not ok: {', '.join(failed)}" if failed else ""), flush=True)
    return 1 if failed else 0  # the report is written either way


def _run_parts(args: argparse.Namespace, cfg: ReportConfig, selected: list[str], runs: dict[str, PartRun],
               doc: dict, out: Path, env: dict, inject: dict[str, str], start: float) -> list[str]:
    """Every part in turn (or skipped), the report rewritten after each; returns the parts that failed or timed out."""
    rates = None  # the machine part's, passed on to every later part for its floors
    for part in PARTS:
        run = runs[part.name]
        left = args.deadline_s - (time.monotonic() - start)
        if part.name not in selected:
            run.status, run.error = "skipped", "not selected (--parts)"
        elif left < MIN_PART_S:
            run.status = "skipped"
            run.error = f"out of time: {left:.0f} s left before the {args.deadline_s:.0f} s deadline"
        else:
            run.status = "running"
            doc["parts"][part.name] = dataclasses.asdict(run)
            doc["elapsed_s"] = time.monotonic() - start
            write_report(out, doc)
            print(f"[gpu_report] {part.name}: {run.title} (budget {min(run.budget_s, left):.0f} s)", flush=True)
            child = {"config": dataclasses.asdict(cfg), "rates": rates}
            run_part(part.name, run, out, child, min(run.budget_s, left), env, inject.get(part.name))
            print(f"[gpu_report] {part.name}: {run.status} in {run.seconds:.1f} s", flush=True)
            if part.name == "machine" and run.status == "ok":
                rates = run.result.get("rates")
            table = out / "tuning_table.json"
            if part.name == "tune" and run.status == "ok" and table.exists():
                env[TUNING_TABLE_ENV] = doc["tuning_table_used"] = str(table)
        doc["parts"][part.name] = dataclasses.asdict(run)
        doc["elapsed_s"] = time.monotonic() - start
        write_report(out, doc)
    doc["finished"] = True
    write_report(out, doc)
    return [n for n, r in runs.items() if r.status in ("failed", "timeout")]

