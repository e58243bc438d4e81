"""Where the time goes in a JAX profiler trace: `python -m benchmarks.probes.trace_summary TRACE.json.gz`.

Reads the Perfetto/Chrome JSON trace that `jax.profiler.trace(dir, create_perfetto_trace=True)` writes (or
any `*.trace.json.gz` in that format) and prints, over the window from the first to the last event of the
named host function (`--step-name`, default the engine's `step`):

* wall time per step, and how much of it the device was busy (the union of kernel intervals on the
  `/device:...` processes, memcpy streams included or not with `--no-memcpy`);
* kernels per step and the busiest kernels by total device time;
* host time per step in the busiest host events on the thread that ran the steps;
* on a CPU, where the trace has no device: the XLA:CPU ops (thunks, whose events name their `hlo_module` and
  `hlo_op`) by executable and kind of op (`ynn_fusion`, `ffi_call`, ...: the op's name less its `.N` suffix),
  their time summed over the threads that ran them. The work an op hands to other threads (a YNNPACK matmul's
  parallel parts) is not in its event, so these sums are not wall time and do not add up to the step.

Busy fraction says what bounds a step: a decode step whose device is idle most of the wall
time is bound by the host (Python, launches, syncs), not by the GPU.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import sys
from pathlib import Path
from typing import Any


def _load(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def _union(intervals: list[tuple[float, float]]) -> float:
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        start = max(start, reach)
        if end > start:
            total += end - start
        reach = max(reach, end)
    return total


def summarize(events: list[dict[str, Any]], step_name: str = "step", memcpy: bool = True,
              top: int = 12) -> dict[str, Any]:
    """The summary as a dict (times in microseconds, as in the trace)."""
    process, thread = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            process[e["pid"]] = e["args"]["name"]
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            thread[(e["pid"], e.get("tid"))] = e["args"]["name"]
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    device_pids = {pid for pid, name in process.items() if name.startswith("/device:")}
    host_spans = [e for e in spans if e["pid"] not in device_pids]
    steps = [e for e in host_spans if e["name"] == step_name]  # e.g. a `TraceAnnotation("step")`
    if not steps:  # else Python-tracer events such as "$engine.py:164 step": the outermost of them
        candidates = [e for e in host_spans if e["name"].endswith(" " + step_name)]
        if candidates:
            outer = max(candidates, key=lambda e: e["dur"])
            steps = [e for e in candidates if (e["name"], e["tid"]) == (outer["name"], outer["tid"])]
    steps.sort(key=lambda e: e["ts"])
    if not steps:
        raise ValueError(f"no host event named ...{step_name!r} in the trace")
    begin, end = steps[0]["ts"], steps[-1]["ts"] + steps[-1]["dur"]
    step_tid = (steps[0]["pid"], steps[0]["tid"])

    def in_window(e: dict[str, Any]) -> bool:
        return e["ts"] >= begin and e["ts"] + e["dur"] <= end

    kernels = [e for e in spans if e["pid"] in device_pids and in_window(e)
               and (memcpy or "memcpy" not in thread.get((e["pid"], e.get("tid")), "").lower()
                    or "compute" in thread.get((e["pid"], e.get("tid")), "").lower())]
    busy = _union([(e["ts"], e["ts"] + e["dur"]) for e in kernels])
    by_kernel: collections.Counter[str] = collections.Counter()
    count: collections.Counter[str] = collections.Counter()
    for e in kernels:
        by_kernel[e["name"]] += e["dur"]
        count[e["name"]] += 1
    host: collections.Counter[str] = collections.Counter()
    for e in spans:
        if (e["pid"], e["tid"]) == step_tid and in_window(e) and e["name"] != steps[0]["name"]:
            host[e["name"]] += e["dur"]
    cpu_ops: collections.Counter[tuple[str, str]] = collections.Counter()
    cpu_count: collections.Counter[tuple[str, str]] = collections.Counter()
    for e in host_spans:
        args = e.get("args") or {}
        if "hlo_module" in args and "hlo_op" in args and in_window(e):
            key = (args["hlo_module"], args["hlo_op"].split(".")[0])
            cpu_ops[key] += e["dur"]
            cpu_count[key] += 1
    n, wall = len(steps), end - begin
    return {
        "steps": n,
        "wall_us_per_step": wall / n,
        "device_busy_us_per_step": busy / n,
        "device_busy_fraction": busy / wall if wall else 0.0,
        "kernels_per_step": len(kernels) / n,
        "top_kernels": [(name, t / n, count[name] / n) for name, t in by_kernel.most_common(top)],
        "top_host_events": [(name, t / n) for name, t in host.most_common(top)],
        "top_cpu_ops": [(module, op, t / n, cpu_count[(module, op)] / n)
                        for (module, op), t in cpu_ops.most_common(top)],
    }


def format_summary(s: dict[str, Any]) -> str:
    lines = [
        f"{s['steps']} steps: {s['wall_us_per_step'] / 1e3:.2f} ms wall per step, device busy "
        f"{s['device_busy_us_per_step'] / 1e3:.2f} ms ({100 * s['device_busy_fraction']:.0f}%), "
        f"{s['kernels_per_step']:.0f} kernels per step",
        "busiest kernels (device us per step, launches per step):",
        *(f"  {t:9.1f}  x{c:<5.0f} {name[:110]}" for name, t, c in s["top_kernels"]),
        "busiest host events on the stepping thread (us per step, nested events overlap):",
        *(f"  {t:9.1f}  {name[:110]}" for name, t in s["top_host_events"]),
    ]
    if s.get("top_cpu_ops"):
        lines += ["busiest XLA:CPU ops (us per step summed over threads, runs per step; executable, op):",
                  *(f"  {t:9.1f}  x{c:<5.1f} {module} {op}" for module, op, t, c in s["top_cpu_ops"])]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--step-name", default="step", help="host event that marks one engine step")
    parser.add_argument("--no-memcpy", action="store_true", help="leave copy-only streams out of device busy")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    summary = summarize(_load(args.trace), args.step_name, memcpy=not args.no_memcpy, top=args.top)
    print(json.dumps(summary, indent=1) if args.json else format_summary(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
