"""`python -m sarathi_jax.bench.step_cost`: the model runner's iteration time for chosen batch compositions,
beside this machine's compute and memory floors.

The pieces: `bench.roofline` (the FLOP and byte counts of a batch, the machine's matmul rate and bandwidth,
the floors), `bench.step_timer` (the compositions of each mode and timing them on the real runner, median of
round-robin repeats) and `sarathi_jax.sim.cost_model.BucketCostModel` (fitted in calibrate mode). This module is
the command line: the table, the JSON document and the plots. `x floor` = time / max(compute floor, memory
floor).

Modes (comma-separate several to measure them side by side in one run):
  decode    --batch-sizes 1,8,32 --context 512      decode batches (per-token cost = time / batch size)
  prefill   --tokens 16,64,256,512                  one fresh prefill of N tokens (per-token = time / N)
  hybrid    --decodes 32 --context 512 --chunks 64,128,256,512 --whole-prompt 1024
            the decode batch alone, with a prompt chunk of each size added, and with a whole prompt added
  chunking  --prompt-len 1024 --chunks 64,128,256,512,1024 --tile-probe 256
            total time to prefill one prompt in chunks of each size vs unchunked, plus chunk N vs N+1
  calibrate --token-budget 1024 --cost-model-out PATH
            fill every bucket several ways and fit `BucketCostModel`, a simulator cost model for
            `python -m sarathi_jax.bench --simulate --cost-model PATH`
The runner pads every batch to a bucket (powers of two from 16, then the token budget), so e.g. a 257-token
chunk costs the 512 bucket: that is this engine's bucketing, reported as such.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence

from sarathi_jax.bench.args import CPU_DEFAULT_MODEL as DEFAULT_MODEL
from sarathi_jax.bench.args import DEFAULT_MAX_MODEL_LEN, DEFAULT_MAX_NUM_SEQS
from sarathi_jax.bench.step_timer import DEFAULT_TOKEN_BUDGET, MODES, measure
from sarathi_jax.utils.paths import cli_path
from sarathi_jax.config.sizing import DTYPE_BYTES, platform_buckets
from sarathi_jax.models.config import QUANTIZATIONS


# ----------------------------------------------------------------------------------------------- output


def fmt_ms(s: float) -> str:
    ms = s * 1e3
    return f"{ms:.3g}" if ms < 100 else f"{ms:.0f}"


def format_rows(doc: dict) -> str:
    lines = []
    r_ = doc["rates"]
    lines.append(f"model {doc['engine']['model']} ({doc['engine']['num_params'] / 1e6:.1f}M params, {doc['engine']['dtype']}), "
                 f"matmul {r_['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s, bandwidth {r_['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s; "
                 f"median of {doc['repeats']} round-robin repeats")
    header = ["composition", "tokens", "bucket", "ms", "ms/token", "GFLOP", "MB", "compute floor ms",
              "memory floor ms", "x floor", "note"]
    table = []
    for r in doc["rows"]:
        note = ""
        if "vs_decode_alone" in r:
            note = f"{r['vs_decode_alone']:.2f}x decode alone"
        if "overhead" in r:
            note = f"overhead {r['overhead']:+.0%}"
        buckets = r["buckets"]
        bucket = str(buckets[0]) if len(set(buckets)) == 1 and len(buckets) == 1 else \
            "+".join(str(b) for b in buckets) if len(buckets) <= 4 else f"{len(buckets)} steps: {'+'.join(str(b) for b in buckets[:3])}+..."
        table.append([r["label"], str(r["num_tokens"]), bucket, fmt_ms(r["time_s"]), f"{r['per_token_s'] * 1e3:.3g}",
                      f"{r['flops'] / 1e9:.3g}", f"{r['bytes'] / 1e6:.3g}", f"{r['compute_floor_s'] * 1e3:.3g}",
                      f"{r['memory_floor_s'] * 1e3:.3g}", f"{r['x_floor']:.1f}", note])
    widths = [max(len(h), *(len(t[i]) for t in table)) for i, h in enumerate(header)]
    lines.append("  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths))))
    lines.append("  ".join("-" * w for w in widths))
    for t in table:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(t, widths))))
    return "\n".join(lines)


def write_plot(doc: dict, path: str) -> str:
    from sarathi_jax.bench.plots import pyplot

    plt = pyplot()

    rows = doc["rows"]
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    panels = []
    if "decode" in modes or "prefill" in modes:
        panels.append("per_token")
    panels += [m for m in modes if m in ("hybrid", "chunking")]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 3.8), squeeze=False)
    model = doc["engine"]["model"]
    for ax, panel in zip(axes[0], panels):
        if panel == "per_token":
            for mode, color, xl in (("prefill", "C1", "prompt tokens"), ("decode", "C0", "decode batch size")):
                rs = [r for r in rows if r["mode"] == mode]
                if not rs:
                    continue
                x = [r["x"] for r in rs]
                ax.plot(x, [r["per_token_s"] * 1e3 for r in rs], "o-", color=color, label=f"{mode} (measured)")
                ax.plot(x, [r["floor_s"] / r["num_tokens"] * 1e3 for r in rs], ":", color=color,
                        label=f"{mode} floor (max of compute, memory)")
            ctx = next((r.get("context") for r in rows if r["mode"] == "decode"), None)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("batch size (decode: sequences" + (f" at context {ctx}" if ctx else "") + "; prefill: tokens)")
            ax.set_ylabel("time per token (ms, log)")
            ax.set_title(f"per-token cost, {model}")
            ax.legend(fontsize=7)
        elif panel == "hybrid":
            rs = [r for r in rows if r["mode"] == "hybrid"]
            labels = [(r["label"].split(" + ")[-1] if " + " in r["label"] else "decodes alone")
                      + f"\n({r['num_tokens']} tok, bucket {r['buckets'][0]})" for r in rs]
            colors = ["C0" if r.get("added") == "none" else "C3" if r.get("added") == "whole prompt" else "C2" for r in rs]
            ys = [r["time_s"] * 1e3 for r in rs]
            ax.bar(range(len(rs)), ys, color=colors)
            for i, r in enumerate(rs):
                ax.text(i, ys[i], f"{r['time_s'] * 1e3:.0f}\n({r['vs_decode_alone']:.1f}x)", ha="center", va="bottom", fontsize=7)
            ax.set_xticks(range(len(rs)), labels, rotation=25, ha="right", fontsize=7)
            ax.set_ylabel("iteration time (ms)")
            d = rs[0].get("num_seqs")
            ax.set_title(f"{d} decodes + prefill: whole prompt vs chunk, {model}", fontsize=9)
            ax.set_ylim(0, max(ys) * 1.25)
        elif panel == "chunking":
            rs = [r for r in rows if r["mode"] == "chunking" and r.get("probe") != "iteration"]
            labels = [("probe " if r.get("probe") else "") + (f"chunk {r['chunk']}" if r["chunk"] != r["prompt_len"] else "unchunked")
                      for r in rs]
            ys = [r["time_s"] * 1e3 for r in rs]
            ax.bar(range(len(rs)), ys, color=["C4" if r.get("probe") else "C0" if r["chunk"] == r["prompt_len"] else "C2" for r in rs])
            for i, r in enumerate(rs):
                ax.text(i, ys[i], f"{ys[i]:.0f}\n{r.get('overhead', 0):+.0%}", ha="center", va="bottom", fontsize=7)
            ax.set_xticks(range(len(rs)), labels, rotation=25, ha="right", fontsize=7)
            ax.set_ylabel("total prefill time (ms)")
            p = rs[0]["prompt_len"] if rs else "?"
            ax.set_title(f"prefilling a {p}-token prompt in chunks, {model}", fontsize=9)
            ax.set_ylim(0, max(ys) * 1.25)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------------------------- CLI


def positive_ints(text: str) -> list[int]:
    """An argparse type: comma-separated positive integers."""
    try:
        vals = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m sarathi_jax.bench.step_cost",
        description="Iteration time of the model runner for chosen batch compositions, beside the machine's "
                    "compute and memory floors.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--mode", default="decode,prefill", help=f"comma-separated, from {', '.join(MODES)}")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", default="float32", choices=tuple(DTYPE_BYTES))
    p.add_argument("--quantization", default=None, choices=QUANTIZATIONS, help="8-bit layer weights (EngineConfig)")
    p.add_argument("--attention-backend", default="auto", choices=("auto", "xla", "pallas", "cpu"))
    p.add_argument("--scan-layers", default=None, action=argparse.BooleanOptionalAction,
                   help="EngineConfig.scan_layers (default: the platform's)")
    p.add_argument("--token-budget", type=int, default=None,
                   help=f"largest bucket (default {DEFAULT_TOKEN_BUDGET}, the bench's, raised to fit the largest batch)")
    p.add_argument("--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS, help="raised to fit the largest batch")
    p.add_argument("--max-model-len", type=int, default=DEFAULT_MAX_MODEL_LEN, help="raised to fit the longest sequence")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument("--kv-cache-bytes", type=int, default=None)
    p.add_argument("--engine-seed", type=int, default=0)
    p.add_argument("--seed", type=int, default=0, help="fake prompt token ids")

    p.add_argument("--batch-sizes", type=positive_ints, default=[1, 2, 4, 8, 16, 32], help="decode mode")
    p.add_argument("--context", type=int, default=512, help="decode and hybrid modes: tokens already cached per decode")
    p.add_argument("--tokens", type=positive_ints, default=[16, 32, 64, 128], help="prefill mode")
    p.add_argument("--decodes", type=int, default=32, help="hybrid mode: decode batch size")
    p.add_argument("--chunks", type=positive_ints, default=None,
                   help="hybrid (default 64,128,256,512) and chunking (default 64,128,256,512,1024) chunk sizes")
    p.add_argument("--whole-prompt", type=int, default=1024, help="hybrid mode")
    p.add_argument("--prompt-len", type=int, default=1024, help="chunking mode")
    p.add_argument("--tile-probe", type=int, default=256, help="chunking mode: also chunk N vs N+1 (0: off)")

    p.add_argument("--calib-buckets", type=positive_ints, default=None,
                   help="calibrate mode: buckets to fill (default: every bucket the engine compiles on this "
                        "device, up to the token budget)")
    p.add_argument("--calib-contexts", type=positive_ints, default=[128, 512], help="calibrate mode: decode contexts")
    p.add_argument("--calib-decodes", type=int, default=32, help="calibrate mode: most decodes in a batch")
    p.add_argument("--cost-model-out", type=cli_path, default=None, metavar="PATH",
                   help="calibrate mode: write the fitted simulator cost model (JSON) here; "
                        "use it with `python -m sarathi_jax.bench --simulate --cost-model PATH`")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1, help="untimed runs per composition (the first compiles)")
    p.add_argument("--matmul-n", type=int, default=2048)
    p.add_argument("--bandwidth-mb", type=int, default=256)
    p.add_argument("--matmul-rate", type=float, default=None, help="FLOP/s to use instead of measuring")
    p.add_argument("--bandwidth", type=float, default=None, help="bytes/s to use instead of measuring")
    p.add_argument("--json", type=cli_path, default=None, metavar="PATH")
    p.add_argument("--plot", type=cli_path, default=None, metavar="PATH")
    p.add_argument("--quiet", action="store_true")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(argv) if argv is not None else None
    if args.plot:
        from sarathi_jax.bench.plots import PLOTS_EXTRA, have_matplotlib

        if not have_matplotlib():
            parser.error(f"--plot needs matplotlib, the plots extra: {PLOTS_EXTRA}")
    modes = [m.strip() for m in args.mode.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        parser.error(f"--mode: unknown {bad}; choose from {', '.join(MODES)}")
    args.modes = list(dict.fromkeys(modes))
    args.hybrid_chunks = args.chunks or [64, 128, 256, 512]
    args.chunking_chunks = args.chunks or [64, 128, 256, 512, 1024]
    if args.context < 1 or args.decodes < 1 or args.whole_prompt < 1 or args.prompt_len < 1:
        parser.error("--context, --decodes, --whole-prompt and --prompt-len must be positive")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if "calibrate" in args.modes and args.calib_buckets is None:  # every bucket the engine compiles on this device
        import jax

        args.calib_buckets = list(platform_buckets(args.token_budget or DEFAULT_TOKEN_BUDGET, jax.default_backend()))
    if "chunking" in args.modes and args.prompt_len not in args.chunking_chunks:
        args.chunking_chunks = [*args.chunking_chunks, args.prompt_len]  # the unchunked reference
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    log = (lambda *a, **k: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    doc = measure(args, log)
    print(format_rows(doc))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {args.json}")
    if doc.get("cost_model"):
        cm = doc["cost_model"]
        errs = [abs(r["fit_s"] / r["time_s"] - 1) for r in doc["rows"] if "fit_s" in r]
        print(f"cost model: base per bucket (ms) {', '.join(f'{b}: {v * 1e3:.1f}' for b, v in cm['base_s'].items())}; "
              f"decode {cm['decode_kv_s'] * 1e9:.1f} ns per decode row-token (groups of {cm['row_group']} rows), prefill {cm['prefill_pair_s'] * 1e9:.2f} ns "
              f"per (query, key) pair; fit error median {statistics.median(errs):.1%}, max {max(errs):.1%}")
        if args.cost_model_out:
            with open(args.cost_model_out, "w") as f:
                json.dump(cm, f, indent=1)
            print(f"wrote {args.cost_model_out}")
    if args.plot:
        write_plot(doc, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
