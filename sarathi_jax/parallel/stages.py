"""The model runner's pipeline stages: building them from a parallel plan, and everything that depends on
where a stage lives.

A `Stage` is a contiguous layer range of the model with its parameters, its paged KV cache and its jitted
step, on a sub-mesh of `tp` devices (`mesh`), or on the default device (`mesh` None: the single-device
runner is one such stage). `build_stages` cuts a `ParallelPlan`'s model into its stages, with parameters and
KV cache sharded Megatron style and attention run per shard under `shard_map`. The stage's methods place
inputs on its devices, describe the LM head the sampler runs after the last stage (`LMHead`: logits computed
vocab-sharded, then gathered, under tensor parallelism) and give its jit the output shardings, so the
runner's step reads the same with or without a mesh.

Multi-process runs (see docs/parallelism.md): every process runs the engine loop and needs the sampled
tokens, but only the last stage's processes hold them; `copy_to_every_process` also puts them on the other
processes (a cross-host transfer: onto a pipeline's earlier stages, or one device of each process the runner is
not on, as a disaggregated engine's instances are) and `local_copy` picks the copy this process can read.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pallas_kernels.greedy_head_cpu import engine_uses_kernel as greedy_head_usable
from sarathi_jax.models import get_model, init_kv_cache, to_out_major
from sarathi_jax.models.layers import lm_head_logits, lm_head_logits_vocab_major, unstack_layer_params
from sarathi_jax.models.out_major import IN_MAJOR, PANELS
from sarathi_jax.parallel.plan import TP_AXIS, ParallelPlan
from sarathi_jax.parallel.sharding import init_stage_kv_cache, place_params, shard_attention


@dataclass(frozen=True)
class LMHead:
    """The model's LM head (`lm_head_logits`) as the sampler runs it, after the last stage's step, on as many
    rows as the step has sequences. With tensor parallelism the logits are computed vocab-sharded (else XLA
    may all-gather the LM head), then gathered once, so the sampler works on replicated logits and returns
    replicated tokens. Hashable: a static argument of the jitted sampler."""

    dtype: Any  # the model's (its matmul precision)
    vocab_sharding: NamedSharding | None = None  # TP with a vocab-parallel head: logits sharded on vocab
    replicated: NamedSharding | None = None  # TP: what the logits and the sampler's outputs are gathered to
    # Greedy-only samplers take the logits vocab-major, [vocab, R] (`logits_vocab_major`), with the weight
    # [vocab, embed] as the dot's left operand: XLA:CPU's YNNPACK packs a dot's right operand on every call,
    # so [R, embed] x [vocab, embed]^T repacks the whole head per step (1.3-1.7x slower at R <= 16).
    # Set on a CPU.
    vocab_major_greedy: bool = False
    # Greedy-only samplers of GREEDY_KERNEL_MIN_ROWS..greedy_head_cpu.MAX_ROWS rows run the LM head and the
    # sampler in one C++ call (`pallas_kernels.greedy_head_cpu`: no logits written, no further passes over
    # them). Set on a single CPU device with float32 weights where the kernel is built for AVX-512.
    greedy_kernel: bool = False

    def logits(self, h: jax.Array, weight: jax.Array) -> jax.Array:
        """float32 logits [R, vocab] (replicated) of final-normed rows h [R, embed]."""
        logits = lm_head_logits(h, weight, self.dtype)
        if self.vocab_sharding is not None:
            logits = jax.lax.with_sharding_constraint(logits, self.vocab_sharding)
        return self.replicate(logits)

    def logits_vocab_major(self, h: jax.Array, weight: jax.Array) -> jax.Array:
        """float32 logits [vocab, R] (replicated) of final-normed rows h [R, embed]: `logits(h, weight).T`."""
        logits = lm_head_logits_vocab_major(h, weight, self.dtype)
        if self.vocab_sharding is not None:
            spec = NamedSharding(self.vocab_sharding.mesh, PartitionSpec(TP_AXIS, None))
            logits = jax.lax.with_sharding_constraint(logits, spec)
        return self.replicate(logits)

    def replicate(self, tree: Any) -> Any:
        """Inside the jitted sampler: `tree`'s arrays replicated over the stage's devices (TP)."""
        if self.replicated is None:
            return tree
        return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, self.replicated), tree)


@dataclass
class Stage:
    """One pipeline stage: a layer range, its sub-mesh (None: the default device), params, its stacked KV
    cache `(k_pages, v_pages)` (`[layers of the stage, blocks, block_size, kv_heads, head_dim]`), step."""

    index: int
    layer_range: tuple[int, int]
    mesh: Any  # jax.sharding.Mesh | None
    model: Any
    params: Any
    kv_cache: tuple
    is_last: bool
    step: Callable | None = None
    tensor_parallel_size: int = 1
    shard_vocab: bool = False  # the LM head is vocab-sharded over the TP devices
    kv_sharding: Any = None  # NamedSharding of each of k_pages, v_pages (with a mesh)

    @property
    def replicated(self) -> NamedSharding | None:
        """Replicated over the stage's devices (None: the default device)."""
        return None if self.mesh is None else NamedSharding(self.mesh, PartitionSpec())

    def upload(self, host_arrays: Any) -> Any:
        """Host arrays for this stage's step. On a mesh: put on its devices (replicated), in one call. On the
        default device: the host arrays themselves, which the jitted call copies up as it dispatches (its C++
        path costs a fraction of a `jax.device_put`: about 60 against 380 microseconds of host time on a busy
        CPU device). The caller allows that one transfer (`jax.transfer_guard_host_to_device`) and never
        writes the arrays again (a CPU device may alias them)."""
        if self.mesh is None:
            return host_arrays
        return jax.device_put(host_arrays, self.replicated)

    def place(self, x: Any) -> Any:
        """Host arrays (or the previous stage's activations) onto this stage's devices, replicated."""
        if self.mesh is None or x is None:
            return x
        return jax.device_put(x, self.replicated)

    def lm_head(self) -> LMHead:
        """The LM head as the sampler runs it on this (last) stage's devices: greedy-only samplers take
        vocab-major logits on a CPU (see `LMHead`)."""
        tp = self.mesh is not None and self.tensor_parallel_size > 1
        vocab = NamedSharding(self.mesh, PartitionSpec(None, TP_AXIS)) if tp and self.shard_vocab else None
        device = self.mesh.devices.flat[0] if self.mesh is not None else jax.devices()[0]
        cpu = device.platform == "cpu"
        greedy_kernel = (cpu and self.mesh is None and jnp.dtype(self.model.dtype) == jnp.float32
                         and greedy_head_usable())
        return LMHead(jnp.dtype(self.model.dtype), vocab, self.replicated if tp else None,
                      vocab_major_greedy=cpu, greedy_kernel=greedy_kernel)

    @property
    def lm_head_weight(self) -> jax.Array:
        """This (last) stage's LM head weight (the embedding's copy when tied), as `LMHead.logits` takes it."""
        return self.model.lm_head_weight(self.params)

    def jit_shardings(self, outputs: int = 1) -> dict[str, Any]:
        """`jax.jit` keyword arguments for a step (params, kv_cache, ...) -> (out, kv_cache) (with `outputs`
        n: (out_1 .. out_n, kv_cache); 0: kv_cache alone): on a mesh the outputs are replicated and the KV
        cache keeps its sharding, so the next step (the runner's or a draft's, `draft_runner`) takes it as it is."""
        if self.mesh is None:
            return {}
        kv_cache = (self.kv_sharding, self.kv_sharding)
        return {"out_shardings": (*(self.replicated,) * outputs, kv_cache) if outputs else kv_cache}


