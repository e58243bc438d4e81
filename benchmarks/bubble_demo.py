"""Pipeline bubble fraction per scheduling policy, on a short synthetic workload.

    python -m benchmarks.bubble_demo --pp 2 --policies sarathi vllm

Builds one warmed-up engine per policy with `pipeline_parallel_size=pp` (and `tensor_parallel_size=tp`),
replays the same requests (seeded lengths, Poisson arrivals on the wall clock, or all at once with
`--qps 0`), and prints the engine's `pipeline_stats()`. On a CPU host it asks XLA for 8 virtual devices
(they share the host's cores: the figures show the mechanism, not speed).
"""

from __future__ import annotations

import argparse
import os
import time

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import numpy as np  # noqa: E402

from sarathi_jax.config.engine_config import EngineConfig  # noqa: E402
from sarathi_jax.engine.llm_engine import LLMEngine  # noqa: E402
from sarathi_jax.request.sampling_params import SamplingParams  # noqa: E402


def make_requests(n: int, qps: float, prompt_range: tuple[int, int], output_range: tuple[int, int], seed: int):
    rng = np.random.default_rng(seed)
    arrivals = np.zeros(n) if qps <= 0 else np.cumsum(rng.exponential(1.0 / qps, size=n))
    prompts = [rng.integers(3, 1000, size=int(rng.integers(*prompt_range, endpoint=True))).tolist() for _ in range(n)]
    outputs = rng.integers(*output_range, endpoint=True, size=n)
    return list(zip(arrivals.tolist(), prompts, outputs.tolist()))


def run(engine: LLMEngine, requests) -> float:
    engine.reset_pipeline_stats()
    start = time.monotonic()
    pending = list(enumerate(requests))
    while pending or engine.has_unfinished_requests():
        now = time.monotonic() - start
        while pending and pending[0][1][0] <= now:
            i, (_, prompt, max_tokens) = pending.pop(0)
            engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        if not engine.has_unfinished_requests():
            time.sleep(min(0.005, max(0.0, pending[0][1][0] - now)))
            continue
        engine.step()
    return time.monotonic() - start


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--policies", nargs="+", default=["sarathi", "vllm"])
    ap.add_argument("--num-requests", type=int, default=24)
    ap.add_argument("--qps", type=float, default=20.0, help="Poisson arrival rate; 0: all requests at once")
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(32, 192))
    ap.add_argument("--output-len", type=int, nargs=2, default=(8, 32))
    ap.add_argument("--token-budget", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    requests = make_requests(args.num_requests, args.qps, tuple(args.prompt_len), tuple(args.output_len), args.seed)
    rows = []
    for policy in args.policies:
        config = EngineConfig(
            model=args.model, scheduler=policy, token_budget=args.token_budget, max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len, max_num_batched_tokens=args.max_model_len, num_blocks=512,
            tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp,
            background_compile=False,  # timed from the first request: every bucket built before
        )
        engine = LLMEngine(config, warmup=True)
        elapsed = run(engine, requests)
        stats = engine.pipeline_stats()
        tokens = sum(r.num_prefill_tokens + r.num_decode_tokens for r in engine.iteration_log)
        rows.append((policy, stats, elapsed, tokens))

    print(f"model={args.model} tp={args.tp} pp={args.pp} requests={args.num_requests} qps={args.qps} "
          f"prompt={tuple(args.prompt_len)} output={tuple(args.output_len)} token_budget={args.token_budget}")
    print(f"{'policy':10} {'bubble':>7} {'micro-batches':>13} {'tokens/mb':>9} {'max in flight':>13} "
          f"{'max overlap':>11} {'busy per stage (s)':>20} {'wall (s)':>8}")
    for policy, s, elapsed, tokens in rows:
        busy = " ".join(f"{b:.2f}" for b in s["stage_busy_s"])
        print(f"{policy:10} {s['bubble_fraction']:7.3f} {s['num_microbatches']:13d} "
              f"{tokens / max(1, s['num_microbatches']):9.1f} {s['max_in_flight']:13d} {s['max_overlap']:11d} "
              f"{busy:>20} {s['wall_s']:8.2f}")


if __name__ == "__main__":
    main()
