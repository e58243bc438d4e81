"""Measure the converter's peak host memory: `python -m checkpoints_convert.peak_memory --hf DIR --out DIR`.

Imports JAX, Orbax and the converter first, takes the resident high-water mark (`peak_rss_bytes`) as the import
baseline, converts, and prints one JSON line: baseline, peak and peak - baseline (MiB), the largest parameter and
the total written (MiB), the number of Orbax partial saves and the conversion time. `--synthetic` first writes a
~232 MiB random float32 Llama checkpoint (8 layers, hidden 1024, MLP 1024, 8 KV heads: 4 MiB per matrix, so the
largest parameter after stacking the layers is 32 MiB; eight shards) into `--hf DIR`, with safetensors directly (no
transformers needed).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

from sarathi_jax.utils.paths import cli_path

SYNTHETIC_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 1024, "hidden_size": 1024, "intermediate_size": 1024,
    "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
    "max_position_embeddings": 2048, "tie_word_embeddings": False, "torch_dtype": "float32",
}


def write_synthetic_llama(folder: Path, config: dict = SYNTHETIC_CONFIG, seed: int = 0) -> None:
    """A random float32 Llama checkpoint, one shard per layer (+ index), written tensor by tensor per shard."""
    import numpy as np
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = hidden // heads
    rng = np.random.default_rng(seed)
    layers = config["num_hidden_layers"]
    weight_map: dict[str, str] = {}

    def rand(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)

    for i in range(layers):
        p = f"model.layers.{i}."
        tensors = {
            p + "input_layernorm.weight": np.ones(hidden, np.float32),
            p + "post_attention_layernorm.weight": np.ones(hidden, np.float32),
            p + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": rand(inter, hidden),
            p + "mlp.up_proj.weight": rand(inter, hidden),
            p + "mlp.down_proj.weight": rand(hidden, inter),
        }
        if i == 0:
            tensors["model.embed_tokens.weight"] = rand(vocab, hidden)
        if i == layers - 1:
            tensors["model.norm.weight"] = np.ones(hidden, np.float32)
            tensors["lm_head.weight"] = rand(vocab, hidden)
        name = f"model-{i + 1:05d}-of-{layers:05d}.safetensors"
        save_file(tensors, folder / name)
        weight_map.update({key: name for key in tensors})
        del tensors
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def peak_rss_bytes() -> int:
    """This process's resident high-water mark: `VmHWM` (Linux), else `ru_maxrss`. `ru_maxrss` survives
    `exec` on Linux, so a process started by a large one (a test runner) would report its parent's peak."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m checkpoints_convert.peak_memory")
    parser.add_argument("--hf", type=cli_path, required=True)
    parser.add_argument("--out", type=cli_path, required=True)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--quantization", default=None, help="as the converter's (int8)")
    parser.add_argument("--synthetic", action="store_true", help="first write the synthetic checkpoint into --hf")
    parser.add_argument("--write-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.write_only:
        write_synthetic_llama(Path(args.hf))
        return 0
    if args.synthetic and not (Path(args.hf) / "config.json").exists():
        # In a child process: generating the tensors here would raise this process's high-water mark.
        subprocess.run([sys.executable, "-m", "checkpoints_convert.peak_memory", "--hf", args.hf, "--out", args.out,
                        "--write-only"], check=True)

    import jax  # noqa: F401  (import baseline: everything the conversion imports)
    import orbax.checkpoint.experimental.v1  # noqa: F401

    from checkpoints_convert.converter import convert

    baseline = peak_rss_bytes()
    start = time.monotonic()
    result = convert(args.hf, args.out, args.dtype, force=True, log=lambda message: None,
                     quantization=args.quantization)
    seconds = time.monotonic() - start
    peak = peak_rss_bytes()
    mib = 1 << 20
    print(json.dumps({
        "baseline_mib": round(baseline / mib, 1),
        "peak_mib": round(peak / mib, 1),
        "delta_mib": round((peak - baseline) / mib, 1),
        "largest_param_mib": round(result.largest_param_bytes / mib, 1),
        "total_mib": round(result.num_bytes / mib, 1),
        "dtype": result.dtype,
        "quantization": result.config.quantization,
        "partial_saves": result.num_saves,
        "seconds": round(seconds, 2),
    }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
