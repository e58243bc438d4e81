"""Profile steady decode: `python -m benchmarks.probes.profile_steps --model llama-1b --batch 32 --out DIR`.

Builds an engine, brings `--batch` requests (prompts of `--context` tokens) into steady decode, then records a
JAX profiler trace of `--steps` consecutive `engine.step()` calls (each inside a `step` trace annotation) and
prints where the time goes (`benchmarks.probes.trace_summary`): wall per step, device busy fraction, kernels
per step, the busiest kernels and host events. The Perfetto trace is left under `--out` for ui.perfetto.dev.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
from pathlib import Path

from sarathi_jax.utils.paths import cli_path


def prefill_steps(batch: int, context: int, token_budget: int) -> int:
    """Steps, at most, until `batch` prompts of `context` tokens are all prefilled: the first admitted decode
    while later prompts get what the budget leaves (at least token_budget - batch tokens a step), one step each
    to admit, two spare. Each request's max_tokens must exceed it, or some finish before steady decode."""
    return -(-batch * context // max(token_budget - batch, 1)) + batch + 2


def steady_decode(engine, batch: int, context: int, max_tokens: int, seed: int = 0) -> None:
    """Add `batch` greedy requests with `context`-token prompts and step until every one of them is decoding."""
    import numpy as np

    from sarathi_jax import SamplingParams

    rng = np.random.default_rng(seed)
    vocab = engine.admission.vocab_size
    for i in range(batch):
        prompt = rng.integers(3, vocab, context).tolist()
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    while len(engine.scheduler.running) < batch or engine.scheduler.waiting or any(
            s.num_computed_tokens < len(s.prompt_token_ids) for s in engine.scheduler.running):
        if any(o.finished for o in engine.step()):  # it would never fill again: say so rather than spin
            raise RuntimeError(f"a request finished before all {batch} were decoding: raise max_tokens ({max_tokens})")


def trace_steps(engine, steps: int, out: str, before_step=None) -> tuple[dict, str]:
    """Record a JAX profiler trace of `steps` `engine.step()` calls (each in a `step` annotation; `before_step()`
    runs before each, outside it) under `out`; returns the trace's summary and the Perfetto trace's path."""
    import jax

    from benchmarks.probes.trace_summary import _load, summarize

    os.makedirs(out, exist_ok=True)
    with jax.profiler.trace(out, create_perfetto_trace=True):
        for _ in range(steps):
            if before_step is not None:
                before_step()
            with jax.profiler.TraceAnnotation("step"):
                engine.step()
        jax.effects_barrier()
    trace = sorted(glob.glob(os.path.join(out, "**", "*perfetto_trace.json.gz"), recursive=True))[-1]
    return summarize(_load(Path(trace)), "step"), trace


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--token-budget", type=int, default=512)
    parser.add_argument("--no-async", action="store_true", help="profile the synchronous loop")
    parser.add_argument("--scan-layers", default=None, action=argparse.BooleanOptionalAction,
                        help="EngineConfig.scan_layers (default: the platform's)")
    parser.add_argument("--out", type=cli_path, default="profile-steps")
    args = parser.parse_args(argv)

    from sarathi_jax import EngineConfig, LLMEngine
    from benchmarks.probes.trace_summary import format_summary
    from sarathi_jax.engine.llm_engine import format_startup

    prefill = prefill_steps(args.batch, args.context, args.token_budget)  # each request must outlive it
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, attention_backend=args.attention_backend,
                                    token_budget=args.token_budget, max_num_seqs=args.batch + 2,
                                    max_model_len=args.context + 4 * args.steps + 64 + prefill,
                                    async_scheduling=not args.no_async, scan_layers=args.scan_layers,
                                    background_compile=False))  # profiled steps: every bucket built before
    print(format_startup(engine.startup_stats()))
    steady_decode(engine, args.batch, args.context, max_tokens=prefill + 3 * args.steps + 16)
    for _ in range(args.steps):  # settle: every sequence decoding, all buckets in use warm
        engine.step()
    summary, trace = trace_steps(engine, args.steps, args.out)
    print(f"trace: {trace}")
    print(format_summary(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
