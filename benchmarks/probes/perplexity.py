"""Perplexity of a fixed text through this engine's model forward, float vs quantized weights:
`python -m benchmarks.probes.perplexity --model DIR [--quantization int8] [--compare]`.

The text (`--text`, default `perplexity_text.txt` beside this file: about 2,900 words of plain English prose
written for this probe: a lighthouse keeper's year, bread, a conversation, bees, a garden, a town clock, the
sky's colour) is tokenized with the model folder's tokenizer (`--max-tokens` keeps its first N ids) and cut into
windows of `--window` tokens (default 1024, at most the model's max length), stride = window. Each window runs
through `load_model(DIR, dtype, quantization=...)` and the paged-KV model forward that
`checkpoints_convert --verify` uses (`verifier.paged_forward`, float32 matmuls at "highest" precision);
every token after a window's first is scored by its log-probability given its prefix in the window (teacher
forcing). Printed: tokens scored, mean negative log-likelihood (nats per token), perplexity = exp(mean NLL),
and the parameters' bytes. `--compare` runs the float model and the `--quantization` one (default int8) in
turn and prints the perplexity's relative difference.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

from sarathi_jax.models.config import QUANTIZATIONS
from sarathi_jax.utils.paths import cli_path

DEFAULT_TEXT = Path(__file__).with_name("perplexity_text.txt")


@dataclasses.dataclass
class Perplexity:
    dtype: str
    quantization: str | None
    tokens_scored: int
    windows: int
    nll: float  # summed negative log-likelihood, nats
    weight_bytes: int
    seconds: float

    @property
    def mean_nll(self) -> float:
        return self.nll / self.tokens_scored

    @property
    def perplexity(self) -> float:
        return math.exp(self.mean_nll)

    @property
    def label(self) -> str:
        return self.quantization or self.dtype


def text_ids(model: str, text_path: str | Path = DEFAULT_TEXT, max_tokens: int | None = None) -> list[int]:
    """The text's token ids through `model`'s tokenizer (its post-processor included, as HF's default),
    the first `max_tokens` of them."""
    from sarathi_jax.request.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model)
    if tokenizer is None:
        raise ValueError(f"{model}: no tokenizer.json; the perplexity probe needs a model folder with a tokenizer")
    ids = tokenizer.encode(Path(text_path).read_text())
    return ids[:max_tokens] if max_tokens is not None else ids


def windows(ids: list[int], window: int) -> list[list[int]]:
    """`ids` cut into consecutive windows of `window` tokens (the last one shorter), each of at least 2."""
    return [ids[i:i + window] for i in range(0, len(ids), window) if len(ids[i:i + window]) >= 2]


def token_nll(logits: np.ndarray, ids: list[int]) -> np.ndarray:
    """`-log p(ids[t] | ids[:t])` for t = 1..len-1, from the window's logits `[len, vocab]` (float64)."""
    logits = np.asarray(logits, np.float64)[:-1]
    top = logits.max(axis=-1)
    log_z = top + np.log(np.exp(logits - top[:, None]).sum(axis=-1))
    return log_z - logits[np.arange(len(ids) - 1), ids[1:]]


def perplexity(model: str, ids: list[int], window: int, dtype: str = "float32",
               quantization: str | None = None) -> Perplexity:
    """The perplexity of `ids` through `model` loaded with `quantization`, in windows of `window` tokens."""
    import jax
    import jax.numpy as jnp

    from checkpoints_convert.verifier import paged_forward
    from sarathi_jax.models import load_model

    config, params = load_model(model, jnp.dtype(dtype), quantization=quantization)
    if window > config.max_position_embeddings:
        raise ValueError(f"--window {window} exceeds the model's max length {config.max_position_embeddings}")
    forward = paged_forward(config, dtype)
    chunks = windows(ids, window)
    if not chunks:
        raise ValueError(f"{len(ids)} tokens: nothing to score (a window needs 2)")
    t0 = time.perf_counter()
    nll = sum(float(token_nll(forward(params, chunk), chunk).sum()) for chunk in chunks)
    seconds = time.perf_counter() - t0
    return Perplexity(dtype=dtype, quantization=config.quantization, tokens_scored=sum(len(c) - 1 for c in chunks),
                      windows=len(chunks), nll=nll, weight_bytes=sum(x.nbytes for x in jax.tree.leaves(params)),
                      seconds=seconds)


def describe(result: Perplexity) -> str:
    return (f"{result.label}: perplexity {result.perplexity:.4f} (mean NLL {result.mean_nll:.5f} nats/token over "
            f"{result.tokens_scored} tokens, {result.windows} windows), weights {result.weight_bytes / 1e6:.1f} MB, "
            f"{result.seconds:.1f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.probes.perplexity",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="model folder with a tokenizer (HF or converted)")
    parser.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                        help="weights quantized at load (default: float; with --compare: int8)")
    parser.add_argument("--compare", action="store_true", help="run float and --quantization, print the difference")
    parser.add_argument("--text", type=cli_path, default=str(DEFAULT_TEXT), help="plain text file to score")
    parser.add_argument("--window", type=int, default=1024, help="tokens per window (stride = window)")
    parser.add_argument("--max-tokens", type=int, default=None, help="score only the text's first N tokens")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--json-out", type=cli_path, default=None, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    if args.window < 2:
        parser.error("--window must be at least 2")

    ids = text_ids(args.model, args.text, args.max_tokens)
    print(f"text: {args.text}, {len(ids)} tokens, windows of {args.window}", flush=True)
    runs = [None, args.quantization or "int8"] if args.compare else [args.quantization]
    results = []
    for quantization in runs:
        results.append(perplexity(args.model, ids, args.window, args.dtype, quantization))
        print(describe(results[-1]), flush=True)
        if args.compare and results[0].quantization is not None:
            print(f"{args.model} holds {results[0].quantization} weights: --compare needs a float model",
                  file=sys.stderr)
            return 1
    figures = {"model": args.model, "text": str(args.text), "window": args.window, "dtype": args.dtype,
               "runs": [{**dataclasses.asdict(r), "mean_nll": r.mean_nll, "perplexity": r.perplexity} for r in results]}
    if args.compare:
        base, quantized = results
        figures["relative_difference"] = rel = quantized.perplexity / base.perplexity - 1
        print(f"{quantized.label} vs {args.dtype}: perplexity {rel:+.3%}, weights "
              f"{quantized.weight_bytes / base.weight_bytes:.2f}x")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
