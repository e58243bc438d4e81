"""The work of one model-runner iteration and this machine's floors for it: FLOPs, minimal bytes, rates.

A batch is a list of `Chunk`s (`sarathi_jax.sim.cost_model.Chunk`: each sequence's new tokens after its cached
ones); `work(shape, chunks)` counts, for a model of `ModelShape`:

* FLOPs = 2 x (per-layer matmul parameters) x tokens + 2 x (LM head parameters) x sampled rows
          + attention (4 x layers x query heads x head_dim x visible (query, key) pairs).
  This is the paper's "2 x params x tokens" counted for what the runner really multiplies: the embedding is a
  lookup (no FLOPs) and logits are computed only for the rows that sample.
* minimal bytes = every weight read once + the embedding rows gathered + the KV cache read (the context
  before this step's tokens) + the new tokens' K/V written.

Machine rates (`measure_rates`, with the probes of `pallas_kernels.machine_rates`): a large jitted matmul in
the model's dtype (FLOP/s) and a large array reduction and copy (bytes/s, the faster of the two), each the best
of `repeats` runs (on a shared machine the best run is the least disturbed one, so the floors stay lower
bounds). `floors(work, rates)`: FLOPs / matmul
rate and bytes / bandwidth. Used by `bench.step_cost`, `benchmarks.probes.loop_cost` and `benchmarks.real_model`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sarathi_jax.sim.cost_model import Chunk, attention_pairs
from sarathi_jax.config.sizing import DTYPE_BYTES


def decode_chunks(batch_size: int, context: int) -> list[Chunk]:
    return [Chunk(context, 1) for _ in range(batch_size)]


@dataclass(frozen=True)
class ModelShape:
    """What the FLOP and byte counts need to know about a model."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    gated_mlp: bool = True  # SwiGLU (3 matrices) vs a plain 2-matrix MLP
    tied_embeddings: bool = False
    itemsize: int = 4
    # Bytes per layer matmul weight: `itemsize`, or 1 for 8-bit (quantized) weights, whose per-channel scales
    # are left out as the norms' are not (a few KB).
    layer_itemsize: int | None = None

    @classmethod
    def from_model_config(cls, mc: Any, dtype: str = "float32") -> "ModelShape":
        return cls(
            hidden_size=mc.hidden_size,
            intermediate_size=mc.intermediate_size,
            num_layers=mc.num_hidden_layers,
            num_heads=mc.num_attention_heads,
            num_kv_heads=mc.num_key_value_heads,
            head_dim=mc.head_dim,
            vocab_size=mc.vocab_size,
            gated_mlp=getattr(mc, "hidden_act", "silu") == "silu",
            tied_embeddings=bool(mc.tie_word_embeddings),
            itemsize=DTYPE_BYTES[dtype],
            layer_itemsize=1 if getattr(mc, "quantization", None) else None,
        )

    @property
    def layer_matmul_params(self) -> int:
        """Matmul weights every token goes through, all layers (q, k, v, o, MLP; norms and biases left out)."""
        h, qd, kvd = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = h * qd + 2 * h * kvd + qd * h
        mlp = (3 if self.gated_mlp else 2) * h * self.intermediate_size
        return self.num_layers * (attn + mlp)

    @property
    def head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def weight_bytes(self) -> int:
        """Every weight read once: layers, LM head, the norms (the embedding table too when it is untied it is
        only gathered, see `work`)."""
        norms = (2 * self.num_layers + 1) * self.hidden_size
        layer_itemsize = self.itemsize if self.layer_itemsize is None else self.layer_itemsize
        return self.layer_matmul_params * layer_itemsize + (self.head_params + norms) * self.itemsize

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.itemsize


