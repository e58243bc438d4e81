"""Engine configuration: one frozen dataclass, passed explicitly."""

from __future__ import annotations

from dataclasses import dataclass

DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class EngineConfig:
    """Everything `LLMEngine` needs to start.

    model: a preset name (see `sarathi_jax.models.PRESETS`) or an HF checkpoint folder.
    token_budget: most tokens (decodes + prefill chunks) in one iteration; also the largest compiled bucket.
    max_num_seqs: most sequences in one iteration.
    block_size: tokens per KV-cache block.
    num_blocks: KV blocks outright; when None, as many as fit in `kv_cache_bytes`.
    max_model_len: longest prompt + output; None means the model's own limit (capped by the cache size).
    scheduler: policy name (`sarathi`, `vllm`, `orca`, ...).
    attention_backend: `xla` or `pallas`.
    tile_size: sarathi only: round each batch's tokens down to a multiple of this.
    max_num_batched_tokens: whole-prompt policies (vllm, orca, ...): most tokens per batch.
    watermark: fraction of KV blocks kept free when admitting new requests.
    seed: seeds preset weights and the per-request seeds of unseeded sampled requests.
    tensor_parallel_size: devices per pipeline stage; heads, KV heads and MLP columns are split over them.
    pipeline_parallel_size: contiguous layer stages, each on its own sub-mesh, with up to this many
        micro-batches in flight (see docs/parallelism.md).
    async_scheduling: overlap the host with the device: batch N+1 is scheduled and dispatched before batch
        N's sampled tokens are fetched, and decodes read their input token on the device (see
        sarathi_jax/engine_core.py). False: the synchronous loop (dispatch, wait, postprocess), for comparison.
    """

    model: str = "tiny-llama"
    dtype: str = "float32"
    token_budget: int = 512
    max_num_seqs: int = 128
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_bytes: int = 1 << 30
    max_model_len: int | None = None
    scheduler: str = "sarathi"
    attention_backend: str = "xla"
    tile_size: int | None = None
    max_num_batched_tokens: int | None = None
    watermark: float = 0.01
    seed: int = 0
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    async_scheduling: bool = True

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        for name in ("token_budget", "max_num_seqs", "block_size", "tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be a bool, got {self.async_scheduling!r}")
        if self.token_budget % 16:
            raise ValueError(f"token_budget must be a multiple of 16 (the smallest bucket), got {self.token_budget}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
