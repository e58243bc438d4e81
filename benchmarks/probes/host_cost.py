"""`python -m benchmarks.probes.host_cost`: the host's work per `engine.step()`, and where it goes.

What it measures: the CPU time of the thread that calls `engine.step()` (`time.thread_time()`), not XLA's own
threads, for the real engine (sarathi scheduler, overlapped loop, model runner) in steady state:
  decode-32    32 running decodes per step;
  decode-128   128 running decodes per step;
  mixed-512    32 decodes plus a prefill chunk that fills the 512-token budget (a stream of long prompts).
The model has llama-1b's layer count and head layout (16 layers, 32 query / 8 KV heads, head_dim 64) on a
narrow width (hidden 256, MLP 512, vocabulary 32000), float32: the host's work depends on the layers (argument
leaves, kernels to launch) and the batch, not on the width; a narrow model keeps the device work small.

`--tree DIR` runs the same measurement in a subprocess against another checkout of the project (for example
`git worktree add /tmp/base <commit>`), one after the other in the same run, so a before/after pair comes from
one machine at one time. An older tree that lacks the `llama-1b-narrow` preset gets it registered here.

Per workload: `--steps` timed steps after `--warmup-steps` untimed ones; reported: mean, median and p90 of the
thread CPU ms per step, the wall ms per step, and (separately, with `--profile`) a cProfile of `--steps` more
steps: the functions with the most own time and the cumulative time of the engine's main parts, per step.
cProfile inflates Python-heavy parts: its figures say where the time goes, not how much there is.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import time
from typing import Any

PRESET = "llama-1b-narrow"
PRESET_HF_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 32000,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}
WORKLOADS = {"decode-32": (32, False), "decode-128": (128, False), "mixed-512": (32, True)}
TOKEN_BUDGET = 512
CONTEXT = 256  # prompt tokens of each decoding request
PREFILL_PROMPT = 2048  # prompt tokens of the mixed workload's prefills (several chunks each)


def _ensure_preset() -> None:
    from sarathi_jax.models import presets

    if PRESET not in presets.PRESETS:  # an older tree
        presets.PRESET_HF_CONFIGS[PRESET] = PRESET_HF_CONFIG
        presets.PRESETS[PRESET] = presets.ModelConfig.from_hf_config(PRESET_HF_CONFIG)


def _engine(args: argparse.Namespace) -> Any:
    from sarathi_jax import EngineConfig, LLMEngine

    _ensure_preset()
    max_len = CONTEXT + args.warmup_steps + 3 * args.steps + 64
    blocks_per_seq = -(-max_len // 16)
    num_blocks = 128 * blocks_per_seq + 2 * (-(-PREFILL_PROMPT // 16)) + 64
    engine = LLMEngine(EngineConfig(
        model=PRESET, dtype="float32", token_budget=TOKEN_BUDGET, max_num_seqs=128 + 2, max_model_len=4096,
        num_blocks=num_blocks, attention_backend=args.attention_backend, compilation_cache_dir=None,
        scan_layers=args.scan_layers,
    ))
    engine.wait_until_compiled()
    return engine


def _run_workload(engine: Any, name: str, args: argparse.Namespace) -> dict:
    from sarathi_jax import SamplingParams

    num_decodes, mixed = WORKLOADS[name]
    rng_ids = lambda seed, n: [(seed * 7919 + i * 104729) % 31000 + 500 for i in range(n)]  # noqa: E731
    decode = SamplingParams(max_tokens=4000 - CONTEXT, ignore_eos=True, temperature=0.0)
    for i in range(num_decodes):
        engine.add_request(f"{name}-d{i}", rng_ids(i + 1, CONTEXT), decode)
    # Until every decode runs (prompts of 256 tokens, budget 512: two prefills a step).
    for _ in range(num_decodes // 2 + 8):
        engine.step()
    prefill_params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    counter = [0]

    def feed() -> None:
        if mixed and not engine.scheduler.waiting:
            counter[0] += 1
            engine.add_request(f"{name}-p{counter[0]}", rng_ids(10_000 + counter[0], PREFILL_PROMPT), prefill_params)

    for _ in range(args.warmup_steps):
        feed()
        engine.step()
    thread_ms, wall_ms, tokens = [], [], []
    for _ in range(args.steps):
        feed()
        c0, t0 = time.thread_time(), time.perf_counter()
        engine.step()
        thread_ms.append((time.thread_time() - c0) * 1e3)
        wall_ms.append((time.perf_counter() - t0) * 1e3)
        record = engine.iteration_log[-1]
        tokens.append((record.num_decode_tokens, record.num_prefill_tokens))
    out = {
        "workload": name,
        "thread_ms_mean": statistics.fmean(thread_ms),
        "thread_ms_p50": statistics.median(thread_ms),
        "thread_ms_p90": sorted(thread_ms)[int(0.9 * (len(thread_ms) - 1))],
        "wall_ms_mean": statistics.fmean(wall_ms),
        "decode_tokens_per_step": statistics.fmean(t[0] for t in tokens),
        "prefill_tokens_per_step": statistics.fmean(t[1] for t in tokens),
    }
    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.steps):
            feed()
            engine.step()
        profiler.disable()
        out["profile"] = _summarize(profiler, args.steps)
    for request_id in [f"{name}-d{i}" for i in range(num_decodes)] + [f"{name}-p{i}" for i in range(counter[0] + 1)]:
        engine.abort(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    return out


def _summarize(profiler: cProfile.Profile, steps: int, top: int = 25) -> list[dict]:
    """The `top` functions by own time, with their cumulative time, per step."""
    stats = pstats.Stats(profiler)
    rows = []
    for (filename, line, func), (_, ncalls, tottime, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
        where = f"{os.path.basename(filename)}:{line}({func})" if line else func
        rows.append({"function": where, "calls_per_step": ncalls / steps, "own_ms": tottime / steps * 1e3,
                     "cumulative_ms": cumtime / steps * 1e3})
    rows.sort(key=lambda r: -r["own_ms"])
    return rows[:top]


def _measure(args: argparse.Namespace) -> dict:
    import jax

    engine = _engine(args)
    results = [_run_workload(engine, name, args) for name in args.workloads]
    return {"tree": os.path.dirname(os.path.dirname(os.path.abspath(__import__("sarathi_jax").__file__))),
            "jax": jax.__version__, "backend": jax.default_backend(),
            "attention_backend": engine.config.attention_backend, "scan_layers": engine.config.scan_layers,
            "workloads": results}


def _format(run: dict) -> str:
    lines = [f"tree {run['tree']} ({run['attention_backend']} attention, "
             f"{'scanned' if run['scan_layers'] else 'unrolled'} layers, jax {run['jax']} on {run['backend']})",
             "| workload | host CPU ms/step mean | p50 | p90 | wall ms/step | decodes | prefill tokens |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for w in run["workloads"]:
        lines.append(f"| {w['workload']} | {w['thread_ms_mean']:.3f} | {w['thread_ms_p50']:.3f} | "
                     f"{w['thread_ms_p90']:.3f} | {w['wall_ms_mean']:.2f} | {w['decode_tokens_per_step']:.0f} | "
                     f"{w['prefill_tokens_per_step']:.0f} |")
    for w in run["workloads"]:
        if "profile" in w:
            lines.append(f"\ncProfile, {w['workload']} (ms per step; own / cumulative):")
            lines += [f"  {r['own_ms']:7.3f} {r['cumulative_ms']:8.3f}  x{r['calls_per_step']:<6.1f} {r['function']}"
                      for r in w["profile"]]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), default=list(WORKLOADS))
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--scan-layers", type=lambda s: {"true": True, "false": False, "auto": None}[s.lower()],
                   default=None, help="true, false or auto (the platform's default)")
    p.add_argument("--profile", action="store_true", help="also cProfile --steps more steps per workload")
    p.add_argument("--tree", action="append", default=[],
                   help="also measure another checkout of the project (a subprocess), before this one")
    p.add_argument("--json", help="write the runs here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.child:
        print(json.dumps(_measure(args)))
        return 0
    runs = []
    for tree in args.tree:
        child_argv = [a for a in (argv if argv is not None else sys.argv[1:])]
        cleaned, skip = [], False
        for a in child_argv:
            if skip:
                skip = False
                continue
            if a == "--tree" or a == "--json":
                skip = True
                continue
            if a.startswith("--tree=") or a.startswith("--json="):
                continue
            cleaned.append(a)
        env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", *cleaned], env=env,
                              cwd=os.path.abspath(tree), capture_output=True, text=True)
        if proc.returncode:
            sys.stderr.write(proc.stderr[-4000:])
            raise SystemExit(f"the run against {tree} failed (exit {proc.returncode})")
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    runs.append(_measure(args))
    for run in runs:
        print(_format(run) + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
