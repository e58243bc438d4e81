"""Turns a scheduled batch into packed device arrays and runs the jitted model step and sampler.

Every step runs at one of a few fixed token counts (`buckets`): tile-aligned sizes up to the largest batch
the scheduler can produce. The sampler is a separate jitted function with one variant per sampling need
(`sampling.SamplerVariant`: greedy only, sampled, top-k/top-p, logprobs, a structured-outputs token bitmask),
chosen on the host, so no step has a conditional whose predicate lives on the device (on a GPU a host sync
mid-step). `warmup()` (`sarathi_jax.runner.precompile`) builds every bucket and variant: the largest bucket and the
general sampler before the engine is ready, the others then or on background threads while it serves (a
batch runs in the smallest bucket built that holds it). Serving never compiles (`num_compilations`).

Dispatch is lean: a step's small inputs travel as two int32 host arrays (`sarathi_jax.runner.step_inputs`, kept by
`sarathi_jax.runner.input_batch`) that the jitted calls copy up (`Stage.upload`), parameters and the KV cache stay on
the device, `submit()` returns at once, and the sampled tokens start their copy to the host at dispatch. What a
step looks up (its bucket, sampler, layout offsets, LM head weight) is resolved when the runner is built or an
executable becomes ready, not per step. A pending token (the overlapped loop: a decode scheduled before its
input token reached the host) is read on the device from the previous step's sampled tokens.

Parallelism (`plan`, `sarathi_jax.parallel`): `pp` pipeline stages (contiguous layer ranges), each one jitted
function on its own sub-mesh of `tp` devices (`sarathi_jax.parallel.stages` owns where a stage lives). A step
dispatches the stages one after the other without waiting, handing activations on; `submit()` returns a
`PendingStep` at once, so the engine dispatches the next micro-batch while earlier ones run. Without a plan
(or tp = pp = 1): one stage on the default device.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sarathi_jax.config.engine_config import EngineConfig, resolve_dtype, resolve_scan_layers
from sarathi_jax.runner.executable_cache import ExecutableCache
from sarathi_jax.runner.input_batch import InputBatch
from sarathi_jax.models import ModelConfig, projection_layout
from sarathi_jax.parallel.pipeline import PipelineTimeline
from sarathi_jax.parallel.stages import LMHead, Stage, copy_to_every_process, local_copy, runner_stages
from sarathi_jax.runner.precompile import BackgroundBuild, ExecutableBuilder, ExecutableTable, on_stages, run_builds
from sarathi_jax.runner.precompile import compile_threads as _default_compile_threads
from sarathi_jax.runner.sample.sampler import FULL_VARIANT, SAMPLER_VARIANTS, SamplerOutput, SamplerVariant, captured_logits
from sarathi_jax.runner.sample.sampler import sample_packed_jit
from sarathi_jax.runner.sample.inputs import constrained_variant, padded_bitmask
from sarathi_jax.request.sampling_params import RequestSampling
from sarathi_jax.scheduler import ScheduledChunk
from sarathi_jax.request.sequence import Sequence as Seq
from sarathi_jax.config.sizing import EngineSizing, bucket_ladder, platform_buckets
from sarathi_jax.runner.step_inputs import BatchLayout, PackedStep, row_ladder, sample_rows
from sarathi_jax.request.structured_outputs import bitmask_width


def _to_host(x: Any, across_processes: bool) -> np.ndarray | None:
    """A fetched array on the host (`across_processes`: this process's copy, `local_copy`). `np.asarray` waits
    for the copy `copy_to_host_async` started at dispatch (half the host time of `jax.device_get`). Allowed
    explicitly here: the engine loop otherwise runs clean under `jax.transfer_guard("disallow")`."""
    if x is None:
        return None
    with jax.transfer_guard_device_to_host("allow"):
        return np.asarray(local_copy(x) if across_processes else x)


class PendingStep:
    """A dispatched step; `result()` waits for it and returns the host `SamplerOutput` (cached): token ids, and
    the logprob arrays when the step's sampler variant computed them (else None), whose copy to the host
    started at dispatch. With `ModelRunner.capture_logits(True)`, `logits` holds the step's float32 logits
    `[R, vocab]` on the host after `result()` (R the rows it sampled: row i is the batch's i-th sequence)."""

    def __init__(self, out: SamplerOutput, want_logprobs: bool, num_padded_tokens: int, logits: Any = None,
                 record: Any = None, timeline: Any = None, *,
                 sampler: tuple[SamplerVariant, int] | None = None, across_processes: bool = False) -> None:
        self._out: Any = out if want_logprobs else SamplerOutput(out.token_ids, None, None, None)
        self.num_padded_tokens = num_padded_tokens  # the step's bucket
        self.sampler = sampler  # the (variant, rows R) its LM head and sampler ran
        self._device_logits, self._record, self._timeline = logits, record, timeline
        self._result: SamplerOutput | None = None
        self._across_processes = across_processes
        self.logits: np.ndarray | None = None
        for leaf in self._out:
            if isinstance(leaf, jax.Array):
                leaf.copy_to_host_async()

    def result(self) -> SamplerOutput:
        if self._result is None:
            across = self._across_processes
            out = SamplerOutput(*(_to_host(x, across) for x in self._out))
            if self._device_logits is not None:
                self.logits = _to_host(self._device_logits, across)
            self._result, self._out, self._device_logits = out, None, None
            if self._record is not None:
                self._timeline.retired(self._record)
        return self._result


StepObserver = Callable[[Sequence[ScheduledChunk], PackedStep, SamplerVariant], None]


class ModelRunner:
    """Owns the parameters, the paged KV cache and the compiled step function(s) of one model."""

    _step_observer: StepObserver | None = None  # see `observe_steps`
    # Draft hooks (draft_runner.py): a separate draft's shadow of each step; drafts' rejection step after sampling
    step_shadow: Callable[[np.ndarray, jax.Array], None] | None = None
    step_verify: Callable[..., SamplerOutput] | None = None

    def __init__(self, model_config: ModelConfig, params: dict, config: EngineConfig, sizing: EngineSizing, *,
                 attention_fn: Callable, plan: Any = None, executable_cache: ExecutableCache | None = None) -> None:
        """`config` as the engine resolved it, or with "auto" and None left for this platform to decide (dtype,
        scan_layers); `sizing` (`sizing.size_engine`) gives the KV blocks, max_model_len and the largest step,
        whose token buckets are this platform's (`sizing.platform_buckets`). `attention_fn`: the kernel that
        `config.attention_backend` names (`pallas_kernels.get_attention_fn`)."""
        platform = jax.default_backend()
        dtype = jnp.dtype(resolve_dtype(config.dtype, platform))
        scan_layers = resolve_scan_layers(config.scan_layers, platform)
        self.model_config = model_config
        self.block_size = block_size = config.block_size
        self.num_blocks = num_blocks = sizing.num_blocks
        self.max_num_seqs = max_num_seqs = config.max_num_seqs
        self.max_blocks_per_seq = -(-sizing.max_model_len // block_size)
        self.buckets = platform_buckets(sizing.max_step_tokens, platform, bucket_ladder(config))  # ascending
        # One device: the default device's plain path (a mesh of one other device keeps its plan: placement).
        self.plan = None if plan is None or plan.is_single_device and plan.on_default_device else plan
        self.timeline = None
        self.stages = runner_stages(self.plan, model_config, params, dtype, attention_fn, num_blocks, block_size,
                                    scan_layers=scan_layers,
                                    layout=projection_layout(platform, single_device=self.plan is None, dtype=dtype,
                                                            quantization=model_config.quantization))
        if self.plan is None:
            self.model = self.stages[0].model
        elif len(self.stages) > 1:
            self.timeline = PipelineTimeline(len(self.stages))
        # Executables built ahead of time, what is ready (until `warmup`: everything, compiled on first run).
        self._table = ExecutableTable(self.buckets, len(self.stages), self.row_ladder)
        self._capture_logits = False
        for stage in self.stages:
            stage.step = self._make_stage_step(stage)
        self._sampler_traces = 0  # sampler variants the jitted sampler compiled on dispatch
        self.executable_cache = executable_cache
        self.background: BackgroundBuild | None = None  # the executables `warmup` left to background threads
        # The previous step's sampled token ids (device): a pending input token is read from them. Pipelines
        # never schedule a sequence in flight: only a single stage feeds them back (else a constant).
        self._no_tokens = self.stages[0].place(jnp.zeros(max_num_seqs, jnp.int32))
        self._prev_tokens: jax.Array = self._no_tokens
        # A step that samples nothing: zeros placed like `_no_tokens`, once the step's rows are there (its
        # argument is kept, so the result is ready only when the step is done, as a sampler's would be).
        self._no_samples = jax.jit(lambda hidden: jnp.zeros(max_num_seqs, jnp.int32), keep_unused=True,
                                   out_shardings=self._no_tokens.sharding)
        # The host side of every step's inputs, kept and updated in place from step to step.
        self.input_batch = InputBatch(max_num_seqs, self.max_blocks_per_seq, block_size, self.buckets)
        # Resolved once for dispatch: batch part length -> (bucket, rows its step final-norms), where it keeps
        # num_seqs, the fewest sampler rows that hold n sequences, the LM head weight, multi-process or not.
        layouts = [self._layout(bucket) for bucket in self.buckets]
        self._bucket_of_len = {layout.batch_len: (layout.num_tokens, layout.num_rows) for layout in layouts}
        self._num_seqs_index = layouts[0].num_seqs_index
        self._rows_for = tuple(sample_rows(self.row_ladder, n) for n in range(max_num_seqs + 1))
        self._lm_head: LMHead = self.stages[-1].lm_head()
        self._head_weight = self.stages[-1].lm_head_weight
        self._across_processes = jax.process_count() > 1
        self._bitmask_width = bitmask_width(model_config.vocab_size)

    # ------------------------------------------------------------------------------------- building

    def _make_stage_step(self, stage: Stage) -> Callable:
        """The jitted model step of one stage: (params, kv_cache, x, batch, prev_tokens) -> (out, kv_cache),
        `batch` the packed batch part. Stage 0 takes x = None and reads token ids from `batch` (pending ones
        from `prev_tokens` [S]); the last stage returns the final-normed rows that may sample, [S, embed]
        (zeros past the bucket's `BatchLayout.num_rows`): the LM head runs with the sampler, on only as many
        rows as the step has sequences. The other stages return their activations."""
        model, index, is_first, is_last = stage.model, stage.index, stage.index == 0, stage.is_last
        s, b, table = self.max_num_seqs, self.max_blocks_per_seq, self._table  # not self: see `warmup`

        def step_impl(params, kv_cache, x, batch, prev_tokens):
            table.traced(index)  # Python side effect: runs once per trace (on any thread), never per call
            layout = BatchLayout.of_packed(batch.shape[0], s, b)
            token_ids, src_rows, positions, metadata, logits_indices = layout.unpack_batch(batch)
            if is_first:  # a pending token is the previous step's sample in row src_rows[t]
                x = jnp.where(src_rows >= 0, prev_tokens[jnp.clip(src_rows, 0, s - 1)], token_ids)
            # The last stage stops before the LM head (`sampling.sample_packed` runs it on the rows that sample).
            return model.apply({"params": params}, x, positions, kv_cache, metadata,
                               logits_indices if is_last else None, apply_lm_head=False)

        # The KV cache is donated: XLA updates it in place instead of copying it every step.
        return jax.jit(step_impl, donate_argnums=(1,), **stage.jit_shardings())

    # ------------------------------------------------------------------------------------- public API

    @property
    def num_step_compilations(self) -> int:
        """Traces of the model step alone: one per bucket, times the pipeline stages."""
        return sum(self._table.stage_traces)

    @property
    def num_compilations(self) -> int:
        """Traces of the model step (one per bucket, times the pipeline stages) plus sampler variants this
        runner built or compiled (each variant once per process and shape: runners share the sampler's cache)."""
        return sum(self._table.stage_traces) + self._table.sampler_builds + self._sampler_traces

    @property
    def ready_buckets(self) -> tuple[int, ...]:
        """The buckets a batch may run in now (all of `buckets` once every executable is built)."""
        return self._table.buckets

    @property
    def params(self) -> Any:
        """The parameter tree (with PP: the stages' trees merged; a tied embedding shows stage 0's copy)."""
        if len(self.stages) == 1:
            return self.stages[0].params
        return {name: leaf for stage in reversed(self.stages) for name, leaf in stage.params.items()}

    @property
    def kv_caches(self) -> list:
        """Each stage's stacked `(k_pages, v_pages)`, in stage (so layer) order."""
        return [stage.kv_cache for stage in self.stages]

    def bucket_for(self, num_tokens: int) -> int:
        if num_tokens < len(bucket_of := self._table.bucket_of) and bucket_of[num_tokens] is not None:
            return bucket_of[num_tokens]
        raise ValueError(f"a batch of {num_tokens} tokens exceeds the largest bucket {self.buckets[-1]}")

    def warmup(self, compile_threads: int | None = None, *, background: bool = False) -> None:
        """Build every bucket's step and every sampler variant, then run the largest bucket once with an
        all-padding batch (num_seqs = 0 writes nothing to the cache; temperature -1 rows are no-ops).

        The largest bucket and the general sampler (`FULL_VARIANT`) for its rows are built first: every batch
        can run on them. Each build loads from the executable cache, else compiles. The other buckets (each
        with FULL_VARIANT for its rows, `BatchLayout.num_rows`) and samplers are built here too, or with
        `background`, loaded here if cached and else compiled on background threads (`self.background`) while
        the engine serves, each used from the moment it is built; until then a batch runs in the smallest
        built bucket that holds it, sampled by FULL_VARIANT (bitwise the same tokens and logprobs; see
        sarathi_jax/runner/sample/sampler.py). Samplers (the LM head and sampler on R rows of the `row_ladder`): every
        variant for the largest bucket's rows, the greedy one and FULL_VARIANT for the smaller Rs. A step
        runs the smallest R that holds its sequences and has its variant, else FULL_VARIANT, built
        (`ExecutableTable.sampler_for`). Builds run on `compile_threads` threads (default:
        `precompile.compile_threads`). A multi-process engine builds nothing ahead: every bucket and variant
        compiles on its first run, here."""
        top_rows = self.row_ladder[-1]  # the largest bucket's rows
        # Every sampler variant for the largest bucket's rows; the greedy and the general one for the others.
        samplers = [(v, top_rows) for v in SAMPLER_VARIANTS]
        samplers += [(v, rows) for rows in self.row_ladder[:-1] for v in (SAMPLER_VARIANTS[0], FULL_VARIANT)]
        if jax.process_count() > 1:
            built: set[tuple[SamplerVariant, int]] = set()
            for bucket in self.buckets:  # each bucket's step, and each row count's samplers once
                rows = self._layout(bucket).num_rows
                variants = [v for v, r in samplers if r == rows and (v, r) not in built] or [FULL_VARIANT]
                for variant in variants:
                    self._dispatch(self._layout(bucket).empty(), variant, timed=False, rows=rows)
                    built.add((variant, rows))
            self._table.only(self.buckets, samplers)  # the rest falls back to FULL_VARIANT, compiled above
            jax.block_until_ready(self.kv_caches)
            return
        threads = compile_threads if compile_threads is not None else _default_compile_threads()
        table, top = self._table, self.buckets[-1]
        table.only([], [])
        # The builder and the builds hold the table and the stages, never `self`: a background build stops
        # when this runner is collected.
        stages, s, b = self.stages, self.max_num_seqs, self.max_blocks_per_seq
        builder = ExecutableBuilder(
            stages, lambda bucket: on_stages(stages, BatchLayout(bucket, s, b).empty()), no_tokens=self._no_tokens,
            max_num_seqs=self.max_num_seqs, max_blocks_per_seq=self.max_blocks_per_seq, sampler=sample_packed_jit,
            cache=self.executable_cache, table=table, bitmask_width=self._bitmask_width,
        )
        greedy = SAMPLER_VARIANTS[0]
        builder.bucket(top, (FULL_VARIANT,))
        # Decodes land in the small buckets and greedy requests need no sampling work: those first. A smaller
        # bucket builds the greedy and general samplers for its rows, unless a bigger one had the same rows.
        rest = [functools.partial(builder.sampler, greedy, top_rows)]
        rest += [functools.partial(builder.bucket, bucket, (greedy, FULL_VARIANT)) for bucket in self.buckets[:-1]]
        rest += [functools.partial(builder.sampler, v, top_rows) for v in SAMPLER_VARIANTS if v not in (greedy, FULL_VARIANT)]
        if background:  # what the executable cache holds loads at once (a warm start has it all); the rest later
            rest = [build for build in rest if not build(load_only=True)]
            self.background = BackgroundBuild(rest, threads, owner=self)
        else:
            run_builds(rest, threads)
        # Samples nothing: one stage builds `_no_samples` here (its samplers are built above); pipelines sample.
        self._dispatch(self._layout(top).empty(), FULL_VARIANT, timed=False, sample=False)
        jax.block_until_ready(self.kv_caches)
        if self.background is not None:
            self.background.start()

    def wait_for_executables(self, timeout: float | None = None) -> bool:
        """Block until every bucket and variant is built (True), or `timeout` seconds pass (False)."""
        return True if self.background is None else self.background.wait(timeout)

    def execute(self, chunks: Sequence[ScheduledChunk], sampling_of: Callable[[Seq], RequestSampling],
                token_bitmask: np.ndarray | None = None) -> SamplerOutput:
        """Run one step (`submit` and wait); row i of the result is chunk i's sample (where it samples)."""
        return self.submit(chunks, sampling_of, token_bitmask).result()

    def submit(self, chunks: Sequence[ScheduledChunk], sampling_of: Callable[[Seq], RequestSampling],
               token_bitmask: np.ndarray | None = None) -> PendingStep:
        """Dispatch one step without waiting for it. A chunk may end in a pending token (`PENDING_TOKEN`) that
        the step submitted just before this one sampled, or in draft tokens (rows: `speculative.verify_rows`).
        `sampling_of(seq)`: a sequence's sampling settings, asked when it enters the batch's rows. A
        `token_bitmask` (structured outputs: int32 [len(chunks), ceil(V/32)]) runs a constrained variant."""
        num_tokens = sum(chunk.num_new_tokens for chunk in chunks)
        packed, variant = self.input_batch.prepare(chunks, self.bucket_for(num_tokens), sampling_of)
        variant = constrained_variant(variant) if token_bitmask is not None else variant
        if self._step_observer is not None:
            self._step_observer(chunks, packed, variant)
        num_rows = len(chunks) + sum(chunk.num_draft_tokens for chunk in chunks)  # a draft's row samples too
        return self._dispatch(packed, variant, token_bitmask=token_bitmask, rows=self._rows_for[num_rows],
                              chunks=chunks, sample=any(chunk.needs_sample for chunk in chunks))

    def now(self) -> float:
        return time.monotonic()

    def capture_logits(self, enable: bool = True) -> None:
        """Make every step also return its logits (`PendingStep.logits`), for tests and debugging."""
        self._capture_logits = enable

    # ------------------------------------------------------------------------------------- measuring hooks

    def observe_steps(self, observer: StepObserver | None) -> None:
        """Call `observer(chunks, packed, variant)` for each batch `submit` dispatches (step replay); None stops."""
        self._step_observer = observer

    def padding_step(self, bucket: int) -> PackedStep:
        """Packed inputs of an all-padding batch of `bucket` tokens: it writes no KV and samples nothing."""
        return self._layout(bucket).empty()

    @contextlib.contextmanager
    def dispatch_outside_loop(self) -> Iterator[Callable[..., PendingStep]]:
        """Yields `dispatch(packed, variant, rows=None)` (`rows` as for `_dispatch`) for steps outside the
        serving loop (replays, warm-up): off the pipeline timeline, each one's samples feeding the next; on exit
        the next real step reads the last real step's samples again."""
        prev_tokens = self._prev_tokens
        try:
            yield functools.partial(self._dispatch, timed=False)
        finally:
            self._prev_tokens = prev_tokens

    # ------------------------------------------------------------------------------------- internals

    def _layout(self, bucket: int) -> BatchLayout:
        return BatchLayout(bucket, self.max_num_seqs, self.max_blocks_per_seq)

    @functools.cached_property
    def row_ladder(self) -> tuple[int, ...]:
        """The row counts the LM head and the sampler run at (`step_inputs.row_ladder` of the buckets)."""
        return row_ladder(self.buckets, self.max_num_seqs)

    def _dispatch(self, packed: PackedStep, variant: SamplerVariant, *, timed: bool = True,
                  rows: int | None = None, token_bitmask: np.ndarray | None = None, chunks: Sequence = (),
                  sample: bool = True) -> PendingStep:
        """Run a step of host `packed` inputs. Its LM head and sampler run on `rows` (a `row_ladder` value;
        default: the smallest that holds the step's sequences, `step_inputs.sample_rows`); a constrained
        variant takes `token_bitmask`'s rows, padded to max_num_seqs with all-ones (unconstrained) rows.
        Without `sample` (no chunk ends where it samples: prompt chunks only, none a prompt's last) a step of one
        stage and one process, without drafts, runs no LM head and no sampler: its token ids are zeros that
        nothing reads."""
        timeline = self.timeline if timed else None
        batch_len = packed.batch.size
        num_tokens, bucket_rows = self._bucket_of_len[batch_len]
        if rows is None:
            rows = self._rows_for[int(packed.batch[self._num_seqs_index])]
        table = self._table
        run_variant, rows = table.samplers[variant, rows, bucket_rows]
        record = timeline.begin(num_tokens) if timeline else None
        if self.step_shadow is not None:
            self.step_shadow(packed.batch, self._prev_tokens)
        single, on_mesh = len(self.stages) == 1, self.plan is not None
        executables, head, x = table.executables, self._lm_head, None
        # Off a mesh the one stage takes the host arrays, which its jitted call copies up (`Stage.upload`).
        for stage, on_device in on_stages(self.stages, packed) if on_mesh else ((self.stages[0], packed),):
            prev = (self._prev_tokens if single else self._no_tokens) if stage.index == 0 else None
            step = executables.get((stage.index, batch_len), stage.step)
            if on_mesh:
                x = stage.place(x)
            with jax.transfer_guard_host_to_device("allow"):  # the packed host arrays, only
                x, stage.kv_cache = step(stage.params, stage.kv_cache, x, on_device.batch, prev)
            if stage.is_last:
                hidden, weight = x, self._head_weight
                sampler = executables.get((run_variant, rows))
                with jax.transfer_guard_host_to_device("allow"):
                    args = (hidden, weight, on_device.sampling)
                    if run_variant.constrained:
                        args += (stage.upload(padded_bitmask(token_bitmask, self.max_num_seqs, self._bitmask_width)),)
                    if not sample and single and self.step_verify is None and not self._across_processes:
                        x = SamplerOutput(self._no_samples(hidden), None, None, None)
                    elif sampler is not None:
                        x = sampler(*args)
                    else:
                        before = sample_packed_jit._cache_size()
                        x = sample_packed_jit(*args, variant=run_variant, rows=rows, head=head)
                        self._sampler_traces += sample_packed_jit._cache_size() - before
            if record is not None:
                timeline.dispatched(record, stage.index, x)
        if self.step_verify is not None and chunks:  # before the next step reads its tokens
            x = self.step_verify(chunks, x, hidden, weight, on_device.sampling, rows, head)
        if single:
            self._prev_tokens = x.token_ids
        if self._across_processes:
            x = copy_to_every_process(self.stages, x)  # multi-process pipelines only
        logits = captured_logits(hidden, weight, rows=rows, head=head) if self._capture_logits else None
        return PendingStep(x, variant.logprobs, num_tokens, logits, record, timeline, sampler=(run_variant, rows),
                           across_processes=self._across_processes)
