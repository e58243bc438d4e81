"""Matplotlib figures (Agg backend, PNG): TBT CDF per run, capacity bars, iteration timelines.

matplotlib is the `plots` extra (`pip install 'sarathi-jax[plots]'`), imported only when a figure is drawn.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Sequence

import numpy as np

from sarathi_jax.bench.driver import RunResult
from sarathi_jax.bench.metrics import all_tbts, completed


PLOTS_EXTRA = "pip install 'sarathi-jax[plots]'"


def have_matplotlib() -> bool:
    try:
        return importlib.util.find_spec("matplotlib") is not None
    except (ImportError, ValueError):
        return False


def pyplot():
    """matplotlib.pyplot on the Agg backend; ImportError naming the `plots` extra when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError(f"the PNG figures need matplotlib, the plots extra: {PLOTS_EXTRA}") from e

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def plot_tbt_cdf(runs: Sequence[RunResult], path: str, slo_tbt: float | None = None) -> str:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in runs:
        tbts = np.sort(np.asarray(all_tbts(completed(r.records)), dtype=np.float64)) * 1e3
        if tbts.size == 0:
            continue
        # at most ~2000 points: quantiles on a grid dense near the tail
        q = np.unique(np.concatenate([np.linspace(0, 0.9, 500), 1 - np.logspace(-1, -5, 1500), [1.0]]))
        x = np.quantile(tbts, q)
        ax.plot(x, q, label=f"{r.label} (P99 {np.percentile(tbts, 99):.1f} ms)")
    if slo_tbt is not None:
        ax.axvline(slo_tbt * 1e3, color="k", ls="--", lw=1, label=f"TBT SLO {slo_tbt * 1e3:.1f} ms")
    ax.axhline(0.99, color="grey", ls=":", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("time between tokens (ms, log scale)")
    ax.set_ylabel("fraction of tokens")
    ax.set_ylim(0, 1.01)
    ax.set_title("TBT CDF")
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_capacity(capacities: dict, path: str) -> str:
    """Bars of capacity (req/s) per run; `capacities` maps label -> CapacityResult."""
    plt = pyplot()
    labels = list(capacities)
    values = [capacities[k].capacity_qps for k in labels]
    fig, ax = plt.subplots(figsize=(max(5, 1.3 * len(labels) + 2), 4))
    bars = ax.bar(range(len(labels)), values, color="tab:blue")
    for b, k in zip(bars, labels):
        c = capacities[k]
        ax.annotate(f"{c.capacity_qps:.3g}", (b.get_x() + b.get_width() / 2, b.get_height()),
                    ha="center", va="bottom", fontsize=9)
    ax.set_xticks(range(len(labels)), labels, rotation=20, ha="right")
    ax.set_ylabel("capacity (req/s)")
    any_c = next(iter(capacities.values()), None)
    if any_c is not None and any_c.slo_tbt is None:  # searched on goodput (--capacity-goodput)
        ax.set_title("capacity on goodput (requests within their own SLOs)", fontsize=10)
    elif any_c is not None:
        ax.set_title(f"capacity at P99 TBT <= {any_c.slo_tbt * 1e3:.1f} ms\n"
                     f"and median scheduling delay <= {any_c.max_sched_delay:g} s", fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _step_xy(starts: np.ndarray, durs: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x, y of a step outline: each iteration a flat segment over [start, start + duration]; the gaps between
    iterations (idle time) drop to 0."""
    x = np.empty(4 * len(starts))
    y = np.zeros(4 * len(starts))
    ends = starts + durs
    x[0::4], x[1::4], x[2::4], x[3::4] = starts, starts, ends, ends
    y[1::4], y[2::4] = values, values
    return x, y


def plot_timeline(runs: Sequence[RunResult], path: str, stall_factor: float = 5.0,
                  max_iterations: int | None = 4000) -> str:
    """One panel per run: tokens per iteration (decode bottom, prefill on top) over time, iteration time on
    the right axis, and iterations longer than `stall_factor` x the median iteration marked in red.
    Long runs are cut to their first `max_iterations` iterations (said in the panel title)."""
    plt = pyplot()
    runs = [r for r in runs if r.iterations]
    n = max(1, len(runs))
    fig, axes = plt.subplots(n, 1, figsize=(10, 2.6 * n + 0.6), squeeze=False)
    for ax, r in zip(axes[:, 0], runs):
        its = r.iterations[:max_iterations] if max_iterations else r.iterations
        starts = np.array([it["start_time"] for it in its])
        durs = np.array([it["duration"] for it in its])
        dec = np.array([it["num_decode_tokens"] for it in its], dtype=float)
        pre = np.array([it["num_prefill_tokens"] for it in its], dtype=float)
        x, dec_y = _step_xy(starts, durs, dec)
        _, tot_y = _step_xy(starts, durs, dec + pre)
        ax.fill_between(x, 0, dec_y, color="tab:blue", alpha=0.75, lw=0, label="decode tokens")
        ax.fill_between(x, dec_y, tot_y, color="tab:orange", alpha=0.75, lw=0, label="prefill tokens")
        if x.size:
            ax.set_xlim(x.min(), x.max())
            ax.set_ylim(0, max(1.0, float(tot_y.max())) * 1.05)
        ax.set_ylabel("tokens / iteration")
        ax2 = ax.twinx()
        ax2.plot(starts + durs / 2, durs * 1e3, ".", ms=2, color="k", label="iteration time")
        med = float(np.median(durs)) if durs.size else 0.0
        slow = durs > stall_factor * med
        if slow.any():
            ax2.plot((starts + durs / 2)[slow], durs[slow] * 1e3, "v", ms=5, color="red",
                     label=f"> {stall_factor:g}x median iteration ({int(slow.sum())})")
        ax2.set_ylabel("iteration time (ms)")
        ax2.set_ylim(bottom=0)
        cut = "" if len(its) == len(r.iterations) else f" (first {len(its)} of {len(r.iterations)} iterations)"
        ax.set_title(f"{r.label}: {r.summary.get('num_stalls', 0)} TBT stalls, "
                     f"{r.num_preemptions} preemptions{cut}", fontsize=10)
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = ax2.get_legend_handles_labels()
        ax.legend(h1 + h2, l1 + l2, fontsize=7, loc="upper left", framealpha=0.6)
    axes[-1, 0].set_xlabel("time since run start (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(out_dir: str, runs: Sequence[RunResult], capacities: dict | None = None,
                slo_tbt: float | None = None, stall_factor: float = 5.0) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    paths = [plot_tbt_cdf(runs, os.path.join(out_dir, "tbt_cdf.png"), slo_tbt)]
    if capacities:
        paths.append(plot_capacity(capacities, os.path.join(out_dir, "capacity.png")))
    if any(r.iterations for r in runs):
        paths.append(plot_timeline(runs, os.path.join(out_dir, "timeline.png"), stall_factor))
    return paths
