"""Engine configuration: one frozen dataclass, passed explicitly."""

from __future__ import annotations

import math
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from sarathi_jax.config.disaggregation import DisaggregationSplit
from sarathi_jax.models.config import QUANTIZATIONS, check_quantization
from sarathi_jax.models.presets import PRESETS
from sarathi_jax.utils.paths import absolute_path
from sarathi_jax.scheduler.config import check_prefill_share, check_scheduling_policy
from sarathi_jax.scheduler.base import SCHEDULING_POLICIES
from sarathi_jax.scheduler.registry import SCHEDULER_POLICIES, TOKEN_BUDGET_POLICIES, WHOLE_PROMPT_POLICIES
from sarathi_jax.spec_decode.speculative import SpeculativeConfig

DTYPES = ("auto", "float32", "bfloat16")
ATTENTION_BACKENDS = ("auto", "xla", "pallas", "cpu")
GPU_PLATFORMS = ("gpu", "cuda", "rocm")
ACCELERATOR_PLATFORMS = GPU_PLATFORMS + ("tpu",)
DEFAULT_KV_CACHE_BYTES = 1 << 30  # the fixed KV budget on devices that do not report their memory (CPU)
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default; lowered to what JAX's allocator may hand out
DEFAULT_TOKEN_BUDGET = 512
DEFAULT_MAX_NUM_SEQS = 128  # the most; lowered to the batch token limit when that is smaller
TOKEN_BUDGET_MODES = ("auto", "dynamic")  # token budgets from the TBT target slo_tbt_s (scheduler/budget.py)
DEFAULT_MAX_TOKEN_BUDGET = 2048  # "auto"'s largest candidate and "dynamic"'s compiled maximum
BUCKET_LADDERS = ("coarse", "fine")  # the token buckets compiled below the largest (sarathi_jax/config/sizing.py)


def token_budget_arg(text: str) -> int | str:
    """A command line's token budget: an integer, "auto" or "dynamic"."""
    return text if text in TOKEN_BUDGET_MODES else int(text)


def resolve_attention_backend(name: str, platform: str, *, cpu_kernel_status: str | None) -> str:
    """The backend `name` means on `platform` (`jax.default_backend()`): "auto" is the Pallas kernel on a
    GPU, where the jnp path is 10-370x off the hardware floor; on a CPU the C++ kernel ("cpu": decode steps
    5-17x faster than the jnp path on a 2-core CPU) when it was built, else "xla"; "xla" elsewhere (on TPU the
    Pallas kernel has no compiled path). `cpu_kernel_status` is `pallas_kernels.cpu_kernel_status()`: None when
    the C++ kernel is available, else why not (the caller asks, so that this module needs no JAX).

    Raises:
      ValueError: an unknown name, or "cpu" on another platform or where the kernel is not built.
    """
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    if name == "auto":
        if platform in GPU_PLATFORMS:
            return "pallas"
        return "cpu" if platform == "cpu" and cpu_kernel_status is None else "xla"
    if name == "cpu":
        if platform != "cpu":
            raise ValueError(f"attention_backend 'cpu' is the CPU kernel; this engine runs on {platform!r}")
        if cpu_kernel_status is not None:
            raise ValueError(f"attention_backend 'cpu' is not available: {cpu_kernel_status}")
    return name


def resolve_dtype(name: str, platform: str) -> str:
    """The dtype `name` means on `platform`: "auto" is bfloat16 on GPUs and TPUs (their matmul units' native
    type; float32 there is emulated or TF32 unless forced) and float32 elsewhere (a CPU has no bfloat16
    matmul units and runs it slower than float32)."""
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {name!r}")
    if name == "auto":
        return "bfloat16" if platform in ACCELERATOR_PLATFORMS else "float32"
    return name


def resolve_scan_layers(scan_layers: bool | None, platform: str) -> bool:
    """Whether the decoder layers run as one `nn.scan` (None: decide by platform). Scanned layers compile
    once whatever the depth, but on GPUs and CPUs each layer's weights are then sliced out of the stacked
    arrays by a copy every step (XLA fuses the loop's dynamic slice into neither backend's matmuls): llama-1b
    decode x32 on an H100 took 5.8 ms per step scanned against 4.0 ms unrolled; on a 2-core CPU, decode steps
    of SmolLM2 and a 60M Llama took 0.62-0.94x the time unrolled. Unrolled start-up
    is about twice as long (SmolLM2 on that CPU: ready in 10.5 s cold, 8.2 s warm, against 6.9 and 4.1 s),
    paid once per process and mostly cached. So: unrolled on GPUs and CPUs; scanned on TPUs, as MaxText runs
    them there (not measured here)."""
    if scan_layers is None:
        return platform == "tpu"
    return scan_layers


