"""Turns a scheduled batch into padded device arrays and runs one jitted step per iteration.

Every step runs at one of a few fixed token counts (`buckets`): tile-aligned sizes up to the largest batch
the scheduler can produce. All of them are compiled by `warmup()`, so serving never compiles again;
`num_compilations` counts traces of the step function and lets tests check that.

Parallelism (`plan`, see `sarathi_jax.parallel`): the model is cut into `pp` pipeline stages (contiguous
layer ranges), each one jitted function on its own sub-mesh of `tp` devices, with parameters and the paged KV
cache sharded Megatron style (`NamedSharding`) and attention run per shard under `shard_map`. A step
dispatches the stages one after the other without waiting (JAX dispatch is asynchronous), handing the
activations to the next stage with `device_put`; `submit()` returns a `PendingStep` at once, so the engine
can schedule and dispatch the next micro-batch while earlier ones are still running. Without a plan (or with
tp = pp = 1) there is one stage on the default device, exactly the single-device runner.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sarathi_jax.models import AttentionMetadata, ModelConfig, get_model, init_kv_caches
from sarathi_jax.sampling import SamplerOutput, SamplingArrays, make_sampling_arrays, sample
from sarathi_jax.scheduler import ScheduledChunk

SMALLEST_BUCKET = 16


def token_buckets(max_step_tokens: int, smallest: int = SMALLEST_BUCKET) -> tuple[int, ...]:
    """Powers of two from `smallest`, then `max_step_tokens` rounded up to a multiple of `smallest`."""
    top = -(-max_step_tokens // smallest) * smallest
    buckets = []
    size = smallest
    while size < top:
        buckets.append(size)
        size *= 2
    buckets.append(top)
    return tuple(buckets)


def _to_host(x: Any) -> np.ndarray:
    if isinstance(x, _Copies):  # multi-process pipeline: the first copy this process can read
        x = next(c for c in x.arrays if c.addressable_shards)
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    return np.asarray(x.addressable_data(0))  # replicated output of a multi-process mesh: any local copy


@dataclass
class _Copies:
    """Copies of one replicated array on several stages' meshes (multi-process pipelines: every process
    runs the engine loop and needs the sampled tokens, but only the last stage's processes hold them).
    Not a pytree node: `jax.tree.map(_to_host, ...)` sees it as one leaf."""

    arrays: list


@dataclass
class _Stage:
    """One pipeline stage: a layer range, its sub-mesh (None: the default device), params, caches, step."""

    index: int
    layer_range: tuple[int, int]
    mesh: Any  # jax.sharding.Mesh | None
    model: Any
    params: Any
    kv_caches: list
    is_last: bool
    step: Callable | None = None

    def place(self, x: Any) -> Any:
        """Host arrays (or the previous stage's activations) onto this stage's devices, replicated."""
        if self.mesh is None or x is None:
            return x
        return jax.device_put(x, jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec()))


class PendingStep:
    """A dispatched step; `result()` waits for it and returns the host `SamplerOutput` (cached).
    With `ModelRunner.capture_logits(True)`, `logits` holds the step's float32 logits `[max_num_seqs, vocab]`
    on the host after `result()`."""

    def __init__(self, out: Any, record: Any = None, timeline: Any = None) -> None:
        self._out = out
        self._record = record
        self._timeline = timeline
        self._result: Any = None
        self.logits: np.ndarray | None = None

    def result(self) -> Any:
        if self._result is None:
            out = jax.tree.map(_to_host, self._out)
            if isinstance(out, tuple) and not isinstance(out, SamplerOutput):
                out, self.logits = out
            self._result, self._out = out, None
            if self._record is not None:
                self._timeline.retired(self._record)
        return self._result


class ModelRunner:
    """Owns the parameters, the paged KV cache and the compiled step function(s) of one model."""

    def __init__(
        self,
        model_config: ModelConfig,
        params: dict,
        *,
        dtype: jnp.dtype,
        attention_fn: Callable,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        max_step_tokens: int,
        plan: Any = None,
    ) -> None:
        self.model_config = model_config
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.buckets = token_buckets(max_step_tokens)
        self.plan = None if plan is None or plan.is_single_device else plan
        self.timeline = None
        if self.plan is None:
            self.model = get_model(model_config, dtype, attention_fn=attention_fn)
            kv_caches = init_kv_caches(model_config, num_blocks, block_size, dtype)
            self.stages = [_Stage(0, (0, model_config.num_hidden_layers), None, self.model, params, kv_caches, True)]
        else:
            self.stages = self._build_stages(params, dtype, attention_fn)
            if len(self.stages) > 1:
                from sarathi_jax.parallel.pipeline import PipelineTimeline

                self.timeline = PipelineTimeline(len(self.stages))
        self._stage_traces = [0] * len(self.stages)
        self._capture_logits = False
        for stage in self.stages:
            stage.step = self._make_stage_step(stage)

    # ------------------------------------------------------------------------------------- building

    def _build_stages(self, params: Any, dtype: jnp.dtype, attention_fn: Callable) -> list[_Stage]:
        from sarathi_jax.parallel.sharding import init_stage_kv_caches, place_params, shard_attention

        plan = self.plan
        if self.model_config not in (plan.source_config, plan.model_config):
            raise ValueError("model_config is not the model the parallel plan was made for")
        config = plan.model_config  # KV heads expanded when they are replicated over TP devices
        stage_params = place_params(params, plan)
        stages = []
        for s, layer_range in enumerate(plan.layer_ranges):
            mesh = plan.stage_mesh(s)
            attn = shard_attention(attention_fn, mesh) if plan.tensor_parallel_size > 1 else attention_fn
            model = get_model(config, dtype, attention_fn=attn).clone(
                layer_range=None if plan.num_stages == 1 else layer_range
            )
            kv = init_stage_kv_caches(plan, s, self.num_blocks, self.block_size, dtype)
            stages.append(_Stage(s, layer_range, mesh, model, stage_params[s], kv, s == plan.num_stages - 1))
        return stages

    def _make_stage_step(self, stage: _Stage) -> Callable:
        model, index, is_last, mesh = stage.model, stage.index, stage.is_last, stage.mesh
        replicate_logits = mesh is not None and self.plan.tensor_parallel_size > 1
        vocab_parallel = replicate_logits and self.plan.shard_vocab
        capture = self._capture_logits

        def step_impl(params, kv_caches, x, positions, metadata, logits_indices, sampling_arrays):
            self._stage_traces[index] += 1  # Python side effect: runs once per trace, never per call
            out, kv_caches = model.apply({"params": params}, x, positions, kv_caches, metadata, logits_indices)
            if is_last:
                P = jax.sharding.PartitionSpec
                if vocab_parallel:  # logits computed vocab-sharded (else XLA may all-gather the LM head)...
                    out = jax.lax.with_sharding_constraint(out, jax.sharding.NamedSharding(mesh, P(None, "tp")))
                if replicate_logits:  # ...then one all-gather of [S, vocab] and an unsharded sampler
                    out = jax.lax.with_sharding_constraint(out, jax.sharding.NamedSharding(mesh, P()))
                out = (sample(out, sampling_arrays), out) if capture else sample(out, sampling_arrays)
            return out, kv_caches

        # The KV cache is donated: XLA updates it in place instead of copying it every step.
        if mesh is None:
            return jax.jit(step_impl, donate_argnums=(1,))
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        kv_sharding = self.plan.kv_cache_sharding(index)
        kv_shardings = [(kv_sharding, kv_sharding) for _ in stage.kv_caches]
        return jax.jit(step_impl, donate_argnums=(1,), out_shardings=(replicated, kv_shardings))

    # ------------------------------------------------------------------------------------- public API

    @property
    def num_compilations(self) -> int:
        """Traces of the step: one per bucket (times the number of pipeline stages with PP)."""
        return sum(self._stage_traces)

    @property
    def params(self) -> Any:
        """The parameter tree (with PP: the stages' trees merged; a tied embedding shows stage 0's copy)."""
        if len(self.stages) == 1:
            return self.stages[0].params
        merged: dict = {}
        for stage in reversed(self.stages):
            merged.update(stage.params)
        return merged

    @property
    def kv_caches(self) -> list:
        """All layers' `(k_pages, v_pages)`, in layer order."""
        return [kv for stage in self.stages for kv in stage.kv_caches]

    def bucket_for(self, num_tokens: int) -> int:
        for bucket in self.buckets:
            if num_tokens <= bucket:
                return bucket
        raise ValueError(f"a batch of {num_tokens} tokens exceeds the largest bucket {self.buckets[-1]}")

    def warmup(self) -> None:
        """Compile every bucket with an all-padding batch (num_seqs = 0 writes nothing to the cache)."""
        for bucket in self.buckets:
            self._dispatch(*self._empty_batch(bucket), timed=False)
        for stage in self.stages:
            jax.block_until_ready(stage.kv_caches)

    def execute(self, chunks: Sequence[ScheduledChunk], sampling_rows: Sequence[tuple]) -> SamplerOutput:
        """Run one step; row i of the result is chunk i's sample (meaningful where chunk.needs_sample)."""
        return self.submit(chunks, sampling_rows).result()

    def submit(self, chunks: Sequence[ScheduledChunk], sampling_rows: Sequence[tuple]) -> PendingStep:
        """Dispatch one step without waiting for it (pipeline parallelism keeps several in flight)."""
        token_ids, positions, metadata, logits_indices = self._host_batch(chunks)
        sampling_arrays = make_sampling_arrays(sampling_rows, self.max_num_seqs)
        return self._dispatch(token_ids, positions, metadata, logits_indices, sampling_arrays)

    def capture_logits(self, enable: bool = True) -> None:
        """Make every step also return its logits (`PendingStep.logits`), for tests and debugging. Rebuilds
        the step functions: call it before warm-up or the first step, or they compile again."""
        if enable != self._capture_logits:
            self._capture_logits = enable
            for stage in self.stages:
                stage.step = self._make_stage_step(stage)

    # ------------------------------------------------------------------------------------- internals

    def _dispatch(self, token_ids, positions, metadata, logits_indices, sampling_arrays, *, timed: bool = True):
        timeline = self.timeline if timed else None
        record = timeline.begin(len(token_ids)) if timeline is not None else None
        x = token_ids
        for stage in self.stages:
            last = stage.is_last
            x, stage.kv_caches = stage.step(
                stage.params,
                stage.kv_caches,
                stage.place(x),
                stage.place(positions),
                stage.place(metadata),
                stage.place(logits_indices) if last else None,
                stage.place(sampling_arrays) if last else None,
            )
            if record is not None:
                timeline.dispatched(record, stage.index, x)
        if len(self.stages) > 1 and jax.process_count() > 1:
            x = self._copy_to_every_process(x)
        return PendingStep(x, record, timeline)

    def _copy_to_every_process(self, out: Any) -> Any:
        """Multi-process pipelines: also put the (replicated) sampler output on the stages of the processes
        that do not hold the last stage (a cross-host transfer; see docs/parallelism.md)."""
        have = {d.process_index for d in self.stages[-1].mesh.devices.flat}
        targets = []
        for stage in self.stages[:-1]:
            procs = {d.process_index for d in stage.mesh.devices.flat}
            if not procs <= have:
                targets.append(stage)
                have |= procs
        if not targets:
            return out
        leaves, treedef = jax.tree.flatten(out)
        copies = [[leaf] for leaf in leaves]
        for stage in targets:
            moved = jax.device_put(leaves, jax.sharding.NamedSharding(stage.mesh, jax.sharding.PartitionSpec()))
            for c, leaf in zip(copies, moved):
                c.append(leaf)
        return jax.tree.unflatten(treedef, [_Copies(c) for c in copies])

    def _host_batch(self, chunks: Sequence[ScheduledChunk]) -> tuple:
        num_tokens = sum(chunk.num_new_tokens for chunk in chunks)
        bucket = self.bucket_for(num_tokens)
        token_ids, positions, slot_mapping, kv_lens, block_tables, cu_q_lens = self._empty_host_arrays(bucket)
        logits_indices = np.zeros(self.max_num_seqs, np.int32)
        offset = 0
        block_size = self.block_size
        for i, chunk in enumerate(chunks):
            seq, start, n = chunk.seq, chunk.start_position, chunk.num_new_tokens
            end = offset + n
            token_ids[offset:end] = seq.token_ids[start : start + n]
            pos = np.arange(start, start + n, dtype=np.int32)
            positions[offset:end] = pos
            table = np.asarray(seq.block_table, np.int32)
            slot_mapping[offset:end] = table[pos // block_size] * block_size + pos % block_size
            kv_lens[i] = start + n
            block_tables[i, : len(table)] = table
            cu_q_lens[i + 1] = end
            logits_indices[i] = end - 1
            offset = end
        cu_q_lens[len(chunks) + 1 :] = offset
        metadata = AttentionMetadata(
            slot_mapping=slot_mapping,
            kv_lens=kv_lens,
            block_tables=block_tables,
            cu_q_lens=cu_q_lens,
            num_seqs=np.array([len(chunks)], np.int32),
        )
        return token_ids, positions, metadata, logits_indices

    def _empty_host_arrays(self, bucket: int) -> tuple[np.ndarray, ...]:
        return (
            np.zeros(bucket, np.int32),  # token_ids
            np.zeros(bucket, np.int32),  # positions
            np.full(bucket, -1, np.int32),  # slot_mapping: -1 rows are dropped, never written
            np.zeros(self.max_num_seqs, np.int32),  # kv_lens
            np.zeros((self.max_num_seqs, self.max_blocks_per_seq), np.int32),  # block_tables
            np.zeros(self.max_num_seqs + 1, np.int32),  # cu_q_lens
        )

    def _empty_batch(self, bucket: int) -> tuple:
        token_ids, positions, slot_mapping, kv_lens, block_tables, cu_q_lens = self._empty_host_arrays(bucket)
        metadata = AttentionMetadata(
            slot_mapping=slot_mapping,
            kv_lens=kv_lens,
            block_tables=block_tables,
            cu_q_lens=cu_q_lens,
            num_seqs=np.zeros(1, np.int32),
        )
        logits_indices = np.zeros(self.max_num_seqs, np.int32)
        return token_ids, positions, metadata, logits_indices, make_sampling_arrays([], self.max_num_seqs)
