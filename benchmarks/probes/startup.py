"""Start-up time, cold and warm: `python -m benchmarks.probes.startup --model tiny-llama [--runs 2]`.

Each run is a fresh Python process (as a user's second start would be) that builds an `LLMEngine`, generates a
few greedy tokens (timed: the first request meets the background build), waits for the background build, and
prints its `startup_stats()`: load, init, compile (tracing, lowering and compiling, or loading from JAX's
persistent compilation cache), warm-up, and how long the executables left to the background took. All runs
share one compilation cache directory, empty at the start unless `--cache-dir` names an existing one, so run 1
is cold and the others are warm.
The wall time of each process (interpreter and imports included) is printed beside the engine's own figure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from sarathi_jax.config.engine_config import BUCKET_LADDERS
from sarathi_jax.utils.paths import cli_path


def _child(args: argparse.Namespace) -> int:
    from sarathi_jax import EngineConfig, LLMEngine, SamplingParams
    from sarathi_jax.engine.llm_engine import format_startup

    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, token_budget=args.token_budget,
                                    max_num_seqs=args.max_num_seqs, attention_backend=args.attention_backend,
                                    num_blocks=args.num_blocks, compilation_cache_dir=args.cache_dir,
                                    scan_layers=args.scan_layers, bucket_ladder=args.bucket_ladder))
    t0 = time.monotonic()
    engine.add_request("probe", list(range(1, 17)), SamplingParams(max_tokens=4, temperature=0.0))
    tokens: list[int] = []
    first_token_s = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = list(out.token_ids)
            if tokens and first_token_s is None:
                first_token_s = time.monotonic() - t0
    probe_s = time.monotonic() - t0
    engine.wait_until_compiled()  # so that the next run finds every executable in the cache
    stats = engine.startup_stats()
    print(f"{format_startup(stats)}; probe request: first token {first_token_s:.2f} s, "
          f"{len(tokens)} tokens {probe_s:.2f} s", file=sys.stderr)
    print(json.dumps({**stats, "generated": tokens, "probe_first_token_s": first_token_s, "probe_s": probe_s}))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--token-budget", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--num-blocks", type=int, default=None)
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--scan-layers", default=None, action=argparse.BooleanOptionalAction,
                        help="EngineConfig.scan_layers (default: the platform's)")
    parser.add_argument("--bucket-ladder", default=None, choices=BUCKET_LADDERS,
                        help="EngineConfig.bucket_ladder: the token buckets compiled (default: the budget's)")
    parser.add_argument("--runs", type=int, default=2, help="fresh processes; the first one is cold")
    parser.add_argument("--cache-dir", type=cli_path, default=None, help="compilation cache (default: a new empty one)")
    parser.add_argument("--json", type=cli_path, metavar="PATH", help="write every run's stats here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return _child(args)

    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="sarathi-startup-cache-")
    child_argv = [sys.executable, "-m", "benchmarks.probes.startup", "--child", "--model", args.model,
                  "--dtype", args.dtype, "--attention-backend", args.attention_backend, "--cache-dir", cache_dir]
    if args.scan_layers is not None:
        child_argv.append("--scan-layers" if args.scan_layers else "--no-scan-layers")
    for flag, value in (("--token-budget", args.token_budget), ("--max-num-seqs", args.max_num_seqs),
                        ("--num-blocks", args.num_blocks), ("--bucket-ladder", args.bucket_ladder)):
        if value is not None:
            child_argv += [flag, str(value)]
    runs = []
    for i in range(args.runs):
        cold = not os.path.isdir(cache_dir) or not os.listdir(cache_dir)
        t0 = time.monotonic()
        proc = subprocess.run(child_argv, capture_output=True, text=True, env=dict(os.environ))
        wall = time.monotonic() - t0
        if proc.returncode != 0:
            print(proc.stderr[-4000:], file=sys.stderr)
            return proc.returncode
        stats = json.loads(proc.stdout.strip().splitlines()[-1])
        stats["process_wall_s"] = wall
        runs.append(stats)
        line = proc.stderr.strip().splitlines()[-1]
        print(f"run {i + 1} ({'cold' if cold else 'warm'} cache): process {wall:.1f} s; {line}")
    if len({tuple(r["generated"]) for r in runs}) != 1:
        print("runs generated different tokens:", [r["generated"] for r in runs], file=sys.stderr)
        return 1
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "dtype": args.dtype, "cache_dir": cache_dir, "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
