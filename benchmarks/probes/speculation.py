"""`python -m benchmarks.probes.speculation --model DIR`: speculative decoding against plain decoding on
a chat model, side by side in one process (`--drafts ngram,self:L,model:DIR`: which proposers, default ngram).

Two workloads of chat requests (`--requests` each, `--max-tokens` each, all submitted at once; greedy, or
sampled with `--temperature T`, all with seed `--seed`):
  copy   "repeat / fix this text": the answer copies spans of the prompt, so prompt lookup pays
  open   open questions: little to look up
For each workload it runs the engine without speculation, then with each draft of `--drafts` (`ngram`:
`{"method": "ngram", ...}`, `self:L`: the model's first L layers, `model:DIR`: a draft model) and each k of
`--k` as num_speculative_tokens, each after a warm-up pass of the same requests, and
reports output tokens per second (best of `--repeats`), the P50 and P99 time between tokens of that best pass
(all requests' gaps; tokens accepted together arrive together, a gap of 0), the acceptance rate, mean
accepted length, and how many
requests' tokens equal the plain run's (greedy, and sampled with the same seed: all should; a float32 near-tie
can flip one, as between chunk sizes; sampled requests with a model draft draw its drafts from its q and
rejection-sample them, so their tokens differ from the plain run's and only their distribution is the same).
`--proposals sampled,argmax` runs each model draft twice for sampled requests: drafts drawn from q (the
engine's way) and the draft's argmax as a point-mass proposal (its former way; `DraftRunner.sampling_of`
unset). `--loops overlapped,synchronous` runs every configuration in each engine loop (`async_scheduling`);
"x plain" is against the plain run in the same loop, "x sync" against the same configuration's synchronous
run; "overlap", the share of timed steps dispatched before the step ahead of them retired (from the
iteration records). Wall time on this machine: run it on a quiet one.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from sarathi_jax import LLM, SamplingParams

_TEXT = ("The committee met on Tuesday to review the budget for the new library. After a long discussion, "
         "the members agreed to increase funding for childrens books, to extend opening hours on weekends, and "
         "to hire two more librarians. The chair thanked everyone and closed the meeting at six.")
COPY = [f"Repeat the following text exactly, word for word:\n\n{_TEXT}",
        f"Correct the spelling in this text and return all of it:\n\n{_TEXT}",
        f"Rewrite this text in the past tense, keeping every detail:\n\n{_TEXT}",
        f"Copy this paragraph and then add one sentence at the end:\n\n{_TEXT}"]
OPEN = ["What is the capital of France, and why is it famous?", "Give me three tips for learning to cook.",
        "Why is the sky blue?", "Write a short poem about the sea."]


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams, repeats: int
        ) -> tuple[float, list, dict, float, tuple[float, float]]:
    """Tokens/s (best of `repeats`), each request's tokens, the engine's stats, the share of the timed steps
    dispatched before the step ahead of them retired (the overlap; 0 in the synchronous loop), and the best
    pass's (P50, P99) time between tokens in seconds."""
    llm.generate(prompts, params)  # warm-up: the buckets this workload uses
    best, outs, first = float("inf"), [], len(llm.engine.iteration_log)
    for _ in range(repeats):
        t0 = time.perf_counter()
        pass_outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - t0
        if elapsed < best:
            best, outs = elapsed, pass_outs
    tokens = sum(len(o.token_ids) for o in outs)
    log = llm.engine.iteration_log[first:]
    overlapped = sum(b.start_time < a.start_time + a.duration for a, b in zip(log, log[1:]))
    gaps = [gap for o in outs for gap in o.metrics.tbts]
    tbt = (float(np.percentile(gaps, 50)), float(np.percentile(gaps, 99))) if gaps else (float("nan"),) * 2
    return tokens / best, [o.token_ids for o in outs], llm.engine.stats(), overlapped / max(len(log) - 1, 1), tbt