def build_stages(plan: ParallelPlan, model_config: Any, params: Any, dtype: Any, attention_fn: Callable,
                 num_blocks: int, block_size: int) -> list[Stage]:
    """The stages of `plan`, each with its share of `params` and a fresh KV cache (steps not yet made)."""
    if model_config not in (plan.source_config, plan.model_config):
        raise ValueError("model_config is not the model the parallel plan was made for")
    config = plan.model_config  # KV heads expanded when they are replicated over TP devices
    stage_params = place_params(params, plan)
    tp = plan.tensor_parallel_size
    stages = []
    for s, layer_range in enumerate(plan.layer_ranges):
        mesh = plan.stage_mesh(s)
        attn = shard_attention(attention_fn, mesh) if tp > 1 else attention_fn
        model = get_model(config, dtype, attention_fn=attn).clone(
            layer_range=None if plan.num_stages == 1 else layer_range
        )
        kv = init_stage_kv_cache(plan, s, num_blocks, block_size, dtype)
        stages.append(Stage(s, layer_range, mesh, model, stage_params[s], kv, s == plan.num_stages - 1,
                            tensor_parallel_size=tp, shard_vocab=plan.shard_vocab,
                            kv_sharding=plan.kv_cache_sharding(s)))
    return stages


def runner_stages(plan: ParallelPlan | None, model_config: Any, params: Any, dtype: Any, attention_fn: Callable,
                  num_blocks: int, block_size: int, *, scan_layers: bool, layout: str) -> list[Stage]:
    """A model's stages laid out as a runner steps them (the target's, `model_runner`, and a separate draft's,
    `draft_runner`): one stage on the default device (`plan` None) or `plan`'s (`build_stages`); unrolled
    unless `scan_layers` (stacked weights split into per-layer arrays once, where still stacked); the projection
    weights in `layout` (`models/out_major.py`: out-major or panels for one stage only)."""
    if plan is None:
        model = get_model(model_config, dtype, attention_fn=attention_fn)
        kv_cache = init_kv_cache(model_config, num_blocks, block_size, dtype)
        stages = [Stage(0, (0, model_config.num_hidden_layers), None, model, params, kv_cache, True)]
    else:
        stages = build_stages(plan, model_config, params, dtype, attention_fn, num_blocks, block_size)
    if not scan_layers:
        for stage in stages:
            stage.model = stage.model.clone(scan_layers=False)
            if "layers" in stage.params:  # still stacked (the engine unstacks a single device's target early)
                stage.params = unstack_layer_params(stage.params, first_layer=stage.layer_range[0])
    if layout != IN_MAJOR:
        stage, = stages
        stage.model, stage.params = to_out_major(stage.model, stage.params, panels=layout == PANELS)
    return stages


