"""What a part of `python -m benchmarks.gpu_report` writes (`Result`: figures, tables, info; see
parts.py's doc) and the floors its figures are set against (`floor_of`, with the rates of `get_rates`).
"""

from __future__ import annotations

import json
import os

from benchmarks.gpu_report.run import ReportConfig


class Result:
    """A part's result, saved (atomically) whenever `save` is called."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.doc: dict = {"figures": [], "tables": [], "info": {}}

    def figure(self, name: str, value: float, unit: str, floor: float | None = None,
               basis: str | None = None) -> None:
        ratio = value / floor if floor else None
        self.doc["figures"].append({"name": name, "value": value, "unit": unit, "floor": floor,
                                    "floor_basis": basis if floor else None, "ratio": ratio})

    def table(self, title: str, columns: list[str], rows: list[list]) -> None:
        self.doc["tables"].append({"title": title, "columns": columns, "rows": rows})

    def save(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.doc, f, indent=1, default=str)
        os.replace(tmp, self.path)


def get_rates(cfg: ReportConfig, given: dict | None, res: Result):
    """The machine part's rates, or measured here (same settings) when it had none to give."""
    from sarathi_jax.bench.roofline import Rates, measure_rates

    if given:
        res.doc["info"]["rates_from"] = "machine part"
        return Rates(given["matmul_flops_per_s"], given["bandwidth_bytes_per_s"])
    res.doc["info"]["rates_from"] = "measured in this part (the machine part gave none)"
    return measure_rates(cfg.dtype, cfg.matmul_n, cfg.bandwidth_mb, repeats=cfg.rate_repeats)


def floor_of(flops: float, nbytes: float, rates) -> tuple[float, str, float, float]:
    """(floor s, basis, compute floor s, memory floor s): the larger of FLOPs / matmul rate and bytes / bandwidth."""
    compute, memory = flops / rates.matmul_flops, nbytes / rates.bandwidth
    return max(compute, memory), ("bytes" if memory >= compute else "FLOPs"), compute, memory
