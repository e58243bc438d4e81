"""`python -m sarathi_jax.bench.probes.out_major_steps`: model steps with the projection weights in-major against
out-major (`sarathi_jax.models.out_major`), two engines in one process, timed alternately.

Both engines are `step_cost`'s (same flags: `--model`, `--dtype`, `--token-budget`, `--max-num-seqs`, ...), one
built with `use_out_major` forced off. Every repeat times each composition on one engine, then on the other, so
that load from other processes falls on both alike (a shared machine's speed drifts by 2x between runs of two
trees). Prints the median and best ms per step of each, and their ratio.

    python -m sarathi_jax.bench.probes.out_major_steps --model /tmp/peer-60m --dtype float32 --mode decode \\
        --batch-sizes 1,4,16,32 --context 512 --token-budget 512 --max-num-seqs 64 --max-model-len 2048
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Sequence
from unittest import mock

from sarathi_jax.bench.probes.step_timer import StepTimer, build_engine, compositions, engine_needs
from sarathi_jax.bench.step_cost import parse_args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    comps = [c for m in args.modes for c in compositions(m, args)]
    needs = engine_needs(comps)
    with mock.patch("sarathi_jax.model_runner.use_out_major", lambda platform: False):
        in_major = build_engine(args, needs)
    out_major = build_engine(args, needs)
    assert out_major.runner.model.out_major_projections and not in_major.runner.model.out_major_projections
    timers = {"in-major": StepTimer(in_major, args.seed), "out-major": StepTimer(out_major, args.seed)}
    prepared = {name: [t.prepare(c.steps) for c in comps] for name, t in timers.items()}
    for name, timer in timers.items():
        for p in prepared[name]:
            for _ in range(max(1, args.warmup)):
                timer.run(p)
    times = {(name, i): [] for name in timers for i in range(len(comps))}
    for r in range(args.repeats):
        order = list(timers) if r % 2 == 0 else list(reversed(timers))  # A B, then B A
        for i in range(len(comps)):
            for name in order:
                times[(name, i)].append(timers[name].run(prepared[name][i]))
    print(f"{args.model} {args.dtype}, median / best of {args.repeats} alternated repeats, ms per composition")
    print(f"{'composition':<28} {'in-major':>16} {'out-major':>16} {'median out/in':>14}")
    for i, c in enumerate(comps):
        a, b = times[("in-major", i)], times[("out-major", i)]
        print(f"{c.label:<28} {statistics.median(a) * 1e3:7.1f} / {min(a) * 1e3:6.1f} "
              f"{statistics.median(b) * 1e3:7.1f} / {min(b) * 1e3:6.1f} {statistics.median(b) / statistics.median(a):14.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
