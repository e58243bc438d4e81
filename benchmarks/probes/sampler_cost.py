"""`python -m benchmarks.probes.sampler_cost`: the device sampler's time per call for each `SamplerVariant`.

Times `sample_jit(logits f32[S, V], arrays, variant=sampler_variant(rows))` on synthetic batches (every row
alike), for each vocabulary size, beside a floor: the bytes of the logits read once over this machine's
memory bandwidth (a large jitted elementwise copy, read + write bytes, best of `--repeats`: the probe of
`pallas_kernels.machine_rates`). Cases:

  greedy             temperature 0                               -> (greedy)
  sampled            temperature 1                               -> (sampled+none)
  top-k 50           temperature 1, top_k 50                     -> (sampled+top_k): one lax.top_k of 128
  top-p 0.9 flat     temperature 1, top_p 0.9, near-flat logits  -> (sampled+exact): nucleus of most of V
  top-k 50 peaked    temperature 1, top_k 50, top_p 0.9          -> (sampled+exact)
each also with logprobs=5 (+logprobs: the top-N `lax.top_k`). The new sampler's cost does not depend on the
values; `--baseline FILE` also times another implementation's `sample(logits, arrays)` (e.g. an older
`sarathi_jax/runner/sample/sampler.py` saved with `git show REV:sarathi_jax/runner/sample/sampler.py > FILE`) on the same inputs, with
the variant its own `sampler_variant(rows)` picks if it has one (else its default); an older one's cost may
depend on the values (top-k 50 peaked is the pre-radix top_k-candidates fast path, top-p 0.9 flat its bisection).

`--head EMBED` times instead the LM head and the greedy-only sampler (final-normed rows [R, EMBED], a head
weight [V, EMBED]) both ways, whatever R: logits row-major [R, V] then `sample`, and vocab-major [V, R] then
`greedy_vocab_major` (what `sample_packed` runs on a CPU for R <= `sampling_vocab_major.MAX_ROWS`), for each R
of `--head-rows`; the floor is the head weight's bytes over the read bandwidth (a jitted reduction's).

Every case is compiled and run once untimed, then the timed repeats go round-robin over all cases so that load
from other processes falls on all of them alike; the median and the best time are reported (on a shared
machine the best run is the least disturbed one), and best / floor.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.machine_rates import memory_bandwidth
from pallas_kernels.timing import seconds_per_call
from sarathi_jax.utils.paths import cli_path
from sarathi_jax.runner.input_batch import make_sampling_arrays, sampler_variant
from sarathi_jax.parallel.stages import LMHead
from sarathi_jax.runner.sample.sampler import sample, sample_jit
from sarathi_jax.request.sampling_params import SamplingParams
from sarathi_jax.runner.sample.vocab_major import GREEDY_ONLY, greedy_vocab_major

COPY_MBYTES = 256  # the bandwidth probe's array: far larger than any cache

# name -> (sampling params of every row, logits scale)
CASES: dict[str, tuple[dict[str, Any], float]] = {
    "greedy": (dict(temperature=0.0), 2.0),
    "sampled": (dict(temperature=1.0), 2.0),
    "top-k 50": (dict(temperature=1.0, top_k=50), 3.0),
    "top-p 0.9 flat": (dict(temperature=1.0, top_p=0.9), 0.1),
    "top-k 50 peaked": (dict(temperature=1.0, top_k=50, top_p=0.9), 3.0),
}


def format_table(header: list[str], rows: list[list[str]]) -> str:
    """Left-aligned first two columns, right-aligned numbers."""
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    lines = [header, ["-" * w for w in widths], *rows]
    return "\n".join(
        "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))) for line in lines
    )


def load_baseline(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("sampler_baseline", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses (string annotations) look their module up there
    spec.loader.exec_module(module)
    return module


def head_table(vocabs: list[int], embed: int, rows: list[int], repeats: int, bandwidth: float) -> str:
    """The greedy-only sampler executable with the LM head, row-major against vocab-major logits."""
    rng = np.random.default_rng(0)
    head = LMHead(np.dtype(np.float32))
    heads = {"row-major": jax.jit(lambda h, w, a: sample(head.logits(h, w), a, GREEDY_ONLY)[:2]),
             "vocab-major": jax.jit(lambda h, w, a: greedy_vocab_major(head.logits_vocab_major(h, w), a))}
    table = []
    for v in vocabs:
        weight = jnp.asarray((rng.standard_normal((v, embed)) * 0.05).astype(np.float32))
        calls: dict[tuple[int, str], Callable[[], Any]] = {}
        for r in rows:
            hidden = jnp.asarray(rng.standard_normal((r, embed)).astype(np.float32))
            arrays = jax.device_put(make_sampling_arrays([(SamplingParams(temperature=0.0), 0, 0, ())] * r, r))
            for name, fn in heads.items():
                calls[(r, name)] = lambda hidden=hidden, arrays=arrays, fn=fn: fn(hidden, weight, arrays)
        for call in calls.values():
            seconds_per_call(call)
        times: dict[tuple[int, str], list[float]] = {key: [] for key in calls}
        for _ in range(repeats):
            for key, call in calls.items():
                times[key].append(seconds_per_call(call))
        floor = v * embed * 4 / bandwidth
        for r in rows:
            best = {name: min(times[(r, name)]) for name in heads}
            table.append([f"{r}x{v}x{embed}", *(f"{statistics.median(times[(r, n)]) * 1e3:.2f} / {best[n] * 1e3:.2f}" for n in heads),
                          f"{best['row-major'] / best['vocab-major']:.2f}", f"{floor * 1e3:.2f}"])
    return format_table(["R x V x embed", "row-major median / best ms", "vocab-major median / best ms",
                         "speed-up (best)", "floor ms"], table)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=128, help="S: sampler rows (max_num_seqs)")
    parser.add_argument("--vocab", default="32000,128256", help="comma-separated vocabulary sizes V")
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per case")
    parser.add_argument("--baseline", type=cli_path,
                        help="a Python file whose `sample(logits, arrays)` is timed alongside")
    parser.add_argument("--head", type=int, metavar="EMBED", help="time the greedy LM head + sampler instead")
    parser.add_argument("--head-rows", default="4,16,64", help="with --head: comma-separated row counts R")
    args = parser.parse_args(argv)
    if args.head is not None:
        # The head's weight is read once, not copied: the floor takes the reduction's rate.
        bandwidth = memory_bandwidth(COPY_MBYTES, args.repeats).read_bytes_per_s
        print(f"device: {jax.devices()[0].device_kind}, memory bandwidth (jitted reduction, best): {bandwidth / 1e9:.1f} GB/s")
        print(head_table([int(x) for x in args.vocab.split(",")], args.head,
                         [int(x) for x in args.head_rows.split(",")], args.repeats, bandwidth))
        return

    baseline_module = load_baseline(args.baseline) if args.baseline else None
    baseline_variant = getattr(baseline_module, "sampler_variant", None)
    baseline = None
    if baseline_module is not None:
        static = ("variant",) if baseline_variant is not None else ()
        baseline = jax.jit(baseline_module.sample, static_argnames=static)
    bandwidth = memory_bandwidth(COPY_MBYTES, args.repeats).copy_bytes_per_s
    print(f"device: {jax.devices()[0].device_kind}, memory bandwidth (jitted copy, best): {bandwidth / 1e9:.1f} GB/s")
    rng = np.random.default_rng(0)
    table = []
    for v in (int(x) for x in args.vocab.split(",")):
        calls: dict[str, Callable[[], Any]] = {}
        variants: dict[str, str] = {}
        for name, (params, scale) in CASES.items():
            logits = jnp.asarray((rng.standard_normal((args.rows, v)) * scale).astype(np.float32))
            for logprobs in (None, 5):
                label = name if logprobs is None else f"{name} +logprobs"
                rows = [(SamplingParams(**params, logprobs=logprobs), i, 0, ()) for i in range(args.rows)]
                arrays = jax.device_put(make_sampling_arrays(rows, args.rows))
                variant = sampler_variant(rows)
                flags = ["sampled" if variant.sampled else "greedy"]
                flags += [variant.filter] if variant.sampled else []
                flags += ["logprobs"] if variant.logprobs else []
                variants[label] = "+".join(flags)
                calls[label] = lambda logits=logits, arrays=arrays, variant=variant: sample_jit(
                    logits, arrays, variant=variant
                )
                if baseline is not None:
                    kwargs = {} if baseline_variant is None else {"variant": baseline_variant(rows)}
                    calls[f"{label} (baseline)"] = lambda logits=logits, arrays=arrays, kwargs=kwargs: baseline(
                        logits, arrays, **kwargs
                    )
        for call in calls.values():  # compile + warm up
            seconds_per_call(call)
        times: dict[str, list[float]] = {label: [] for label in calls}
        for _ in range(args.repeats):
            for label, call in calls.items():
                times[label].append(seconds_per_call(call))
        floor = args.rows * v * 4 / bandwidth
        for label, variant in variants.items():
            new, best = statistics.median(times[label]), min(times[label])
            line = [f"{args.rows}x{v}", label, variant, f"{new * 1e3:.2f}", f"{best * 1e3:.2f}", f"{best / floor:.1f}"]
            if baseline is not None:
                old = times[f"{label} (baseline)"]
                line += [f"{statistics.median(old) * 1e3:.2f}", f"{min(old) * 1e3:.2f}", f"{min(old) / best:.2f}"]
            table.append(line + [f"{floor * 1e3:.2f}"])
    header = ["S x V", "case", "variant", "median ms", "best ms", "best/floor"]
    if baseline is not None:
        header += ["baseline median", "baseline best", "speedup (best)"]
    print(format_table(header + ["floor ms"], table))


if __name__ == "__main__":
    main()
