"""The capacity experiment's report: the table of capacities per trace and SLO, sarathi's best over vllm, the bar
plot, and the machine description."""

from __future__ import annotations

import json
import os
import platform
import subprocess

from benchmarks.gpu_capacity.settings import SLO_MULTIPLES, Experiment
from sarathi_jax.bench.traces import SHIPPED_TRACES as TRACE_FILES
from sarathi_jax.config.engine_config import resolve_dtype

PAPER_NOTE = ("Sarathi-Serve (OSDI'24): Mistral-7B on one A100, up to 2.6x the capacity of vLLM under the strict "
              "P99-TBT SLO, with sarathi token budgets of 512 and 2048")


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
                    entry["capacity"][label], entry["bound"][label] = reported_capacity(c)
                    entry["probes"][label] = c["probes"]
                    entry["throughput"][label] = c.get("max_throughput")
    return table


def reported_capacity(capacity: dict) -> tuple[float, str]:
    """(req/s, bound) of one search (`CapacityResult.to_dict()`): "<=" and the fastest completion rate when the
    search passed above it (a pass there proves nothing: the capacity is at most that rate), ">=" when no probe
    failed (the search stopped below the capacity), "<" when none passed, else ""."""
    if capacity.get("beyond_throughput", False):
        return capacity["max_throughput"], "<="
    if capacity["bracket"][1] is None:
        return capacity["capacity_qps"], ">="
    return capacity["capacity_qps"], "<" if capacity["capacity_qps"] == 0 else ""


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


def format_report(table: dict, exp: Experiment, decode_time: float, info: dict,
                  cost_model: dict | None = None) -> str:
    """`info`: `machine_info()`; `cost_model`: the simulated grid's (`BucketCostModel.to_dict()`), whose source
    names the device it was calibrated on."""
    if cost_model is None:
        where = (f"Model {exp.model} ({resolve_dtype(exp.dtype, info['platform'])}) on {info['platform']} "
                 f"[{', '.join(sorted(set(info['devices'])))}]")
    else:
        src = cost_model.get("source") or {}
        where = (f"Simulated: model {exp.model} ({src.get('dtype', exp.dtype)}) priced by a cost model calibrated "
                 f"on {src.get('platform', '?')} [{src.get('device', '?')}]")
        if (exp.devices or 1) > 1:
            where += (f", tensor parallel over {exp.devices} devices through the TP cost model (**extrapolated**: "
                      "no multi-device run calibrated it)")
    lines = [f"{where}; "
             f"{exp.sample} requests per probe, length scale {exp.length_scale:g}, at most {exp.capacity_probes} "
             f"probes per configuration; decode iteration time (batch {exp.decode_probe_batch}, context about "
             f"{exp.decode_probe_context}) "
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


