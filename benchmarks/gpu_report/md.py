"""report.md of `python -m benchmarks.gpu_report`, rendered from its report.json document (plain Python,
no JAX: the parent process renders it after every part).

Layout: the command and how the run went, the machine (device, versions, rates) and the floors' rule, one line
per part (status, seconds, budget), then per part its status (and the tail of its log when it failed or timed
out), its notes, its figures (value, floor, floor basis, x floor) and its tables.
"""

from __future__ import annotations

from typing import Any


def fmt_value(v: float | None, unit: str) -> str:
    if v is None:
        return "-"
    if unit == "s":
        a = abs(v)
        return f"{v:.3g} s" if a >= 1 else f"{v * 1e3:.3g} ms" if a >= 1e-3 else f"{v * 1e6:.3g} us"
    if unit == "FLOP/s":
        return f"{v / 1e12:.4g} TFLOP/s" if v >= 1e12 else f"{v / 1e9:.4g} GFLOP/s"
    if unit == "B/s":
        return f"{v / 1e12:.4g} TB/s" if v >= 1e12 else f"{v / 1e9:.4g} GB/s"
    if unit == "FLOP":
        return f"{v / 1e9:.4g} GFLOP"
    if unit == "B":
        return f"{v / 1e9:.4g} GB" if v >= 1e9 else f"{v / 1e6:.4g} MB"
    if unit == "fraction":
        return f"{v:.0%}"
    return f"{v:.4g}"


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v).replace("|", "\\|").replace("\n", " ")


def _table(columns: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns),
            *("| " + " | ".join(_cell(c) for c in row) + " |" for row in rows)]


def _info_value(v: Any) -> str | None:
    if isinstance(v, (str, int, float, bool)):
        return _cell(v)
    if isinstance(v, list) and all(isinstance(x, (str, int, float)) for x in v):
        return ", ".join(map(str, v))
    if isinstance(v, dict) and all(isinstance(x, (str, int, float, bool, type(None))) for x in v.values()):
        return ", ".join(f"{k} {_cell(x)}" for k, x in v.items())
    return None  # nested: in report.json only


def _machine_lines(doc: dict) -> list[str]:
    m = doc["parts"]["machine"]
    info, rates = m["result"].get("info", {}), m["result"].get("rates")
    lines = []
    if info:
        versions = ", ".join(f"{k} {v}" for k, v in info.get("versions", {}).items())
        gpu = info.get("gpu_name") or ", ".join(sorted(set(info.get("devices", []))))
        lines.append(f"Device: {gpu} on {info.get('platform')}"
                     + (f", driver {info['driver_version']}" if info.get("driver_version") else "")
                     + f"; {versions}; Python {info.get('python')}; git {info.get('git_commit') or '-'}.")
        if info.get("platform") != "gpu" and not doc["smoke"]:
            lines.append(f"**Not on a GPU**: JAX's platform is {info.get('platform')!r}; the GPU sizes ran there.")
    if rates:
        lines.append(f"Rates (machine part): matmul {fmt_value(rates['matmul_flops_per_s'], 'FLOP/s')} "
                     f"({doc['config']['dtype']}), bandwidth {fmt_value(rates['bandwidth_bytes_per_s'], 'B/s')}.")
    else:
        lines.append("Rates: the machine part gave none; each part measured its own (see its notes).")
    return lines


def render(doc: dict) -> str:
    state = "finished" if doc["finished"] else next(
        (f"**stopped or still running during `{n}`**" for n, p in doc["parts"].items() if p["status"] == "running"),
        "in progress")
    lines = ["# GPU report", "", f"`{doc['command']}`: started {doc['started_at']}, {doc['elapsed_s']:.0f} s, {state}.",
             ""]
    if doc["smoke"]:
        lines += ["**Smoke run** (toy models and sizes, on whatever device ran it): these figures check the "
                  "pipeline and say nothing about any hardware.", ""]
    lines += _machine_lines(doc)
    lines += ["Floors: bytes over the measured bandwidth, FLOPs over the measured matmul rate (the larger of the "
              "two, named in \"basis\"); x floor = figure / floor.",
              "Kernel tuning table used by the parts after `tune`: "
              + (f"`{doc['tuning_table_used']}`." if doc["tuning_table_used"] else "the committed one."), ""]
    lines += _table(["part", "status", "seconds", "budget s"],
                    [[name, p["status"], p["seconds"], p["budget_s"]] for name, p in doc["parts"].items()])
    for name, p in doc["parts"].items():
        lines += ["", f"## {name}: {p['title']}", ""]
        status = f"**{p['status']}**" + (f" in {p['seconds']:.1f} s" if p["seconds"] is not None else "")
        if p["timeout_s"] is not None:
            status += f" (timeout {p['timeout_s']:.0f} s; log `{p['log']}`)"
        lines.append(status + ".")
        if p["error"]:
            lines += ["", "```", p["error"], "```"]
        r = p["result"]
        notes = [(k, _info_value(v)) for k, v in r.get("info", {}).items() if name != "machine"]
        lines += [""] * bool(notes) + [f"- {k}: {v}" for k, v in notes if v is not None]
        if r.get("figures"):
            lines += ["", *_table(["figure", "value", "floor", "basis", "x floor"], [
                [f["name"], fmt_value(f["value"], f["unit"]), fmt_value(f["floor"], f["unit"]),
                 f["floor_basis"], None if f["ratio"] is None else f"{f['ratio']:.3g}x"] for f in r["figures"]])]
        for t in r.get("tables", []):
            lines += ["", f"{t['title']}:", "", *_table(t["columns"], t["rows"])]
    return "\n".join(lines) + "\n"
