"""What the HF-oracle model tests (test_llama.py, test_falcon.py) share: the reference logits from
transformers' eager float32 forward, padded step inputs for a list of chunks, the error measure, and the
full-precision fixture `full_float32_matmuls` (autouse: importing it turns it on for the importing module)."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from sarathi_jax.models import AttentionMetadata, ModelConfig, get_model, load_model, to_out_major
from sarathi_jax.models.out_major import IN_MAJOR, OUT_MAJOR, PANELS


@pytest.fixture(scope="module", autouse=True)
def full_float32_matmuls():
    """GPUs default to TF32 for float32 matmuls, which alone exceeds the 1e-4 budget; CPU is unaffected."""
    with jax.default_matmul_precision("highest"):
        yield


def rel_err(got: Any, ref: np.ndarray) -> float:
    """max|got - ref| / max|ref|."""
    return float(np.max(np.abs(np.asarray(got, np.float64) - ref)) / np.max(np.abs(ref)))


@functools.cache
def hf_model(folder: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()


def hf_logits(folder: Path, token_ids: list[int]) -> np.ndarray:
    """Reference logits `[len, vocab]` from HF's eager float32 forward."""
    model = hf_model(folder)
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].double().numpy()


@dataclasses.dataclass
class Chunk:
    """`token_ids` of one sequence at positions `start ...`, whose cache blocks are `block_table`."""

    token_ids: list[int]
    start: int
    block_table: list[int]


def make_step(chunks: list[Chunk], num_tokens: int, max_num_seqs: int, max_blocks: int, block_size: int) -> tuple[Any, ...]:
    """Padded step inputs for `chunks`; logits are requested for every real row, in order."""
    token_ids = np.zeros(num_tokens, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    slot_mapping = np.full(num_tokens, -1, np.int32)
    kv_lens = np.zeros(max_num_seqs, np.int32)
    block_tables = np.zeros((max_num_seqs, max_blocks), np.int32)
    cu_q_lens = np.zeros(max_num_seqs + 1, np.int32)
    row = 0
    for i, chunk in enumerate(chunks):
        n = len(chunk.token_ids)
        pos = np.arange(chunk.start, chunk.start + n)
        token_ids[row : row + n] = chunk.token_ids
        positions[row : row + n] = pos
        table = np.asarray(chunk.block_table)
        slot_mapping[row : row + n] = table[pos // block_size] * block_size + pos % block_size
        kv_lens[i] = chunk.start + n
        block_tables[i, : len(table)] = table
        row += n
        cu_q_lens[i + 1] = row
    cu_q_lens[len(chunks) + 1 :] = row
    metadata = AttentionMetadata(
        slot_mapping=jnp.asarray(slot_mapping),
        kv_lens=jnp.asarray(kv_lens),
        block_tables=jnp.asarray(block_tables),
        cu_q_lens=jnp.asarray(cu_q_lens),
        num_seqs=jnp.array([len(chunks)], jnp.int32),
    )
    return jnp.asarray(token_ids), jnp.asarray(positions), metadata, jnp.arange(row, dtype=jnp.int32)


def prompt(config: ModelConfig, length: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, config.vocab_size, size=length).tolist()


def float32_loader(checkpoint: Callable[[str], Path]) -> Callable[[str], tuple[Path, ModelConfig, Any]]:
    """`name -> (folder, config, float32 params)` over a checkpoint fixture, each loaded once."""
    cache: dict[str, tuple[Path, ModelConfig, Any]] = {}

    def get(name: str) -> tuple[Path, ModelConfig, Any]:
        if name not in cache:
            folder = checkpoint(name)
            cache[name] = (folder, *load_model(folder, jnp.float32))
        return cache[name]

    return get


# The projection layouts the oracle tests run every architecture in (`sarathi_jax.models.out_major`).
LAYOUTS = (IN_MAJOR, OUT_MAJOR, PANELS)


def model_in_layout(config: ModelConfig, params: Any, layout: str) -> tuple[Any, Any]:
    """The float32 model and its params, with the projection weights in-major (the checkpoint's layout), moved
    out-major, or packed into panels (what CPU runners use: `sarathi_jax.models.out_major`)."""
    model = get_model(config, jnp.float32)
    return (model, params) if layout == IN_MAJOR else to_out_major(model, params, panels=layout == PANELS)