@dataclass(frozen=True)
class Work:
    flops: float
    linear_flops: float
    head_flops: float
    attention_flops: float
    bytes: float
    weight_bytes: float
    kv_read_bytes: float
    kv_write_bytes: float
    num_tokens: int
    num_sampled: int
    attention_pairs: int  # visible (query, key) pairs, summed over sequences (one layer, one head)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def work(shape: ModelShape, chunks: Sequence[Chunk]) -> Work:
    """FLOPs and minimal bytes of one iteration over `chunks` (see the module docstring)."""
    tokens = sum(c.num_new_tokens for c in chunks)
    sampled = sum(1 for c in chunks if c.sample)
    pairs = attention_pairs(chunks)
    linear = 2.0 * shape.layer_matmul_params * tokens
    head = 2.0 * shape.head_params * sampled
    attn = 4.0 * shape.num_layers * shape.num_heads * shape.head_dim * pairs
    embed_bytes = 0 if shape.tied_embeddings else tokens * shape.hidden_size * shape.itemsize
    w_bytes = shape.weight_bytes + embed_bytes
    kv_read = sum(c.start for c in chunks) * shape.kv_bytes_per_token
    kv_write = tokens * shape.kv_bytes_per_token
    return Work(
        flops=linear + head + attn, linear_flops=linear, head_flops=head, attention_flops=attn,
        bytes=float(w_bytes + kv_read + kv_write), weight_bytes=float(w_bytes), kv_read_bytes=float(kv_read),
        kv_write_bytes=float(kv_write), num_tokens=tokens, num_sampled=sampled, attention_pairs=pairs,
    )


@dataclass(frozen=True)
class Rates:
    matmul_flops: float  # FLOP/s
    bandwidth: float  # bytes/s
    details: dict = field(default_factory=dict)


def floors(w: Work, rates: Rates) -> tuple[float, float]:
    """(compute floor, memory floor) in seconds."""
    return w.flops / rates.matmul_flops, w.bytes / rates.bandwidth


# ----------------------------------------------------------------------------------------------- machine rates


def measure_rates(dtype: str, matmul_n: int = 2048, bandwidth_mb: int = 256, repeats: int = 5,
                  matmul_rate: float | None = None, bandwidth: float | None = None) -> Rates:
    from pallas_kernels import machine_rates  # JAX loads only when something is measured

    details: dict = {}
    if matmul_rate is None:
        matmul_rate = machine_rates.matmul_rate(matmul_n, dtype, repeats)
        details["matmul"] = {"n": matmul_n, "dtype": dtype, "flops_per_s": matmul_rate}
        if dtype != "bfloat16":
            details["matmul_bf16_flops_per_s"] = machine_rates.matmul_rate(matmul_n, "bfloat16", repeats)
    else:
        details["matmul"] = {"given": True, "flops_per_s": matmul_rate}
    if bandwidth is None:
        bw = machine_rates.memory_bandwidth(bandwidth_mb, repeats)
        bandwidth = bw.best
        details["bandwidth"] = dataclasses.asdict(bw)
    else:
        details["bandwidth"] = {"given": True, "bytes_per_s": bandwidth}
    return Rates(float(matmul_rate), float(bandwidth), details)


def best_rates(a: Rates, b: Rates) -> Rates:
    """The better of two measurements of each rate (e.g. before and after the timed rounds)."""
    return Rates(max(a.matmul_flops, b.matmul_flops), max(a.bandwidth, b.bandwidth),
                 {"before": a.details, "after": b.details,
                  "rule": "best of repeats, before and after the timed rounds"})


def measure_rates_and_log(log: Callable[[str], None], dtype: str, matmul_n: int, bandwidth_mb: int, repeats: int,
                          matmul_rate: float | None, bandwidth: float | None) -> Rates:
    """`measure_rates`, with the one line the step and loop benchmarks print for each measurement."""
    r = measure_rates(dtype, matmul_n, bandwidth_mb, repeats=repeats, matmul_rate=matmul_rate, bandwidth=bandwidth)
    log(f"matmul {r.matmul_flops / 1e9:.1f} GFLOP/s ({dtype}), bandwidth {r.bandwidth / 1e9:.2f} GB/s")
    return r


def num_params(params: Any) -> int:
    """Elements in a parameter tree (every leaf's size)."""
    import jax

    return int(sum(x.size for x in jax.tree_util.tree_leaves(params)))