@dataclass
class Copies:
    """Copies of one replicated array on several stages' meshes (multi-process pipelines). Not a pytree
    node: `jax.tree.map(f, ...)` sees it as one leaf."""

    arrays: list


def local_copy(x: Any) -> Any:
    """An array this process can read: of `Copies`, the first with a local shard; of a replicated array
    spanning processes, a local copy; anything else as it is."""
    if isinstance(x, Copies):
        x = next(c for c in x.arrays if c.addressable_shards)
    if getattr(x, "is_fully_addressable", True):
        return x
    return x.addressable_data(0)


def copy_to_every_process(stages: list[Stage], out: Any) -> Any:
    """Multi-process runs: also put the (replicated) sampler output `out` on the processes that do not hold the
    last stage: on the earlier stages' meshes (pipelines), and on one device of each process no stage is on (a
    disaggregated engine's instance, whose other processes drive the other instances); its leaves become
    `Copies`. Otherwise `out` as it is."""
    if jax.process_count() == 1:
        return out
    have = {d.process_index for d in stages[-1].mesh.devices.flat}
    targets = []
    for stage in stages[:-1]:
        procs = {d.process_index for d in stage.mesh.devices.flat}
        if not procs <= have:
            targets.append(stage.replicated)
            have |= procs
    size = stages[-1].mesh.devices.size  # a cross-process copy keeps the number of devices
    targets += [_on_process(p, size) for p in range(jax.process_count()) if p not in have]
    if not targets:
        return out
    leaves, treedef = jax.tree.flatten(out)
    copies = [[leaf] for leaf in leaves]
    for sharding in targets:
        moved = jax.device_put(leaves, sharding)
        for c, leaf in zip(copies, moved):
            c.append(leaf)
    return jax.tree.unflatten(treedef, [Copies(c) for c in copies])


@functools.cache
def _on_process(process: int, size: int) -> NamedSharding:
    """Replicated on the first `size` devices of `process` (the same devices in every process). `size`: the
    source's device count (JAX's cross-process copy, CopyArrays, needs equal device lists)."""
    devices = sorted((d for d in jax.devices() if d.process_index == process), key=lambda d: d.id)
    if len(devices) < size:
        raise ValueError(f"process {process} has {len(devices)} devices; copying the sampled tokens of a runner "
                         f"on {size} devices there needs {size}")
    return NamedSharding(Mesh(np.array(devices[:size]), (TP_AXIS,)), PartitionSpec())
