"""Model steps of two engine variants, timed alternately in one process: `python -m
benchmarks.probes.out_major_steps [--compare out-major|panels|scan-layers|int8]`.

`out-major` (the default): the projection weights in-major against out-major (`sarathi_jax.models.out_major`).
`panels`: out-major (XLA's dot) against packed into panels (the C++ panel matmul; float32, where it is built).
`scan-layers`: the decoder layers scanned against unrolled (`EngineConfig.scan_layers`).
`int8`: the weights in `--dtype` against int8 layer weights (`EngineConfig.quantization`), each in the layout the
engine picks for it.

Both engines are `step_cost`'s (same flags: `--model`, `--dtype`, `--token-budget`, `--max-num-seqs`, ...). Every
repeat times each composition on one engine, then on the other, so that load from other processes falls on
both alike (a shared machine's speed drifts by 2x between runs of two trees). Prints the median and best ms per
step of each, and their ratio.

    python -m benchmarks.probes.out_major_steps --model /tmp/peer-60m --dtype float32 --mode decode \\
        --batch-sizes 1,4,16,32 --context 512 --token-budget 512 --max-num-seqs 64 --max-model-len 2048
    python -m benchmarks.probes.out_major_steps --compare int8 --model llama-1k8 --mode decode --batch-sizes 16 \
        --context 512 --repeats 20
"""

from __future__ import annotations

import copy
import statistics
import sys
from collections.abc import Sequence
from unittest import mock

from sarathi_jax.bench.step_timer import StepTimer, build_engine, compositions, engine_needs
from sarathi_jax.bench.step_cost import parse_args
from sarathi_jax.models.out_major import IN_MAJOR, OUT_MAJOR, PANELS

COMPARISONS = ("out-major", "panels", "scan-layers", "int8")


def _engines(compare: str, args, needs) -> dict:
    """The two variants, baseline first."""
    if compare in ("out-major", "panels"):
        engines = {}
        for layout in (IN_MAJOR, OUT_MAJOR) if compare == "out-major" else (OUT_MAJOR, PANELS):
            with mock.patch("sarathi_jax.runner.model_runner.projection_layout", lambda *a, layout=layout, **k: layout):
                engines[layout.replace("_", "-")] = engine = build_engine(args, needs)
            assert engine.runner.model.projection_layout == layout
        return engines
    if compare == "int8":
        return {name: build_engine(copy.copy(args) if q is None else _with(args, quantization=q), needs)
                for name, q in ((args.dtype, None), ("int8", "int8"))}
    engines = {}
    for name, scan in (("scanned", True), ("unrolled", False)):
        variant = copy.copy(args)
        variant.scan_layers = scan
        engines[name] = build_engine(variant, needs)
    return engines


def alternate(engines: dict, comps: Sequence, args) -> dict[tuple[str, int], list[float]]:
    """Seconds of each composition on each engine, `args.repeats` times, the engines' turns alternated every
    repeat (A B, then B A) after `args.warmup` untimed runs: `{(engine name, composition index): [s, ...]}`."""
    timers = {name: StepTimer(engine, args.seed) for name, engine in engines.items()}
    prepared = {name: [t.prepare(c.steps) for c in comps] for name, t in timers.items()}
    for name, timer in timers.items():
        for p in prepared[name]:
            for _ in range(max(1, args.warmup)):
                timer.run(p)
    times: dict[tuple[str, int], list[float]] = {(name, i): [] for name in timers for i in range(len(comps))}
    for r in range(args.repeats):
        order = list(timers) if r % 2 == 0 else list(reversed(timers))
        for i in range(len(comps)):
            for name in order:
                times[(name, i)].append(timers[name].run(prepared[name][i]))
    return times


def _with(args, **changes):
    variant = copy.copy(args)
    variant.__dict__.update(changes)
    return variant


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    compare = "out-major"
    if "--compare" in argv:  # this probe's own flag; the rest are step_cost's
        i = argv.index("--compare")
        compare = argv[i + 1]
        del argv[i : i + 2]
    if compare not in COMPARISONS:
        raise SystemExit(f"--compare must be one of {COMPARISONS}, got {compare!r}")
    args = parse_args(argv)
    comps = [c for m in args.modes for c in compositions(m, args)]
    needs = engine_needs(comps)
    engines = _engines(compare, args, needs)
    times = alternate(engines, comps, args)
    base, other = engines
    print(f"{args.model} {args.dtype}, median / best of {args.repeats} alternated repeats, ms per composition")
    print(f"{'composition':<28} {base:>16} {other:>16} {'median ratio':>14}")
    for i, c in enumerate(comps):
        a, b = times[(base, i)], times[(other, i)]
        print(f"{c.label:<28} {statistics.median(a) * 1e3:7.1f} / {min(a) * 1e3:6.1f} "
              f"{statistics.median(b) * 1e3:7.1f} / {min(b) * 1e3:6.1f} {statistics.median(b) / statistics.median(a):14.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
