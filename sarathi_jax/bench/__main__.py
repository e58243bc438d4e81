"""`python -m sarathi_jax.bench`: run scheduler configurations on the same requests and compare them.

With no arguments: the built-in tiny-llama preset (llama-1b on a GPU) under the sarathi scheduler and the
prefill-first baseline (vllm) on the same short synthetic Poisson workload, in real time, printing TTFT, TBT,
throughput and generation stalls for both and a one-line reading of the difference (under a minute on a 2-core
CPU, compile included).
Run `python -m sarathi_jax.bench --help` for the options. The options live in `bench/args.py`, the runs in
`bench/runs.py`, the table and files in `bench/report.py`.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Callable, Sequence

from sarathi_jax.bench.args import (  # noqa: F401  (re-exported: callers import them from here)
    BenchError,
    build_parser,
    check_args,
    default_model,
    engine_config_kwargs,
    run_configs,
)
from sarathi_jax.bench.report import print_report
from sarathi_jax.bench.runs import run_all


def main(argv: Sequence[str] | None = None, *, engine_factory: Callable[[dict], Any] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]  # as given: recorded in summary.json
    try:
        return _main(args, engine_factory)
    except BenchError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:  # bad trace files, length specs, engine configs: one clear line
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2


def _main(args: argparse.Namespace, engine_factory: Callable[[dict], Any] | None) -> int:
    t_start = time.monotonic()
    check_args(args)
    print_report(args, run_all(args, engine_factory))
    if not args.quiet:
        print(f"total {time.monotonic() - t_start:.1f} s", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