@dataclass(frozen=True)
class EngineConfig:
    """Everything `LLMEngine` needs to start.

    model: a preset name (see `sarathi_jax.models.PRESETS`) or an HF checkpoint folder; a folder is made
        absolute here (relative to the current directory), so the config means the same from anywhere.
    token_budget: most tokens (decodes + prefill chunks) in one iteration under the policies that batch by
        it (sarathi, simple_chunking, chunked_prefills_only; hybrid_batching_only, except an over-budget
        prompt that runs alone). It is the largest compiled bucket only under the chunking policies: the
        others put whole prompts into a batch, so their largest bucket is max(token_budget,
        max_num_batched_tokens or max_model_len) (sarathi_jax/config/sizing.py).
        None: 512, or max_num_seqs rounded up to a multiple of 16 when that is larger.
        "auto" (needs slo_tbt_s): the largest multiple of 16 up to max_token_budget whose worst-case iteration a
        cost model calibrated on this device predicts within slo_margin (0.9) x slo_tbt_s; "dynamic" (sarathi only, needs
        slo_tbt_s): max_token_budget is compiled, and each iteration's budget is the largest whose predicted
        time stays within slo_margin x the tightest slo_tbt_s among the running requests (sarathi_jax/scheduler/budget.py,
        sarathi_jax/engine/token_budget.py). The engine's `config` holds the resolved integer (for "dynamic": the
        compiled maximum).
    max_num_seqs: most sequences in one iteration. None: min(128, the batch token limit: token_budget, or
        an explicit max_num_batched_tokens under the whole-prompt policies). Explicit values that contradict
        each other are refused.
    block_size: tokens per KV-cache block.
    dtype: weights, activations and KV cache: `auto` (bfloat16 on GPU and TPU, float32 elsewhere; see
        `resolve_dtype`), `float32` or `bfloat16`.
    num_blocks: KV blocks outright; when None, as many as fit in the KV byte budget (below).
    kv_cache_bytes: a fixed KV byte budget. None: sized from device memory where the device reports it
        (GPU, TPU; see `gpu_memory_utilization`), else 1 GiB (CPU).
    gpu_memory_utilization: vLLM's meaning: the fraction of the device's total memory the engine may use;
        the KV cache gets what is left of it after the weights and an estimate of a step's activations
        (sarathi_jax/config/sizing.py). None: 0.9, lowered to JAX's allocator limit (XLA_CLIENT_MEM_FRACTION, 0.75
        unless set). At most one of num_blocks, kv_cache_bytes and gpu_memory_utilization may be given.
    max_model_len: longest prompt + output; None means the model's own limit (capped by the cache size).
    scheduler: policy name (`sarathi`, `vllm`, `orca`, ...).
    attention_backend: `auto` (`pallas` on GPU, `cpu` on a CPU where the C++ kernel is built, `xla` elsewhere;
        see `resolve_attention_backend`), `xla` (portable jnp), `pallas` or `cpu`.
    tile_size: sarathi only: round each batch's tokens down to a multiple of this.
    max_num_batched_tokens: whole-prompt policies (vllm, orca, ...): most tokens per batch.
    watermark: fraction of KV blocks kept free when admitting new requests.
    seed: seeds preset weights and the per-request seeds of unseeded sampled requests.
    tensor_parallel_size: devices per pipeline stage; heads, KV heads and MLP columns are split over them.
    pipeline_parallel_size: contiguous layer stages, each on its own sub-mesh, with up to this many
        micro-batches in flight (see docs/parallelism.md).
    async_scheduling: overlap the host with the device: batch N+1 is scheduled and dispatched before batch
        N's sampled tokens are fetched, and decodes read their input token on the device (see
        sarathi_jax/core/engine_core.py). False: the synchronous loop (dispatch, wait, postprocess), for comparison.
    scan_layers: run the decoder layers as one `nn.scan` over the stacked layer weights (compile time
        independent of depth) or unrolled (faster steps on GPU and CPU); None: unrolled on GPU and CPU,
        scanned on TPU (see `resolve_scan_layers`). Weights are stored and loaded stacked either way.
    enable_prefix_caching: reuse the KV blocks of prompt prefixes already computed (automatic prefix
        caching, as vLLM V1: on by default); see sarathi_jax/scheduler/block_manager.py.
    compilation_cache_dir: JAX's persistent compilation cache. "auto": $SARATHI_JAX_COMPILATION_CACHE (a
        directory, or "0"/"off"/"" for none), else ~/.cache/sarathi-jax/jax ($XDG_CACHE_HOME honoured); a
        path; None or "off": no cache. Process-wide; see sarathi_jax/runner/compile_cache.py.
    scheduling_policy: the order requests are served in: `fcfs` (arrival), `priority` (vLLM's: a lower
        request priority first, then arrival; running decodes still come first under sarathi; a request that
        has waited priority_max_wait_s since its arrival is served as the most urgent priority: aging) or
        `deadline` (earliest TTFT deadline, arrival + slo_ttft_s, first; a request that has missed its TTFT is
        relegated behind those that can still meet theirs). See sarathi_jax/scheduler/base.py.
    priority_max_wait_s: the aging bound of the priority policy, in seconds; None: no aging.
    max_prefill_share: chunking policies (sarathi, ...): while other requests wait or prefill, one request's
        prefill chunk takes at most this fraction of the iteration's token budget, in (0, 1], so one long prompt
        does not hold the prefill share for many iterations while short ones queue. None: no cap.
    slo_tbt_s: the TBT target (seconds) of token_budget "auto" and "dynamic"; under "dynamic" also the target of
        requests that carry no slo_tbt_s of their own.
    slo_margin: "auto" and "dynamic" keep the predicted iteration time within slo_margin x slo_tbt_s, in (0, 1]:
        the room left for what the cost model misses (its fit's error, the host's time per iteration, noise).
    max_token_budget: "auto"'s largest candidate and "dynamic"'s compiled maximum (a multiple of 16);
        None: 2048.
    bucket_ladder: the token buckets compiled below the largest (sarathi_jax/config/sizing.py, `platform_buckets`):
        "coarse" (powers of two; on a CPU also 1.5x each from 24 up) or "fine" (every multiple of 16 up to 128,
        then steps of at most 1.25x: a budget picked per iteration runs close to its own size, at the price of
        more executables to compile). None: "fine" under token_budget="dynamic", "coarse" otherwise.
    cost_profile: a saved cost model (`BucketCostModel` JSON, e.g. from `python -m sarathi_jax.bench.step_cost
        --mode calibrate --cost-model-out PATH`) for "auto" and "dynamic"; None: calibrated at start-up with a
        few timed steps through the model runner, and cached beside the compilation cache.
    background_compile: the engine is ready once the largest bucket's step and the general sampler are built;
        the other buckets and sampler variants are then built on background threads while it serves (until
        one is built, a batch runs padded to a larger bucket, with the same tokens). False: everything is
        built before the engine is ready. Either way serving never compiles; see
        `ModelRunner.warmup` and `LLMEngine.wait_until_compiled`.
    speculative_config: speculative decoding, vLLM's dict (JSON on a command line): {"method": "ngram",
        "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 4} (prompt lookup in the
        request's own tokens), or {"method": "self", "num_layers": L, "num_speculative_tokens": k} (the model's
        first L layers as the draft), or {"model": PRESET_OR_FOLDER, "num_speculative_tokens": k} (a draft
        model with the same vocabulary). Unconstrained requests only. The overlapped loop retires first after a
        step that verified drafts; a draft model's requests keep the loop synchronous.
        With tensor parallelism (a draft model on the model's devices, sharded alike); not with pipeline
        parallelism or tile_size. See docs/design/speculative-decoding.md.
    disaggregation: "P:D" splits prefill from decode (DistServe, Splitwise): P devices run prompts and sample
        each request's first token, then its KV cache moves to the D decode devices (a side may be
        DEVICES/TP: instances of TP devices; sarathi_jax/config/disaggregation.py). None: colocated. Runs on
        `DisaggregatedEngine` (one process; `LLM` and the server build it; partial,
        docs/design/disaggregation.md) and in the simulator (`python -m sarathi_jax.bench --simulate
        --disaggregation P:D`); LLMEngine refuses it.
    quantization: the decoder layers' projection weights stored 8-bit with a float32 scale per output channel,
        activations in `dtype` (W8A16; sarathi_jax/models/quantization.py): None (the model dtype), "int8"
        (every device) or "fp8" (float8_e4m3fn, GPUs with FP8 matmul: compute capability 8.9+). Float weights
        are quantized as they load; a folder converted with `checkpoints_convert --quantization int8` holds them
        quantized and serves its own quantization when None is given. A separate draft model is quantized alike.
    """

    model: str = "tiny-llama"
    dtype: str = field(default="auto", metadata={"choices": DTYPES})  # metadata: the command line's choices
    # resolved in __post_init__ (an int, or "auto"/"dynamic", which the engine resolves to an int)
    token_budget: int | str | None = field(default=None, metadata={"cli": {"type": token_budget_arg}})
    max_num_seqs: int | None = None  # resolved in __post_init__: an int afterwards
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    max_model_len: int | None = None
    scheduler: str = field(default="sarathi", metadata={"choices": SCHEDULER_POLICIES})
    attention_backend: str = field(default="auto", metadata={"choices": ATTENTION_BACKENDS})
    tile_size: int | None = None
    max_num_batched_tokens: int | None = None
    watermark: float = 0.01
    seed: int = 0
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    async_scheduling: bool = True
    scan_layers: bool | None = None
    enable_prefix_caching: bool = True
    compilation_cache_dir: str | None = "auto"
    background_compile: bool = True
    scheduling_policy: str = field(default="fcfs", metadata={"choices": SCHEDULING_POLICIES})
    priority_max_wait_s: float | None = 60.0
    max_prefill_share: float | None = None
    slo_tbt_s: float | None = None
    slo_margin: float = 0.9
    max_token_budget: int | None = None
    bucket_ladder: str | None = field(default=None, metadata={"choices": BUCKET_LADDERS})
    cost_profile: str | None = None
    speculative_config: SpeculativeConfig | Mapping[str, object] | None = field(
        default=None, metadata={"cli": {"type": json.loads, "metavar": "JSON"}})  # parsed in __post_init__
    disaggregation: str | None = None
    quantization: str | None = field(default=None, metadata={"choices": QUANTIZATIONS})

    def __post_init__(self) -> None:
        if not isinstance(self.model, (str, os.PathLike)) or not os.fspath(self.model):
            raise ValueError(f"model must be a preset name or a checkpoint folder, got {self.model!r}")
        if self.model not in PRESETS:
            object.__setattr__(self, "model", absolute_path(self.model))
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        check_quantization(self.quantization)
        self._check_budget_mode()
        self._resolve_batch_limits()
        for name in ("max_num_seqs", "block_size", "tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("async_scheduling", "enable_prefix_caching", "background_compile"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if isinstance(self.token_budget, int) and self.token_budget % 16:
            raise ValueError(f"token_budget must be a multiple of 16 (a matmul tile of rows), got {self.token_budget}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes must be positive, got {self.kv_cache_bytes}")
        if self.gpu_memory_utilization is not None and not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        kv_sizes = [n for n in ("num_blocks", "kv_cache_bytes", "gpu_memory_utilization") if getattr(self, n) is not None]
        if len(kv_sizes) > 1:
            raise ValueError(f"{' and '.join(kv_sizes)} each size the KV cache: give one of them")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if self.compilation_cache_dir is not None and not isinstance(self.compilation_cache_dir, str):
            raise ValueError(f"compilation_cache_dir must be a path, 'auto', 'off' or None, "
                             f"got {self.compilation_cache_dir!r}")
        check_scheduling_policy(self.scheduling_policy, self.priority_max_wait_s)
        check_prefill_share(self.max_prefill_share)
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        spec = self.speculative_config
        if spec is not None and self.pipeline_parallel_size > 1 and spec.method != "ngram":
            raise ValueError(f"speculative_config method {spec.method!r} (a draft model) is not supported with "
                             "pipeline_parallel_size > 1: the draft runs its k steps on one stage's devices (a "
                             "'self' draft's first layers and its LM head lie on different stages) while the host "
                             "waits for its proposals before each dispatch, which would stall the pipeline; use "
                             "tensor_parallel_size instead")
        if spec is not None and (self.pipeline_parallel_size > 1 or self.tile_size):
            raise ValueError("speculative_config is not supported yet with pipeline_parallel_size > 1 (not "
                             "verified there) or with tile_size (draft tokens would unalign the batch)")
        self._check_batch_limits()
        if self.disaggregation is not None:
            DisaggregationSplit.parse(self.disaggregation)  # ValueError naming the bad part
            if self.tensor_parallel_size > 1 or self.pipeline_parallel_size > 1 or self.speculative_config:
                raise ValueError(f"disaggregation={self.disaggregation!r} sets each side's devices and tensor "
                                 "parallelism itself: not with tensor_parallel_size, pipeline_parallel_size or "
                                 "speculative_config")

    def _check_budget_mode(self) -> None:
        """token_budget's kind, slo_tbt_s, max_token_budget and cost_profile; "auto" and "dynamic" need a TBT
        target."""
        budget = self.token_budget
        if budget is not None and budget not in TOKEN_BUDGET_MODES and (
                not isinstance(budget, int) or isinstance(budget, bool) or budget < 1):
            raise ValueError(f"token_budget must be a positive integer, 'auto' or 'dynamic', got {budget!r}")
        slo = self.slo_tbt_s
        if slo is not None and (not isinstance(slo, (int, float)) or isinstance(slo, bool) or not math.isfinite(slo)
                                or slo <= 0):
            raise ValueError(f"slo_tbt_s must be a finite number of seconds > 0, got {slo!r}")
        margin = self.slo_margin
        if not isinstance(margin, (int, float)) or isinstance(margin, bool) or not 0 < margin <= 1:
            raise ValueError(f"slo_margin must be in (0, 1], got {margin!r}")
        top = self.max_token_budget
        if top is not None and (not isinstance(top, int) or isinstance(top, bool) or top < 16 or top % 16):
            raise ValueError(f"max_token_budget must be a positive multiple of 16, got {top!r}")
        if self.token_budget in TOKEN_BUDGET_MODES:
            if slo is None:
                raise ValueError(f"token_budget={self.token_budget!r} needs slo_tbt_s, the TBT target (seconds) "
                                 "it picks the budget for")
            if self.scheduler not in TOKEN_BUDGET_POLICIES:
                raise ValueError(f"token_budget={self.token_budget!r} needs a policy that batches by a token budget "
                                 f"({', '.join(TOKEN_BUDGET_POLICIES)}), got {self.scheduler!r}")
            if self.token_budget == "dynamic" and self.scheduler != "sarathi":
                raise ValueError(f"token_budget='dynamic' is the sarathi policy's (decodes first), got "
                                 f"{self.scheduler!r}")
        if self.bucket_ladder is not None and self.bucket_ladder not in BUCKET_LADDERS:
            raise ValueError(f"bucket_ladder must be one of {BUCKET_LADDERS} or None, got {self.bucket_ladder!r}")
        if self.cost_profile is not None and not isinstance(self.cost_profile, (str, os.PathLike)):
            raise ValueError(f"cost_profile must be a path, got {self.cost_profile!r}")

    @property
    def budget_ceiling(self) -> int:
        """The largest token budget this configuration may run: token_budget, or under "auto"/"dynamic"
        max_token_budget (its default when None)."""
        if isinstance(self.token_budget, int):
            return self.token_budget
        return self.max_token_budget or DEFAULT_MAX_TOKEN_BUDGET

    def _resolve_batch_limits(self) -> None:
        """Fill token_budget and max_num_seqs when not given, so that a default never contradicts an explicit
        value (the frozen dataclass holds the resolved ints; `dataclasses.replace` then passes them on as
        explicit, so pass None there to re-derive one)."""
        if self.token_budget is None:
            budget = DEFAULT_TOKEN_BUDGET
            if isinstance(self.max_num_seqs, int) and self.max_num_seqs > budget:
                budget = -(-self.max_num_seqs // 16) * 16  # every running sequence needs a decode slot
            object.__setattr__(self, "token_budget", budget)
        if self.max_num_seqs is None and (isinstance(self.token_budget, int) or self.token_budget in TOKEN_BUDGET_MODES):
            object.__setattr__(self, "max_num_seqs", min(DEFAULT_MAX_NUM_SEQS, self._batch_token_limit()))

    def _batch_token_limit(self) -> int:
        """A lower bound on the scheduler's per-batch token limit, known before max_model_len is."""
        if self.scheduler in WHOLE_PROMPT_POLICIES and isinstance(self.max_num_batched_tokens, int):
            return self.max_num_batched_tokens
        return self.budget_ceiling

    def _check_batch_limits(self) -> None:
        # The scheduler refuses the same (SchedulerConfig); saying so here fails before any weights load.
        if self.scheduler in TOKEN_BUDGET_POLICIES:
            limit_name, limit = "token_budget", self.budget_ceiling
        elif self.scheduler in WHOLE_PROMPT_POLICIES and isinstance(self.max_num_batched_tokens, int):
            limit_name, limit = "max_num_batched_tokens", self.max_num_batched_tokens
        else:
            return  # unknown policy (refused later) or a limit that depends on max_model_len
        if limit < self.max_num_seqs:
            raise ValueError(
                f"{limit_name} ({limit}) must be >= max_num_seqs ({self.max_num_seqs}) under policy "
                f"{self.scheduler!r}: each running sequence needs a decode token per batch"
            )
