"""How an `EngineConfig` sizes an engine for a model: KV blocks, max_model_len, scheduler limits, buckets.

Plain Python (no JAX: `ModelConfig` is only a type here), so the real engine, the simulator and its cost
models size and pad batches by the same rules.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sarathi_jax.config.engine_config import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_KV_CACHE_BYTES,
    EngineConfig,
    resolve_dtype,
)
from sarathi_jax.scheduler import SchedulerConfig
from sarathi_jax.scheduler.registry import CHUNKING_POLICIES, WHOLE_PROMPT_POLICIES

if TYPE_CHECKING:  # importing sarathi_jax.models would bring in JAX and Flax
    from sarathi_jax.models.config import ModelConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}  # bytes per element of each concrete model dtype
SMALLEST_BUCKET = 16  # on accelerators: a matmul tile's rows (and the token budget's granularity everywhere)
# On a CPU a step's matmuls cost in proportion to its rows, so small decode batches get smaller buckets: one
# decode of the 60M Llama took 16.4 ms in a 4-token bucket against 22.2 ms in a 16-token one (step_cost). Not 1
# or 2: there XLA copied the whole KV cache every step (the attention call's read could not be ordered before
# the in-place write; test_no_step_copies_the_kv_cache guards every bucket).
CPU_SMALLEST_BUCKET = 4
# For the same reason a CPU gets a bucket halfway (x1.5) between each two powers of two from 24 tokens up: a
# lone prompt or a mixed step pays at most 1.5x its tokens in padding instead of 2x (a 300-token step runs in
# 384, not 512), and 24 decodes run in 24 rows, not 32 (a decode step of the 60M Llama at context 800: 68 ms
# against 72.6-73.9 in 32, step_cost). Below 24 the powers of two are
# close enough; accelerators keep the powers of two (tile shapes).
CPU_MID_BUCKETS_FROM = 24


# The fine ladder (EngineConfig.bucket_ladder="fine", the default under token_budget="dynamic"): a budget picked
# per iteration runs in the smallest bucket that holds it, so on powers of two a batch that fits 80 tokens
# beside its decodes would drop to 64 (docs/design/scheduler.md). Every multiple of FINE_STEP up to
# FINE_EVERY_STEP_UNTIL, then each bucket at most FINE_GROWTH x the one below (a multiple of FINE_STEP).
FINE_STEP = 16  # a matmul tile of rows: the token budget's granularity (scheduler/budget.py TILE)
FINE_EVERY_STEP_UNTIL = 128
FINE_GROWTH = 1.25
# The simulator pads like an accelerator engine (16-token tiles; powers of two for the coarse ladder): every
# simulated figure in docs/ was made so, also with the cost model calibrated on a CPU.
SIMULATOR_PLATFORM = "gpu"


def smallest_bucket(platform: str) -> int:
    """The smallest token bucket on `platform` (`jax.default_backend()`)."""
    return CPU_SMALLEST_BUCKET if platform == "cpu" else SMALLEST_BUCKET


def bucket_ladder(config: EngineConfig) -> str:
    """The ladder `config` compiles (`EngineConfig.bucket_ladder`; None: "fine" under token_budget="dynamic").
    Engines pin it in their config before "dynamic" resolves to an integer budget."""
    if config.bucket_ladder is not None:
        return config.bucket_ladder
    return "fine" if config.token_budget == "dynamic" else "coarse"


def platform_buckets(max_step_tokens: int, platform: str, ladder: str = "coarse") -> tuple[int, ...]:
    """The token buckets an engine on `platform` compiles for steps of up to `max_step_tokens` tokens, on
    `ladder` ("coarse": `token_buckets` with the platform's mid buckets; "fine": `fine_token_buckets`). The one
    rule for the real engine's warm-up and the simulator's padding."""
    smallest = smallest_bucket(platform)
    if ladder == "fine":
        return fine_token_buckets(max_step_tokens, smallest)
    if ladder != "coarse":
        raise ValueError(f"bucket ladder must be 'coarse' or 'fine', got {ladder!r}")
    return token_buckets(max_step_tokens, smallest, mid_from=CPU_MID_BUCKETS_FROM if platform == "cpu" else None)


def fine_token_buckets(max_step_tokens: int, smallest: int = SMALLEST_BUCKET) -> tuple[int, ...]:
    """The fine ladder: powers of two from `smallest` below FINE_STEP (a CPU's 4 and 8), every multiple of
    FINE_STEP up to FINE_EVERY_STEP_UNTIL, then steps of at most FINE_GROWTH x (multiples of FINE_STEP), then
    `max_step_tokens` rounded up to a multiple of `smallest` (at most FINE_GROWTH x the bucket below it, plus
    FINE_STEP)."""
    top = -(-max_step_tokens // smallest) * smallest
    buckets = []
    size = smallest
    while size < min(FINE_STEP, top):
        buckets.append(size)
        size *= 2
    size = max(size, FINE_STEP)
    while size < top:
        buckets.append(size)
        if size < FINE_EVERY_STEP_UNTIL:
            size += FINE_STEP
        elif size * FINE_GROWTH + FINE_STEP >= top:  # the top is close enough: no bucket just below it
            break
        else:
            size = max(size + FINE_STEP, int(size * FINE_GROWTH) // FINE_STEP * FINE_STEP)
    buckets.append(top)
    return tuple(buckets)


@dataclass(frozen=True)
class EngineSizing:
    num_blocks: int
    max_model_len: int
    scheduler_config: SchedulerConfig
    max_step_tokens: int  # the largest batch the scheduler can build: the top compiled bucket


def kv_bytes_per_block(model_config: ModelConfig, block_size: int, dtype: str) -> int:
    mc = model_config
    return 2 * mc.num_hidden_layers * block_size * mc.num_key_value_heads * mc.head_dim * DTYPE_BYTES[dtype]


def token_buckets(max_step_tokens: int, smallest: int = SMALLEST_BUCKET, mid_from: int | None = None) -> tuple[int, ...]:
    """The token counts a step is compiled for: powers of two from `smallest` (with `mid_from`, also 1.5x each
    power of two from `mid_from` up, where it lies at most 3/4 of the top), then `max_step_tokens` rounded up to
    a multiple of `smallest`."""
    top = -(-max_step_tokens // smallest) * smallest
    buckets = []
    size = smallest
    while size < top:
        buckets.append(size)
        mid = size * 3 // 2
        if mid_from is not None and mid >= mid_from and 4 * mid <= 3 * top and mid % smallest == 0:
            buckets.append(mid)
        size *= 2
    buckets.append(top)
    return tuple(buckets)


def bucket_for(buckets: Sequence[int], num_tokens: int) -> int | None:
    """The bucket a batch of `num_tokens` is padded to: the smallest of the ascending `buckets` that holds
    it; None past the largest."""
    for bucket in buckets:
        if num_tokens <= bucket:
            return bucket
    return None


# JAX's GPU allocator may hand out this fraction of the device's memory unless the environment says otherwise
# (https://docs.jax.dev/en/latest/gpu_memory_allocation.html; the second name is the older one).
JAX_MEM_FRACTION_ENV = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")
JAX_DEFAULT_MEM_FRACTION = 0.75
POOL_HEADROOM_FRACTION = 0.9  # of JAX's pool, at most, for weights, KV and activations by default
# Transient memory outside the per-token estimate: XLA's scratch (cuBLAS workspaces, sort buffers).
ACTIVATION_RESERVE_BYTES = 256 << 20
# Of the largest free block, what the KV cache may take: K and V are one allocation each, placed back to back
# in it, and small allocations (constants, the first step's scratch) may land there first.
LARGEST_BLOCK_FRACTION = 0.98


@dataclass(frozen=True)
class KVBudget:
    """The KV cache's byte budget and where it came from."""

    kv_cache_bytes: int
    gpu_memory_utilization: float | None  # the fraction used; None: a fixed budget
    activation_bytes: int = 0  # the activation estimate set aside (memory-fraction sizing only)
    # Bytes per device the fraction allowed, when the largest free block of device memory allowed less (the
    # weights' loading left the allocator's pool fragmented); None when it did not bind.
    unfragmented_bytes: int | None = None


def jax_mem_fraction(environ: Mapping[str, str] = os.environ) -> float:
    """The fraction of device memory JAX's allocator may use (its `bytes_limit`), from the environment."""
    for name in JAX_MEM_FRACTION_ENV:
        if environ.get(name):
            return float(environ[name])
    return JAX_DEFAULT_MEM_FRACTION


def activation_bytes_estimate(config: EngineConfig, model_config: ModelConfig) -> int:
    """An upper estimate of one step's transient device memory at the largest batch this config can build:
    one layer's intermediates per token in float32 (XLA reuses them from layer to layer; attention is tiled,
    so it adds nothing proportional to the context), the float32 logits of the sampled rows with the
    sampler's copies, doubled for XLA's buffer scheduling, plus a model draft's q (`draft_probs_bytes`) and a
    fixed reserve. Sized before the KV cache,
    so it bounds max_model_len by the model's limit."""
    mc = model_config
    if config.scheduler in CHUNKING_POLICIES:
        tokens = config.token_budget
    else:
        tokens = max(config.token_budget, config.max_num_batched_tokens or config.max_model_len or mc.max_model_len)
    qkv = (mc.num_attention_heads + 2 * mc.num_key_value_heads) * mc.head_dim
    per_token = 4 * (4 * mc.hidden_size + qkv + 3 * mc.intermediate_size)
    logits = 4 * 4 * config.max_num_seqs * mc.vocab_size
    return 2 * (tokens * per_token + logits) + draft_probs_bytes(config, mc) + ACTIVATION_RESERVE_BYTES


def draft_probs_bytes(config: EngineConfig, model_config: ModelConfig) -> int:
    """A model draft's q ("self" or a draft model): float32 [max_num_seqs, vocab] per draft step, kept on the
    device from `propose` to the verification step, and one of zeros for the steps not run
    (draft_runner.DraftRunner); n-gram lookup and no speculation keep none."""
    spec = config.speculative_config
    if spec is None or spec.method == "ngram":
        return 0
    return 4 * (spec.num_speculative_tokens + 1) * config.max_num_seqs * model_config.vocab_size


def kv_cache_shares(config: EngineConfig, model_config: ModelConfig) -> int:
    """Into how many distinct per-device shares a model's KV cache is split: a device holds 1/pp of the layers
    and 1/min(tp, kv heads) of the KV heads (KV heads fewer than the tensor-parallel devices are replicated:
    docs/parallelism.md). A memory budget counts the logical cache: per device x shares."""
    return config.pipeline_parallel_size * min(config.tensor_parallel_size, model_config.num_key_value_heads)


def kv_cache_budget(
    config: EngineConfig,
    model_config: ModelConfig,
    memory_stats: Sequence[Mapping[str, int] | None] = (),
    mem_fraction: float = JAX_DEFAULT_MEM_FRACTION,
) -> KVBudget | None:
    """The KV byte budget for `config` (None when `num_blocks` is given). `memory_stats`: each device's
    `jax.Device.memory_stats()` after the weights are placed (`bytes_limit`: what JAX's allocator may hand
    out, `mem_fraction` of the device's memory; `bytes_in_use`: weights and anything else live). When every
    device reports them and no fixed budget is given, the budget is, per device, gpu_memory_utilization x
    its memory - bytes in use - the activation estimate, but at most what the device's largest free block
    holds (`largest_free_block_bytes`, where reported), the tightest device deciding, times the number of
    distinct shares of the cache (layers split evenly over pipeline stages, KV heads over tensor-parallel
    devices). Otherwise (CPU) a fixed budget.

    Raises ValueError when an explicit gpu_memory_utilization cannot be honoured: no memory statistics,
    more than JAX's allocator may use, or nothing left for the KV cache."""
    if config.num_blocks is not None:
        return None
    if config.kv_cache_bytes is not None:
        return KVBudget(config.kv_cache_bytes, None)
    explicit = config.gpu_memory_utilization
    reported = bool(memory_stats) and all(s and s.get("bytes_limit") for s in memory_stats)
    if not reported:
        if explicit is not None:
            raise ValueError("gpu_memory_utilization: the devices do not report their memory (a CPU, or an "
                             "engine over several processes); size the KV cache with kv_cache_bytes or num_blocks")
        return KVBudget(DEFAULT_KV_CACHE_BYTES, None)
    if explicit is not None and explicit > mem_fraction + 1e-9:
        raise ValueError(
            f"gpu_memory_utilization={explicit:g} is more than JAX's allocator may use ({mem_fraction:g} of the "
            f"device's memory): start the process with XLA_CLIENT_MEM_FRACTION={explicit:g}, or ask for less"
        )
    # The default keeps a tenth of JAX's pool free for what the activation estimate does not see (XLA's
    # compile-time autotuning allocates from the same pool), as vLLM's 0.9 does.
    utilization = explicit if explicit is not None else min(DEFAULT_GPU_MEMORY_UTILIZATION,
                                                            POOL_HEADROOM_FRACTION * mem_fraction)
    activations = activation_bytes_estimate(config, model_config)
    by_fraction = min(
        int(utilization * s["bytes_limit"] / mem_fraction) - s.get("bytes_in_use", 0) - activations
        for s in memory_stats
    )
    # The stacked K and V caches are one allocation each: they need room in one free block, not only in all
    # the free memory together. Loading the weights (the checkpoint layout, then fused and unstacked copies)
    # can leave holes in JAX's pool: on an H100, mistral-7b's 13.5 GiB of weights left 45 GiB free but no
    # block over 32 GiB, and a 38 GiB cache failed to allocate.
    by_block = min((int(LARGEST_BLOCK_FRACTION * _largest_allocation(s)) - activations
                    for s in memory_stats if s.get("largest_free_block_bytes")), default=by_fraction)
    per_device = min(by_fraction, by_block)
    if per_device <= 0:
        raise ValueError(
            f"gpu_memory_utilization={utilization:g} leaves no memory for the KV cache after the weights and "
            f"{activations / 2**20:.0f} MiB of activations (or no free block of device memory holds it); raise "
            f"it, or use a smaller model or token budget"
        )
    return KVBudget(per_device * kv_cache_shares(config, model_config), utilization, activations,
                    unfragmented_bytes=by_fraction if by_block < by_fraction else None)


def _largest_allocation(stats: Mapping[str, int]) -> int:
    """The largest single allocation a device's allocator can still make: its largest free block, or the
    room its pool may still grow by (a new region is one block; under XLA_PYTHON_CLIENT_PREALLOCATE=false
    the pool starts small), whichever is larger."""
    growth = stats["bytes_limit"] - stats["pool_bytes"] if stats.get("pool_bytes") else 0
    return max(stats["largest_free_block_bytes"], growth)


def size_engine(
    config: EngineConfig, model_config: ModelConfig, kv_cache_bytes: int | None = None, platform: str = "cpu"
) -> EngineSizing:
    """`kv_cache_bytes`: the KV byte budget when `config.num_blocks` is None (the engine's `kv_cache_budget`);
    None: `config.kv_cache_bytes`, else the fixed CPU default. `platform` resolves `dtype="auto"`: the
    simulator and other device-less callers size a CPU engine. Raises ValueError when max_model_len exceeds
    what the model computes exactly."""
    budget = kv_cache_bytes or config.kv_cache_bytes or DEFAULT_KV_CACHE_BYTES
    dtype = resolve_dtype(config.dtype, platform)
    num_blocks = config.num_blocks or max(1, budget // kv_bytes_per_block(model_config, config.block_size, dtype))
    model_limit = model_config.max_model_len  # attention here is full: stay inside a sliding window
    if config.max_model_len is not None and config.max_model_len > model_limit:
        raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's limit of {model_limit} tokens")
    default_len = model_limit
    if config.scheduler in WHOLE_PROMPT_POLICIES and config.max_num_batched_tokens is not None:
        # These policies never split a prompt: a batch must hold the longest one. An explicit batch limit
        # bounds the default length rather than being refused by it.
        default_len = min(default_len, config.max_num_batched_tokens)
    max_model_len = min(config.max_model_len or default_len, num_blocks * config.block_size)
    scheduler_config = SchedulerConfig(
        policy=config.scheduler,
        token_budget=config.token_budget,
        max_num_seqs=config.max_num_seqs,
        max_model_len=max_model_len,
        max_num_batched_tokens=config.max_num_batched_tokens,
        tile_size=config.tile_size,
        watermark=config.watermark,
        scheduling_policy=config.scheduling_policy,
        priority_max_wait_s=config.priority_max_wait_s,
        max_prefill_share=config.max_prefill_share,
    )
    if config.scheduler in CHUNKING_POLICIES:
        max_step_tokens = config.token_budget
    else:
        max_step_tokens = max(config.token_budget, config.max_num_batched_tokens or max_model_len)
    return EngineSizing(num_blocks, max_model_len, scheduler_config, max_step_tokens)
