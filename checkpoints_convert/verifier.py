"""`--verify`: a probe prompt through the converted checkpoint (this engine's model) and through HF transformers.

The converted folder is loaded with `sarathi_jax.models.load_model(out_dir)` (the Orbax restore path the engine
uses) and the probe runs through the model forward over a paged KV cache. When torch and transformers are
importable, the same ids run through HF's float32 eager forward from the original folder (or, for a GGUF
source, from transformers' own loading of the same GGUF file, which dequantizes it independently), and the max relative
logit difference `max|ours - hf| / max|hf|` over all probe positions must stay under the threshold (1e-4 for a
float32 checkpoint; 5e-2 for bfloat16, whose rounding alone is ~1e-2 on logits).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

PROBE_TEXT = "The quick brown fox jumps over the lazy dog. Once upon a time there was a tiny model"
PROBE_LEN = 24
THRESHOLDS = {"float32": 1e-4, "bfloat16": 5e-2}


@dataclasses.dataclass
class VerifyResult:
    token_ids: list[int]
    max_rel_diff: float | None  # None when transformers is not installed
    threshold: float
    reference: str  # "transformers" or "none"

    @property
    def passed(self) -> bool:
        return self.max_rel_diff is None or self.max_rel_diff <= self.threshold


def probe_ids(out_dir: str | os.PathLike[str], vocab_size: int) -> list[int]:
    """The probe text through the folder's tokenizer, else fixed pseudo-random ids."""
    from sarathi_jax.request.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(out_dir)
    if tokenizer is not None:
        ids = [t for t in tokenizer.encode(PROBE_TEXT) if t < vocab_size][:PROBE_LEN]
        if len(ids) >= 4:
            return ids
    return np.random.default_rng(1234).integers(0, vocab_size, size=PROBE_LEN).tolist()


def engine_logits(model_dir: str | os.PathLike[str], token_ids: list[int], dtype: str,
                  quantization: str | None = None) -> np.ndarray:
    """Logits `[len, vocab]` of one prompt through `load_model(model_dir, dtype, quantization=quantization)` and
    the paged-KV model forward."""
    import jax.numpy as jnp

    from sarathi_jax.models import load_model

    config, params = load_model(model_dir, jnp.dtype(dtype), quantization=quantization)
    return paged_forward(config, dtype)(params, token_ids)


def paged_forward(config, dtype: str) -> Callable[[object, list[int]], np.ndarray]:
    """`forward(params, token_ids)` -> logits `[len, vocab]` (float64) of one prompt through the model forward
    over a paged KV cache, jitted once (one compile per prompt length)."""
    import jax
    import jax.numpy as jnp

    from sarathi_jax.models import AttentionMetadata, get_model, init_kv_cache

    model = get_model(config, jnp.dtype(dtype))
    apply = jax.jit(model.apply)
    block_size = 16

    def forward(params, token_ids: list[int]) -> np.ndarray:
        n = len(token_ids)
        num_blocks = -(-n // block_size)
        metadata = AttentionMetadata(
            slot_mapping=jnp.arange(n, dtype=jnp.int32),
            kv_lens=jnp.array([n], jnp.int32),
            block_tables=jnp.arange(num_blocks, dtype=jnp.int32)[None, :],
            cu_q_lens=jnp.array([0, n], jnp.int32),
            num_seqs=jnp.array([1], jnp.int32),
        )
        kv_cache = init_kv_cache(config, num_blocks, block_size, jnp.dtype(dtype))
        with jax.default_matmul_precision("highest"):  # no TF32 on GPUs: the 1e-4 budget needs true float32
            logits, _ = apply(
                {"params": params}, jnp.asarray(token_ids, jnp.int32), jnp.arange(n, dtype=jnp.int32), kv_cache,
                metadata, jnp.arange(n, dtype=jnp.int32),
            )
        return np.asarray(logits, np.float64)

    return forward


def load_hf_model(source: str | os.PathLike[str]):
    """HF transformers' float32 eager model from an HF folder or a GGUF file (transformers' own GGUF loading:
    `from_pretrained(folder, gguf_file=name)`, which dequantizes the file independently of this project)."""
    import torch
    from transformers import AutoModelForCausalLM

    source = Path(source)
    kwargs = {"gguf_file": source.name} if source.is_file() else {}
    return AutoModelForCausalLM.from_pretrained(source.parent if source.is_file() else source, dtype=torch.float32,
                                                attn_implementation="eager", **kwargs).eval()


def hf_logits(source: str | os.PathLike[str], token_ids: list[int]) -> np.ndarray | None:
    """`load_hf_model(source)`'s logits `[len, vocab]`, or None when torch / transformers are not installed."""
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError:
        return None
    model = load_hf_model(source)
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].double().numpy()


def verify(
    out_dir: str | os.PathLike[str],
    source: str | os.PathLike[str],
    dtype: str,
    threshold: float | None = None,
    log: Callable[[str], None] = print,
) -> VerifyResult:
    from sarathi_jax.models import ModelConfig

    config = ModelConfig.from_pretrained(out_dir)
    threshold = THRESHOLDS[dtype] if threshold is None else threshold
    ids = probe_ids(out_dir, config.vocab_size)
    ours = engine_logits(out_dir, ids, dtype)
    if not np.all(np.isfinite(ours)):
        raise ValueError(f"verify: the converted checkpoint gives non-finite logits for the probe {ids}")
    ref = hf_logits(source, ids)
    if ref is None:
        log(f"verify: {len(ids)}-token probe ran through the converted checkpoint (logits finite); transformers is "
            "not installed, so there is no reference to compare with")
        return VerifyResult(ids, None, threshold, "none")
    rel = float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))
    result = VerifyResult(ids, rel, threshold, "transformers")
    log(f"verify: {len(ids)}-token probe, max relative logit difference vs transformers {rel:.3g} "
        f"(threshold {threshold:g}): {'OK' if result.passed else 'FAILED'}")
    return result

