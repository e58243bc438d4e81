"""CLI: `python -m checkpoints_convert --hf DIR --out DIR [--dtype bfloat16|float32] [--quantization int8] [--force]
[--verify]`, or `python -m checkpoints_convert --gguf FILE.gguf --out DIR [--dtype float32|bfloat16]
[--quantization int8] [--force] [--verify]`.

`--quantization int8` stores the decoder layers' projections int8 with a float32 scale per output channel
(W8A16, `sarathi_jax/models/quantization.py`), quantized from the float values (a GGUF file's dequantized ones);
everything else in --dtype. The folder then loads as int8 without asking. fp8 is refused: it runs only on FP8
GPUs, so it is chosen at load there (`quantization='fp8'` on the float folder).

Exit status: 0 converted (and verified, with --verify); 2 the conversion failed (the message names the
problem: unsupported architecture, missing / mis-shaped tensor, corrupt file, output folder in the way);
3 --verify found logits further from transformers' than the threshold (the converted folder is kept).
"""

from __future__ import annotations

import argparse
import sys

from checkpoints_convert.converter import DTYPES, ConversionError, convert
from sarathi_jax.models.config import QUANTIZATIONS, SUPPORTED_ARCHITECTURES
from sarathi_jax.models.loader import CheckpointError
from sarathi_jax.utils.paths import cli_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m checkpoints_convert",
        description="Convert a Hugging Face safetensors checkpoint folder into an Orbax checkpoint that "
                    "sarathi-jax loads directly (LLM(model=OUT)). Supported architectures: "
                    + ", ".join(SUPPORTED_ARCHITECTURES),
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--hf", type=cli_path, help="HF folder: config.json, *.safetensors (+ index), tokenizer files")
    source.add_argument("--gguf", type=cli_path,
                        help="llama.cpp GGUF file (Llama family; any quantization the gguf package "
                             "dequantizes); default dtype float32")
    parser.add_argument("--out", type=cli_path, required=True,
                        help="output folder (created; must not hold a checkpoint unless --force)")
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="parameter dtype to store (default: float32 for float32 checkpoints, else bfloat16)")
    parser.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                        help="int8: store the decoder layers' projections as int8 with a float32 scale per output "
                             "channel (about a quarter of their float32 size), quantized from the float values; the "
                             "folder then loads as int8. fp8 is refused: it is chosen at load, on FP8 GPUs")
    parser.add_argument("--force", action="store_true", help="replace an existing output folder")
    parser.add_argument("--verify", action="store_true",
                        help="run a probe prompt through the converted checkpoint and (if installed) transformers "
                             "(for --gguf, transformers' own GGUF loading; with --quantization, its decoder Linears "
                             "given their int8-dequantized weights), and fail if the max relative logit "
                             "difference exceeds the threshold")
    parser.add_argument("--verify-threshold", type=float, default=None,
                        help="max relative logit difference for --verify (default 1e-4 float32, 5e-2 bfloat16)")
    parser.add_argument("--compress", action="store_true",
                        help="zstd-compress the stored arrays (smaller files, more memory and time while converting)")
    parser.add_argument("--quiet", action="store_true", help="print only the summary, not per-parameter progress")
    args = parser.parse_args(argv)

    def log(message: str) -> None:
        if not args.quiet or not message.startswith("["):
            print(message, flush=True)

    try:
        if args.gguf is not None:
            from checkpoints_convert.gguf_source import convert_gguf

            result = convert_gguf(args.gguf, args.out, args.dtype, force=args.force, log=log, compress=args.compress,
                                  quantization=args.quantization)
        else:
            result = convert(args.hf, args.out, args.dtype, force=args.force, log=log, compress=args.compress,
                             quantization=args.quantization)
    except (ConversionError, CheckpointError, OSError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    if args.verify:
        from checkpoints_convert.verifier import verify

        outcome = verify(args.out, args.hf or args.gguf, result.dtype, args.verify_threshold, log=log)
        if not outcome.passed:
            print(f"error: verify failed: max relative logit difference {outcome.max_rel_diff:.3g} > "
                  f"{outcome.threshold:g} (the converted folder {args.out!r} is kept for inspection)",
                  file=sys.stderr, flush=True)
            return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