def draft_config(draft: str, k: int) -> dict:
    """`--drafts` entry -> speculative_config."""
    method, _, arg = draft.partition(":")
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k}
    if method == "self" and arg:
        return {"method": "self", "num_layers": int(arg), "num_speculative_tokens": k}
    if method == "model" and arg:
        return {"model": arg, "num_speculative_tokens": k}
    raise ValueError(f"--drafts entries are ngram, self:L or model:DIR, got {draft!r}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a checkpoint folder with a tokenizer and a chat template")
    p.add_argument("--k", default="2,4,8", help="num_speculative_tokens values, comma-separated")
    p.add_argument("--drafts", default="ngram", help="proposers, comma-separated: ngram, self:L, model:DIR")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--token-budget", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else sampled, seeded with --seed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--proposals", default="sampled", help="model drafts' proposals for sampled requests, "
                   "comma-separated: sampled (from q), argmax (a point mass)")
    p.add_argument("--loops", default="overlapped", help="engine loops, comma-separated: overlapped, synchronous")
    args = p.parse_args()
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                            seed=args.seed if args.temperature > 0 else None)
    # Every bucket compiled before the engine serves: background compilation would share the cores with the
    # timed passes of whichever configuration runs first.
    engine = dict(token_budget=args.token_budget, max_num_seqs=args.max_num_seqs, max_model_len=1024,
                  compilation_cache_dir=None, background_compile=False)
    configs = [(None, "-")] + [(draft_config(d, int(k)), proposal) for d in args.drafts.split(",")
                               for k in args.k.split(",")
                               for proposal in (args.proposals.split(",") if d != "ngram" else ["-"])]
    loops = args.loops.split(",")
    if not set(loops) <= {"overlapped", "synchronous"}:
        raise ValueError(f"--loops entries are overlapped and synchronous, got {args.loops!r}")
    rows = []
    for name, texts in (("copy", COPY), ("open", OPEN)):
        base_tokens = None
        for (spec, proposal), loop in ((config, loop) for config in configs for loop in loops):
            llm = LLM(args.model, speculative_config=spec, async_scheduling=loop == "overlapped", **engine)
            if proposal == "argmax":
                llm.engine.draft_runner.sampling_of = None  # every draft the draft's argmax
            prompts = [llm.chat_prompt_ids([{"role": "user", "content": t}])
                       for t in (texts * args.requests)[: args.requests]]
            rate, tokens, stats, overlap, tbt = run(llm, prompts, params, args.repeats)
            base_tokens = tokens if base_tokens is None else base_tokens
            rows.append({"workload": name, "draft": _name(spec) + ("" if proposal == "-" else f"/{proposal}"),
                         "k": spec["num_speculative_tokens"] if spec else 0, "loop": loop,
                         "tokens_per_s": round(rate, 1), "overlapped_steps": round(overlap, 2),
                         "tbt_p50_ms": round(tbt[0] * 1e3, 1), "tbt_p99_ms": round(tbt[1] * 1e3, 1),
                         "acceptance_rate": stats.get("spec_acceptance_rate"),
                         "mean_accepted_length": stats.get("spec_mean_accepted_length"),
                         "same_tokens": sum(a == b for a, b in zip(tokens, base_tokens))})
            print(json.dumps(rows[-1]), flush=True)
    print(f"{'workload':8} {'draft':>16} {'k':>2} {'loop':>11} {'tok/s':>8} {'x plain':>8} {'x sync':>7} "
          f"{'overlap':>7} {'TBT P50':>8} {'TBT P99':>8} {'accept':>7} {'len':>5} same")
    for row in rows:
        plain = _rate(rows, workload=row["workload"], k=0, loop=row["loop"])
        sync = _rate(rows, workload=row["workload"], draft=row["draft"], k=row["k"], loop="synchronous")
        acc, length, rate = row["acceptance_rate"], row["mean_accepted_length"], row["tokens_per_s"]
        print(f"{row['workload']:8} {row['draft']:>16} {row['k']:>2} {row['loop']:>11} {rate:>8} {rate / plain:>8.2f} "
              f"{'-' if sync is None else f'{rate / sync:.2f}':>7} {row['overlapped_steps']:>7.2f} "
              f"{row['tbt_p50_ms']:>8} {row['tbt_p99_ms']:>8} "
              f"{'-' if acc is None else f'{acc:.2f}':>7} "
              f"{'-' if length is None else f'{length:.2f}':>5} {row['same_tokens']}/{args.requests}")


def _rate(rows: list[dict], **match: object) -> float | None:
    """The tokens/s of the first row with the `match`ing fields (None: no such row)."""
    return next((r["tokens_per_s"] for r in rows if all(r[key] == value for key, value in match.items())), None)


def _name(spec: dict | None) -> str:
    if spec is None:
        return "-"
    if spec.get("method") == "self":
        return f"self:{spec['num_layers']}"
    return "model" if "model" in spec else "ngram"


if __name__ == "__main__":
    main()
