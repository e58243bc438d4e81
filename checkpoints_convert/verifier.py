"""`--verify`: a probe prompt through the converted checkpoint (this engine's model) and through HF transformers.

The converted folder is loaded with `sarathi_jax.models.load_model(out_dir)` (the Orbax restore path the engine
uses) and the probe runs through the model forward over a paged KV cache. When torch and transformers are
importable, the same ids run through HF's float32 eager forward from the original folder (or, for a GGUF
source, from transformers' own loading of the same GGUF file, which dequantizes it independently), and the max relative
logit difference `max|ours - hf| / max|hf|` over all probe positions must stay under the threshold (1e-4 for a
float32 checkpoint; 5e-2 for bfloat16, whose rounding alone is ~1e-2 on logits).

A folder converted with `--quantization int8` (its marker says so) loads as int8, and the reference is the same
transformers model with every decoder-layer `nn.Linear` (all but the LM head) given its int8-dequantized weight,
computed in torch independently of this project: per output channel (row) `scale = max|w| / 127`,
`q = round half to even(w / scale)`, `w = q * scale`. The engine computes `(x . q) * scale`, the reference
`x . (q * scale)`: equal up to float rounding, so the same thresholds apply.
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
    reference: str  # "transformers", "transformers-int8" (its decoder Linears int8-dequantized) or "none"

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


def dequantize_linears(model, quantization: str = "int8") -> int:
    """Replace, in place, the weight `w [out, in]` of every `nn.Linear` of `model` but its LM head (the decoder
    layers' projections) by its per-output-channel int8 dequantized copy, in torch: `scale = max|w| / 127` per
    row, `q = round(w / scale)` (half to even; a row of zeros stays zeros), `w = q * scale`. Returns how many."""
    import torch

    if quantization != "int8":
        raise ValueError(f"the transformers reference dequantizes int8 weights only, not {quantization!r}")
    head = model.get_output_embeddings()
    count = 0
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module is not head:
                w = module.weight.float()
                scale = w.abs().amax(dim=1, keepdim=True) / 127
                q = torch.clamp(torch.round(w / torch.where(scale == 0, torch.ones_like(scale), scale)), -127, 127)
                module.weight.copy_(q * scale)
                count += 1
    return count


def hf_logits(source: str | os.PathLike[str], token_ids: list[int],
              quantization: str | None = None) -> np.ndarray | None:
    """`load_hf_model(source)`'s logits `[len, vocab]` (with `quantization`, on its `dequantize_linears` weights),
    or None when torch / transformers are not installed."""
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError:
        return None
    model = load_hf_model(source)
    if quantization is not None:
        dequantize_linears(model, quantization)
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].double().numpy()


def verify(
    out_dir: str | os.PathLike[str],
    source: str | os.PathLike[str],
    dtype: str,
    threshold: float | None = None,
    log: Callable[[str], None] = print,
) -> VerifyResult:
    """The probe through the converted folder `out_dir` (in its stored quantization, read from its marker) and
    through transformers from `source` (the HF folder or GGUF file it was converted from); see the module doc."""
    from sarathi_jax.models import ModelConfig
    from sarathi_jax.models.loader import checkpoint_quantization

    config = ModelConfig.from_pretrained(out_dir)
    quantization = checkpoint_quantization(out_dir, None)
    threshold = THRESHOLDS[dtype] if threshold is None else threshold
    ids = probe_ids(out_dir, config.vocab_size)
    ours = engine_logits(out_dir, ids, dtype)
    if not np.all(np.isfinite(ours)):
        raise ValueError(f"verify: the converted checkpoint gives non-finite logits for the probe {ids}")
    ref = hf_logits(source, ids, quantization)
    if ref is None:
        log(f"verify: {len(ids)}-token probe ran through the converted checkpoint (logits finite); transformers is "
            "not installed, so there is no reference to compare with")
        return VerifyResult(ids, None, threshold, "none")
    rel = float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))
    reference = "transformers" if quantization is None else f"transformers-{quantization}"
    result = VerifyResult(ids, rel, threshold, reference)
    against = "" if quantization is None else (
        f" on {quantization}-dequantized weights (each decoder-layer Linear per output channel, computed in torch)")
    log(f"verify: {len(ids)}-token probe, max relative logit difference vs transformers{against} {rel:.3g} "
        f"(threshold {threshold:g}): {'OK' if result.passed else 'FAILED'}")
    return result

