"""The real engine: a model's weights, KV cache sizing, scheduler, model runner and admission, built from an
`EngineConfig`, with its start-up report.

Requests never run code here: `add_request`, `add_admitted` and `step` are `engine_core.CoreFrontEnd`'s, the
one copy the simulator shares. `add_request` validates a request through `self.admission`
(sarathi_jax/core/admission.py, the one admission path, which servers call themselves); `step` runs one iteration
of `EngineCore` (sarathi_jax/core/engine_core.py), which asks the scheduler for a batch, dispatches it on the model
runner, and postprocesses sampled tokens (append, stop checks, finish, KV blocks freed). By default the loop
is overlapped (`EngineConfig.async_scheduling`): the host schedules and dispatches batch N+1 before fetching
batch N's tokens. The engine is driven by one thread; servers hand it work through a queue.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels import cpu_kernel_status, get_attention_fn
from sarathi_jax.engine import token_budget
from sarathi_jax.core.admission import Admission, KVCapacity
from sarathi_jax.scheduler.block_manager import BlockManager
from sarathi_jax.request.chat_template import ChatTemplate
from sarathi_jax.runner.compile_cache import PhaseTimer, enable_compilation_cache, record_compiles
from sarathi_jax.config.engine_config import (
    GPU_PLATFORMS,
    EngineConfig,
    resolve_attention_backend,
    resolve_dtype,
    resolve_scan_layers,
)
from sarathi_jax.core.engine_api import WallClock
from sarathi_jax.core.engine_core import CoreFrontEnd, EngineCore, LoopConfig
from sarathi_jax.runner.executable_cache import ExecutableCache
from sarathi_jax.runner.model_runner import ModelRunner
from sarathi_jax.models import load_model
from sarathi_jax.models.quantization import check_supported
from sarathi_jax.models.layers import unstack_layer_params
from sarathi_jax.scheduler import make_scheduler
from sarathi_jax.scheduler.speculation import Speculation
from sarathi_jax.config.sizing import (
    KVBudget, jax_mem_fraction, kv_bytes_per_block, kv_cache_budget, kv_cache_shares)
from sarathi_jax.request.tokenizer import Tokenizer, load_tokenizer


class LLMEngine(CoreFrontEnd):
    """The engine API (`engine_api.Engine`) over a model: weights, KV cache and compiled steps."""

    clock = WallClock()  # what metrics are stamped with: time.monotonic(), as `ModelRunner.now`

    def __init__(self, config: EngineConfig, *, warmup: bool = True, devices: Sequence[Any] | None = None) -> None:
        """Build the engine: load the weights, size the KV cache and the scheduler, compile and warm up.

        `devices`: the devices it runs on (default: the first tp x pp of `jax.devices()`); a disaggregated
        engine gives each of its instances its own (sarathi_jax/disagg/real_engine.py).

        `self.config` is `config` as resolved on this machine: the dtype and attention backend that "auto"
        chose, the compilation cache directory in use (None: none), and the KV sizing used (the
        gpu_memory_utilization, or the fixed kv_cache_bytes; neither when num_blocks was given).
        `startup_stats()` reports the parts' times.
        """
        if config.disaggregation is not None:  # one instance of it: sarathi_jax.disagg.real_engine builds them
            raise ValueError(f"disaggregation={config.disaggregation!r}: LLMEngine is colocated; build "
                             "`DisaggregatedEngine` (sarathi_jax/disagg/real_engine.py), or use `LLM` or the server")
        num_devices = config.tensor_parallel_size * config.pipeline_parallel_size
        self.devices = list(jax.devices()[:num_devices] if devices is None else devices)
        t_start = time.time()
        platform = jax.default_backend()
        requested = config
        self.config = config = _resolved_for(config, platform)
        with record_compiles() as compiles:
            timer = PhaseTimer(compiles)
            with timer.phase("load"):
                check_supported(config.quantization, self.devices)  # fp8 off FP8 GPUs: refused before loading
                params, draft, draft_plan = self._load(config)
                # A converted folder's quantization, when none was asked.
                config = dataclasses.replace(config, quantization=self.model_config.quantization)
            with timer.phase("init"):
                jax.block_until_ready((params, draft))  # the weights (the draft's too) count in memory in use
                kv = self._kv_sizing(config, platform, draft[0] if draft else None)
                plan = self._plan(kv.config, kv.kv_cache_bytes, platform)
                self.config, self.budget_setup = plan.config, plan.budget_setup
                self._build_parts(plan, params, draft, draft_plan)
            with timer.phase("warmup"):
                if warmup:
                    self.runner.warmup(background=self.config.background_compile)
                    if self.draft_runner is not None:
                        self.draft_runner.warmup()
                if self.budget_setup is None:  # "auto"/"dynamic" with no cost model at hand: calibrate now
                    self._calibrate_budget(dataclasses.replace(self.config, token_budget=requested.token_budget))
        self._serving_parts()
        self._startup_stats = self._startup_report(
            requested, kv, plan.sizing.num_blocks, timer, compiles, warmup=warmup, t_start=t_start,
            draft_params=draft[1] if draft else None)

    def _load(self, config: EngineConfig) -> tuple[Any, tuple[Any, Any] | None, Any]:
        """The weights (`self.model_config`, `self.parallel_plan`: None on one device), the tokenizer, and a
        separate draft model's ((config, params), plan), loaded before the KV cache is sized."""
        dtype = jnp.dtype(config.dtype)
        self.parallel_plan = None  # sarathi_jax.parallel.ParallelPlan when tensor/pipeline parallel
        # A mesh (of more than one device, or of one off device 0; or in a multi-process run, where a plain jit
        # would run on each process's own default device rather than on the engine's devices)
        num_devices = config.tensor_parallel_size * config.pipeline_parallel_size
        if num_devices > 1 or self.devices[0] != jax.devices()[0] or jax.process_count() > 1:
            from sarathi_jax.parallel import load_parallel_model  # ValueError on a split that cannot work

            self.parallel_plan, self.model_config, params = load_parallel_model(
                config.model, dtype, config.seed, config.tensor_parallel_size,
                config.pipeline_parallel_size, devices=self.devices, quantization=config.quantization,
            )
        else:
            self.model_config, params = load_model(config.model, dtype, seed=config.seed,
                                                   quantization=config.quantization)
            if not config.scan_layers:  # unrolled: per-layer arrays now, so the stacked copy is gone before
                params = unstack_layer_params(params)  # the KV cache is sized from the free memory
        self.tokenizer: Tokenizer | None = load_tokenizer(config.model) if Path(config.model).is_dir() else None
        spec = config.speculative_config
        if spec is None or spec.model is None:
            return params, None, None
        draft, draft_plan = _load_draft(spec.model, dtype, dataclasses.replace(
            config, quantization=self.model_config.quantization), self.parallel_plan, self.devices)
        return params, draft, draft_plan

    def _kv_sizing(self, config: EngineConfig, platform: str, draft_config: Any) -> _KVSizing:
        """The KV cache's byte budget on these devices (`sizing.kv_cache_budget`), recorded in the config, and
        the target model's share of it when a draft model's cache has a block for each of the target's."""
        kv_budget = self._kv_budget(config, platform)
        if kv_budget is not None:
            config = dataclasses.replace(
                config, kv_cache_bytes=None if kv_budget.gpu_memory_utilization else kv_budget.kv_cache_bytes,
                gpu_memory_utilization=kv_budget.gpu_memory_utilization,
            )
        kv_bytes = kv_budget.kv_cache_bytes if kv_budget else None
        mc = self.model_config
        draft_block = kv_bytes_per_block(draft_config, config.block_size, config.dtype) if draft_config else 0
        target_block = kv_bytes_per_block(mc, config.block_size, config.dtype)
        if kv_bytes is not None and draft_block:
            # Sized from device memory, a block costs each device its share of both caches: a draft with fewer
            # KV heads than the TP devices replicates them, so its share may be the larger.
            cost = draft_block * kv_cache_shares(config, mc) / kv_cache_shares(config, draft_config) if (
                config.gpu_memory_utilization) else draft_block
            kv_bytes = int(kv_bytes // (target_block + cost)) * target_block  # the target's share
        return _KVSizing(config, kv_bytes, kv_budget, target_block, draft_block)

    def _plan(self, config: EngineConfig, kv_bytes: int | None, platform: str) -> token_budget.EnginePlan:
        """`token_budget.plan_engine` with the cost model saved beside the compilation cache for the buckets
        this engine compiles, if any (its path is kept for a calibration to write)."""
        self._cost_path = None
        device_kind = jax.devices()[0].device_kind

        def saved_cost_model(buckets: tuple[int, ...]):
            self._cost_path = token_budget.cache_path(config.compilation_cache_dir, config, device_kind, buckets)
            return token_budget.saved_cost_model(config, self._cost_path)

        return token_budget.plan_engine(config, self.model_config, kv_bytes, platform, saved_cost_model)

    def _build_parts(self, plan: token_budget.EnginePlan, params: Any, draft: tuple[Any, Any] | None,
                     draft_plan: Any) -> None:
        """The block manager, scheduler, model runner and draft runner for the planned sizing."""
        config, sizing, mc = plan.config, plan.sizing, self.model_config
        self.max_model_len, self.scheduler_config = sizing.max_model_len, sizing.scheduler_config
        self.block_manager = BlockManager(
            sizing.num_blocks, config.block_size, watermark_blocks=int(config.watermark * sizing.num_blocks),
            enable_prefix_caching=config.enable_prefix_caching,
        )
        self.scheduler = make_scheduler(self.scheduler_config, self.block_manager)
        spec = config.speculative_config
        if spec is not None:
            spec.check_model(mc.num_hidden_layers)
        self.runner = ModelRunner(
            mc, params, config, sizing, attention_fn=get_attention_fn(config.attention_backend),
            plan=self.parallel_plan,
            executable_cache=ExecutableCache.in_compilation_cache(config.compilation_cache_dir),
        )
        self.draft_runner = None  # a draft model's (sarathi_jax/runner/draft_runner.py)
        if spec is not None and spec.method != "ngram":
            from sarathi_jax.runner.draft_runner import DraftRunner  # off the request path unless speculating

            if spec.method == "self":
                self.draft_runner = DraftRunner.self_draft(self.runner, spec.num_layers, spec.num_speculative_tokens)
            else:
                self.draft_runner = DraftRunner.draft_model(
                    self.runner, *draft, spec.num_speculative_tokens,
                    attention_fn=get_attention_fn(config.attention_backend), plan=draft_plan)
        if spec is not None:
            self.scheduler.speculation = Speculation.of(
                spec, self.draft_runner.propose if self.draft_runner is not None else None)

    def _serving_parts(self) -> None:
        """The budget policy installed, the engine core over the scheduler and runner, and admission."""
        config, mc = self.config, self.model_config
        self.core = EngineCore(
            self.scheduler,
            self.runner,
            loop=LoopConfig(config.async_scheduling, config.pipeline_parallel_size),
            eos_token_ids=mc.eos_token_ids,
            tokenizer=self.tokenizer,
            seed=config.seed,
        )
        token_budget.install(self.budget_setup, self.scheduler, self.core.iteration_log)
        if self.draft_runner is not None:  # a sampled request's draft samples with its seed and settings
            self.draft_runner.sampling_of = self.core.sampling_of
        is_folder = Path(config.model).is_dir()
        self.admission = Admission(
            vocab_size=mc.vocab_size,
            max_model_len=self.max_model_len,
            kv_cache=KVCapacity.of(self.block_manager),
            tokenizer=self.tokenizer,
            eos_token_ids=mc.eos_token_ids,
            chat_template=ChatTemplate.from_folder(config.model) if is_folder else None,
        )

    def _startup_report(self, requested: EngineConfig, kv: _KVSizing, num_blocks: int, timer: PhaseTimer,
                        compiles: Any, *, warmup: bool, t_start: float, draft_params: Any) -> dict:
        """`startup_stats()`'s fixed part (its docstring says what each entry is)."""
        config, kv_budget = self.config, kv.budget
        store = self.runner.executable_cache
        loaded = store.hits if store is not None else 0  # ready-made executables: neither traced nor compiled
        peak = [(m or {}).get("peak_bytes_in_use") for m in _memory_stats(self.devices)]
        cache_dir = config.compilation_cache_dir
        return {
            "load_s": timer.seconds["load"],
            "init_s": timer.seconds["init"],
            "compile_s": timer.compile_seconds,
            "warmup_s": timer.seconds["warmup"],
            "total_s": time.time() - t_start,
            "warmed_up": warmup,
            "platform": jax.default_backend(),
            "device": jax.devices()[0].device_kind,
            "num_devices": config.tensor_parallel_size * config.pipeline_parallel_size,
            "attention_backend": config.attention_backend,
            "token_budget": self.budget_setup.as_dict(),
            "token_budget_words": self.budget_setup.describe(),
            "attention_backend_setting": requested.attention_backend,
            "dtype": config.dtype,
            "dtype_setting": requested.dtype,
            "quantization": config.quantization,
            "weight_bytes": _device_bytes([stage.params for stage in self.runner.stages]),
            "num_kv_blocks": num_blocks,
            "kv_cache_bytes": num_blocks * kv.target_block,
            # A draft model's share of the memory: its parameters and its KV cache (num_kv_blocks blocks).
            "draft_param_bytes": _nbytes(draft_params) if draft_params is not None else 0,
            "draft_kv_cache_bytes": num_blocks * kv.draft_block,
            "gpu_memory_utilization": config.gpu_memory_utilization,
            "activation_bytes_estimate": kv_budget.activation_bytes if kv_budget else 0,
            "kv_unfragmented_bytes": kv_budget.unfragmented_bytes if kv_budget else None,
            "peak_bytes_in_use": max(peak) if all(p is not None for p in peak) else None,
            "scan_layers": config.scan_layers,
            "compilation_cache_dir": cache_dir,
            "executables": compiles.executables + loaded,
            "cache_hits": compiles.cache_hits + loaded if cache_dir else 0,
            "cache_misses": compiles.executables - compiles.cache_hits if cache_dir else None,
            "executables_loaded": loaded,
            "background_executables": self.runner.background.num_builds if self.runner.background else 0,
        }

    def _calibrate_budget(self, requested: EngineConfig) -> None:
        """Time a few steps of every bucket (all built first), fit the cost model, cache it, and resolve the
        requested "auto"/"dynamic" budget with it, padding to the buckets compiled; "auto" then runs the
        scheduler at the budget picked (the larger buckets stay compiled, unused; a later start that finds the
        cached model compiles for the pick alone, and may pick larger: its top bucket is the budget itself)."""
        self.runner.wait_for_executables()
        model = token_budget.calibrate(self.runner, self.block_manager, self.scheduler_config.max_num_seqs,
                                       self.max_model_len, source={"model": requested.model, "dtype": requested.dtype})
        source = token_budget.save_cost_model(model, self._cost_path)
        self.config, self.budget_setup = token_budget.resolve(requested, model, source, self.runner.buckets,
                                                              max_model_len=self.max_model_len)
        if self.budget_setup.budget != self.scheduler_config.token_budget:
            self.scheduler_config = dataclasses.replace(self.scheduler_config, token_budget=self.budget_setup.budget)
            speculation = self.scheduler.speculation  # the new scheduler keeps the draft grants
            self.scheduler = make_scheduler(self.scheduler_config, self.block_manager)
            self.scheduler.speculation = speculation

    def _kv_budget(self, config: EngineConfig, platform: str):
        """`sizing.kv_cache_budget` with this process's devices: their memory statistics (None on CPU) and
        JAX's allocator fraction (GPUs only; a TPU's bytes_limit is its whole memory)."""
        stats = _memory_stats(self.devices)
        fraction = jax_mem_fraction() if platform in GPU_PLATFORMS else 1.0
        return kv_cache_budget(config, self.model_config, stats, fraction)

    # ----------------------------------------------------------------------------------- pipeline parallelism

    def pipeline_stats(self) -> dict:
        """Pipeline accounting since start (or `reset_pipeline_stats`): `bubble_fraction`
        (1 - busy / (stages x wall)), `stage_busy_s`, `wall_s`, `num_microbatches`, `max_in_flight` (most
        micro-batches dispatched and not yet retired at once) and `max_overlap` (most whose device work
        overlapped in time). See `sarathi_jax.parallel.pipeline`. With pipeline_parallel_size 1 nothing is
        measured: bubble_fraction is None."""
        timeline = self.runner.timeline
        if timeline is None:
            return {"num_stages": 1, "num_microbatches": len(self.iteration_log),
                    "max_in_flight": min(self.core.loop.max_in_flight, len(self.iteration_log)),
                    "bubble_fraction": None}
        return timeline.stats()

    def reset_pipeline_stats(self) -> None:
        if self.runner.timeline is not None:
            self.runner.timeline.reset()

    @property
    def max_microbatches_in_flight(self) -> int:
        timeline = self.runner.timeline
        if timeline is not None:
            return timeline.max_in_flight
        return min(self.core.loop.max_in_flight, len(self.iteration_log))

    # ----------------------------------------------------------------------------------- introspection

    def wait_until_compiled(self, timeout: float | None = None) -> bool:
        """Block until the executables left to background threads at start-up (`background_compile`) are all
        built: True, or False after `timeout` seconds; RuntimeError if one of them failed to build (serving
        goes on without it). Benchmarks call it before they time anything."""
        return self.runner.wait_for_executables(timeout)

    def stop_background_compile(self) -> None:
        """Build nothing more in the background, and return once the builds in flight have ended (an XLA
        compile cannot be interrupted): for a process about to exit."""
        if self.runner.background is not None:
            self.runner.background.stop()

    def startup_stats(self) -> dict:
        """How start-up went. Seconds: `load_s` (weights and tokenizer), `init_s` (sizing, scheduler, model
        runner and KV cache), `compile_s` (tracing, lowering and XLA compiling, or loading executables from the
        persistent cache, wherever it happened), `warmup_s` (the rest of running each bucket once; 0 when built
        with warmup=False, in which case buckets compile on first use), `total_s`. The first three exclude
        the compile time inside them, so the four add up to about the total. Also `platform`, `device`,
        `num_devices`, `attention_backend` (resolved) and `attention_backend_setting` (as given),
        `scan_layers` (resolved), `dtype` (resolved) and `dtype_setting` (as given), `quantization` (the
        weights', resolved: a converted folder's own), `weight_bytes` (the model's parameters as held in device
        memory, all devices together: a replicated array counts once per device), `num_kv_blocks` and
        `kv_cache_bytes` (the cache allocated), `gpu_memory_utilization` (None: a fixed budget or num_blocks),
        `activation_bytes_estimate` (set aside per device under memory-fraction sizing, else 0),
        `kv_unfragmented_bytes` (per device, what the memory fraction allowed when the largest free block of
        device memory allowed less and decided; else None),
        `peak_bytes_in_use` (the most any device held by the end of start-up; None where not reported),
        `compilation_cache_dir` (None: no persistent cache), `executables` (built during start-up),
        `cache_hits` (of those, loaded from the cache) and `cache_misses` (compiled; None without a cache),
        `background_executables` (left to background threads when the engine was ready) and
        `background_compile_s` (how long those took; None until they are all built)."""
        background = self.runner.background
        return {**self._startup_stats,
                "background_compile_s": background.seconds if background is not None and background.done else None}


class _KVSizing(NamedTuple):
    """The KV cache's sizing on an engine's devices: `config` recording it, the target model's byte budget
    (None: `size_engine`'s default), where the budget came from, and the bytes of a block of the target's
    cache and of a draft model's (0: none)."""

    config: EngineConfig
    kv_cache_bytes: int | None
    budget: KVBudget | None
    target_block: int
    draft_block: int


def _resolved_for(config: EngineConfig, platform: str) -> EngineConfig:
    """`config` with what "auto" means on `platform`: attention backend, layer layout, dtype; and the
    compilation cache turned on (before anything compiles) with the directory in use."""
    # The CPU kernel's status makes one tiny call: before the compilation cache and the compile counts.
    kernel_status = cpu_kernel_status() if platform == "cpu" else f"this engine runs on {platform!r}"
    cache_dir = enable_compilation_cache(config.compilation_cache_dir)
    return dataclasses.replace(
        config, compilation_cache_dir=cache_dir,
        attention_backend=resolve_attention_backend(config.attention_backend, platform,
                                                    cpu_kernel_status=kernel_status),
        scan_layers=resolve_scan_layers(config.scan_layers, platform),
        dtype=resolve_dtype(config.dtype, platform),
    )


def _load_draft(name: str, dtype: Any, config: EngineConfig, plan: Any, devices: Sequence[Any]
                ) -> tuple[tuple[Any, Any], Any]:
    """A separate draft's ((config, params), parallel plan): on one device (`plan` None), or on the target's
    devices with the target's tensor parallelism, sharded by the same rules (a draft whose heads do not split
    is refused as the target would be). Errors name the draft."""
    try:
        if plan is None:
            return load_model(name, dtype, seed=config.seed, quantization=config.quantization), None
        from sarathi_jax.parallel import load_parallel_model

        draft_plan, *draft = load_parallel_model(name, dtype, config.seed, config.tensor_parallel_size, 1,
                                                 devices=devices, quantization=config.quantization)
        return (draft[0], draft[1]), draft_plan
    except ValueError as error:
        raise ValueError(f"speculative_config.model {name!r}: {error}") from error


def _memory_stats(devices: Sequence[Any]) -> list[dict | None]:
    """`memory_stats()` of the engine's devices (the mesh's order); None for a device that keeps none (CPU).
    None of them when the engine spans processes: each would size its cache from its own devices, and every
    process must build the same number of blocks."""
    if jax.process_count() > 1:
        return [None]
    return [d.memory_stats() for d in devices]


def format_startup(stats: dict) -> str:
    """One line for logs: `startup_stats()` in words."""
    s = stats
    backend = s["attention_backend"] + (" (auto)" if s["attention_backend_setting"] == "auto" else "")
    if s["compilation_cache_dir"]:
        cache = (f"{s['executables']} executables, {s['cache_hits']} from the compilation cache "
                 f"{s['compilation_cache_dir']}")
    else:
        cache = f"{s['executables']} executables, no compilation cache"
    warm = f"warm-up {s['warmup_s']:.1f} s" if s["warmed_up"] else "no warm-up"
    if s.get("background_executables"):
        n, seconds = s["background_executables"], s.get("background_compile_s")
        cache += (f"; {n} more building in the background" if seconds is None
                  else f"; {n} more built in the background in {seconds:.1f} s")
    return (f"engine ready in {s['total_s']:.1f} s (load {s['load_s']:.1f} s, init {s['init_s']:.1f} s, "
            f"compile {s['compile_s']:.1f} s, {warm}; {cache}) on {s['platform']} "
            f"[{s['device']} x{s['num_devices']}], {backend} attention, "
            f"{'scanned' if s.get('scan_layers', True) else 'unrolled'} layers, "
            f"{s['dtype']}{' (auto)' if s['dtype_setting'] == 'auto' else ''}"
            f"{' ' + s['quantization'] + ' weights' if s.get('quantization') else ''}"
            f" ({s['weight_bytes'] / 2**20:.0f} MiB), {_kv_words(s)}"
            + (f"; {s['token_budget_words']}" if s.get("token_budget_words") else ""))


def _kv_words(s: dict) -> str:
    kv = f"KV cache {s['num_kv_blocks']} blocks ({s['kv_cache_bytes'] / 2**30:.2f} GiB"
    if s["gpu_memory_utilization"] is not None:
        kv += f", gpu_memory_utilization {s['gpu_memory_utilization']:g}"
    if s.get("kv_unfragmented_bytes") is not None:
        kv += (f", cut from {s['kv_unfragmented_bytes'] / 2**30:.2f} GiB per device to fit the largest free block "
               f"of device memory")
    if s.get("draft_param_bytes"):
        kv += (f"; draft model {s['draft_param_bytes'] / 2**30:.2f} GiB of parameters and "
               f"{s['draft_kv_cache_bytes'] / 2**30:.2f} GiB of KV cache")
    if s["peak_bytes_in_use"] is not None:
        kv += f"; device memory peak {s['peak_bytes_in_use'] / 2**30:.2f} GiB"
    return kv + ")"


def _nbytes(tree: Any) -> int:
    return sum(leaf.nbytes for leaf in jax.tree.leaves(tree))


def _device_bytes(tree: Any) -> int:
    """Bytes the arrays of `tree` hold in device memory, all devices together (a replicated array once per
    device; this process's devices)."""
    return sum(shard.data.nbytes for leaf in jax.tree.leaves(tree) for shard in leaf.addressable_shards)
