"""Draft models for speculative decoding: each speculating decode's k draft tokens, proposed greedily (a
point-mass proposal) before the step that verifies them (`DraftRunner.propose`, asked by
`scheduler.speculation.Speculation.extend` once its grants' blocks are allocated). Two drafts:

  * "self" (`DraftRunner.self_draft`): the target's first L decoder layers, its final norm and LM head, run
    over the target's own KV cache.
  * "model" (`DraftRunner.draft_model`): a separate model with the target's vocabulary, its own parameters and
    its own KV cache on the target's block tables (same blocks, same slots). It shadows every target step
    (`ModelRunner.step_shadow`): the same packed batch runs through the draft, so its cache holds every token
    the target's does (prompt chunks, prefix-cache hits, recomputed preemptions) and nothing else to track.

Why the target's cache serves the "self" draft exactly (docs/design/speculative-decoding.md):
  * Committed tokens' K/V in layers < L is what the draft's own layers would write: the draft's layers are
    the target's layers, on the same tokens at the same positions. So the draft needs no cache and no
    prefill of its own.
  * The draft writes K/V (layers < L only) into the slots of positions p .. p + k - 1 of a decode at position
    p: slots the scheduler has just allocated for the (1 + k)-token verification chunk, past every committed
    token. The verification step writes all layers of slots p .. p + k before its attention reads them, so the
    target never reads a value the draft wrote; rejected tokens' slots lie past the committed tokens and are
    trimmed or rewritten before anything reads them, as with any proposer. The target's tokens are therefore
    the non-speculative run's whatever the draft proposes; the draft only decides how many are accepted.
The same holds for a separate draft's cache, which only the draft reads.

Proposals: a greedy request's drafts are the draft's argmax (a point mass, for which the verification's
sample-and-compare is exact: `speculative`'s docstring). A sampled request's are drawn from the draft's own
distribution q, its logits processed with the request's temperature, top-k, top-p, min-p and seed
(`rejection_sampling.draft_sample`; the request's settings come from `sampling_of`, which the engine sets).
q's rows stay on the device, [S, V] per draft step, until the verification step (`verify`, the runner's
`step_verify` hook) replaces those rows' plain samples by rejection sampling against them (accept with
min(1, p/q), else the residual): the emitted tokens are distributed as the target's, and a sampled request
accepts sum_t min(p, q) per position instead of a point mass' p(argmax q).

The k steps: step j runs one token per sequence still drafting (those granted more than j drafts; rows
sorted by grant, so they are a prefix of the rows), position p + j, its token read on the device from the
previous step's output row (the `src_rows` path the overlapped loop uses), so only the last step's tokens
are fetched. Each step runs in the smallest of the draft's buckets that holds its rows: the runner's token
buckets up to the first that holds max_num_seqs rows, each compiled once (`warmup`), never while serving (a
separate draft's shadow step: once per runner bucket).

Where it runs: on a `parallel.stages.Stage`, the target's for "self", the draft's own for a separate model.
Under tensor parallelism that stage is on the target's mesh, its params and KV cache sharded by the target's
rules; the draft's steps keep those shardings (docs/design/speculative-decoding.md, "Under tensor
parallelism"). Pipeline parallelism is refused (`EngineConfig`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from sarathi_jax.runner.input_batch import make_sampling_arrays
from sarathi_jax.runner.model_runner import ModelRunner
from sarathi_jax.models import ModelConfig
from sarathi_jax.parallel.plan import ParallelPlan
from sarathi_jax.parallel.stages import Stage, runner_stages
from sarathi_jax.runner.sample.rejection import draft_sample, verify_sampled_drafts_jit
from sarathi_jax.runner.sample.sampler import SamplerOutput
from sarathi_jax.runner.sample.inputs import SAMPLING_EPS, empty_sampling_arrays
from sarathi_jax.request.sampling_params import RequestSampling, SamplingParams
from sarathi_jax.scheduler import ScheduledChunk
from sarathi_jax.request.sequence import Sequence as Seq
from sarathi_jax.config.sizing import bucket_for
from sarathi_jax.spec_decode.speculative import verify_rows
from sarathi_jax.runner.step_inputs import BatchLayout, pack_sampling, unpack_sampling

# Filters of a sampled draft step and its verification (`SamplerVariant.filter`): "exact" serves every row.
_DRAFT_FILTERS = ("none", "exact")


class DraftRunner:
    """Proposes draft tokens with `model` (`propose`) on `stage`: the `parallel.stages.Stage` that holds the
    draft's parameters and KV cache and says where they live (the target's own stage for "self"; the draft's,
    on the target's devices, for a separate model).

    Under tensor parallelism the stage has the target's mesh: its params and KV cache are sharded by the
    target's rules (`sarathi_jax.parallel`), every jitted step takes them as they are and returns the KV cache
    with its sharding (`Stage.jit_shardings`) and tokens and q replicated, as the runner's step and sampler do,
    so nothing is resharded or copied per step and warm-up compiles what serving calls."""

    # A request's (params, seed, banned ids) (`EngineCore.sampling_of`); None: every proposal is the argmax.
    sampling_of: Callable[[Seq], RequestSampling] | None = None

    def __init__(self, runner: ModelRunner, stage: Stage, model: nn.Module, num_speculative_tokens: int,
                 shadow: bool = False) -> None:
        if len(runner.stages) != 1:  # EngineConfig refuses it first, saying why
            raise ValueError("speculative_config with a draft model ('self' or 'model') is not supported with "
                             "pipeline_parallel_size > 1")
        if jax.process_count() > 1:  # `propose` reads the drafts on the host as one process's arrays
            raise ValueError("speculative_config with a draft model ('self' or 'model') runs in one process only "
                             "(not yet in a multi-process engine)")
        self.runner, self.stage = runner, stage
        s = self.max_num_seqs = runner.max_num_seqs
        b = self.max_blocks_per_seq = runner.max_blocks_per_seq
        self.block_size = runner.block_size
        top = bucket_for(runner.buckets, s) or runner.buckets[-1]
        self.buckets = tuple(bucket for bucket in runner.buckets if bucket <= top)
        self.num_traces = 0  # the draft's traces: one per bucket (and one per runner bucket of a shadow step)
        # Arrays made here as the step outputs are: committed to the cache's device, or replicated on the mesh.
        if stage.mesh is None:
            device = next(iter(jax.tree.leaves(stage.kv_cache)[0].devices()))
            self._commit: Callable[[Any], Any] = functools.partial(jax.device_put, device=device)
        else:
            self._commit = stage.place
        self._no_tokens = self._commit(jnp.zeros(s, jnp.int32))
        self.num_speculative_tokens = num_speculative_tokens
        # What the last `propose` drew from q, for its verification step: seq_id -> draft row, q per draft step
        # (num_speculative_tokens arrays [S, V], zeros past the steps run), the filter both steps apply.
        self._sampled_rows: dict[str, int] = {}
        self._draft_probs: tuple[jax.Array, ...] = ()
        self._no_probs = self._commit(jnp.zeros((s, runner.model_config.vocab_size), jnp.float32))
        self._filter = "none"
        head = stage.lm_head()  # on a mesh: logits vocab-sharded, then gathered (as the target's sampler has them)

        def forward(params, kv_cache, batch, prev_tokens, lm_head=True):
            self.num_traces += 1  # Python side effect: once per trace, never per call
            layout = BatchLayout.of_packed(batch.shape[0], s, b)
            token_ids, src_rows, positions, metadata, logits_indices = layout.unpack_batch(batch)
            x = jnp.where(src_rows >= 0, prev_tokens[jnp.clip(src_rows, 0, s - 1)], token_ids)
            h, kv_cache = model.apply({"params": params}, x, positions, kv_cache, metadata, logits_indices,
                                      apply_lm_head=False)
            return (head.logits(h, model.lm_head_weight(params)) if lm_head else None), kv_cache

        def step(params, kv_cache, batch, prev_tokens):
            logits, kv_cache = forward(params, kv_cache, batch, prev_tokens)
            return jnp.argmax(logits, axis=-1).astype(jnp.int32), kv_cache

        def sample_step(params, kv_cache, batch, prev_tokens, sampling, filter_):
            logits, kv_cache = forward(params, kv_cache, batch, prev_tokens)
            tokens, probs = draft_sample(logits, unpack_sampling(sampling, s), filter_)
            return tokens, probs, kv_cache

        def shadow_step(params, kv_cache, batch, prev_tokens):
            return forward(params, kv_cache, batch, prev_tokens, lm_head=False)[1]

        # The KV cache is donated (updated in place) and keeps its sharding; tokens and q come out replicated.
        self._step = jax.jit(step, donate_argnums=(1,), **stage.jit_shardings(1))
        self._sample_step = jax.jit(sample_step, donate_argnums=(1,), static_argnames=("filter_",),
                                    **stage.jit_shardings(2))
        self._shadow_step = jax.jit(shadow_step, donate_argnums=(1,), **stage.jit_shardings(0)) if shadow else None
        if shadow:
            runner.step_shadow = self._shadow
        runner.step_verify = self.verify

    @classmethod
    def self_draft(cls, runner: ModelRunner, num_layers: int, num_speculative_tokens: int) -> DraftRunner:
        """The "self" draft: `runner`'s first `num_layers` layers, final norm and LM head, over its KV cache,
        on its stage (its devices and shardings)."""
        stage = runner.stages[0]  # 1 <= num_layers < its layers: `check_model`
        return cls(runner, stage, stage.model.clone(run_layers=num_layers), num_speculative_tokens)

    @classmethod
    def draft_model(cls, runner: ModelRunner, config: ModelConfig, params: Any, num_speculative_tokens: int, *,
                    attention_fn: Callable, plan: ParallelPlan | None = None) -> DraftRunner:
        """A separate draft (`config`, `params` as `models.load_model` gives them, or with `plan` as
        `parallel.load_parallel_model` does) with the target's vocabulary, laid out as `runner`'s model is
        (scanned or unrolled layers, the projections' layout), its own KV cache on the target's blocks. `plan`
        (the target's tensor parallelism, one stage, the target's devices): params and KV cache sharded by the
        same rules as the target's, attention per shard (`parallel.stages.runner_stages`)."""
        target = runner.stages[0]
        if config.vocab_size != runner.model_config.vocab_size:
            raise ValueError(f"speculative_config.model has a vocabulary of {config.vocab_size} tokens, the model "
                             f"{runner.model_config.vocab_size}: a draft must share the target's vocabulary")
        stage, = runner_stages(plan, config, params, target.model.dtype, attention_fn, runner.num_blocks,
                               runner.block_size, scan_layers=target.model.scan_layers,
                               layout=target.model.projection_layout)
        return cls(runner, stage, stage.model, num_speculative_tokens, shadow=True)

    def warmup(self) -> None:
        """Compile every draft bucket (greedy and sampled: each filter), the shadow step and the verification's
        rejection step (each sampler row count and filter): all-padding inputs write and propose nothing."""
        s, b = self.max_num_seqs, self.max_blocks_per_seq
        padding = pack_sampling(empty_sampling_arrays(s))
        for bucket in self.buckets:
            self._run(BatchLayout(bucket, s, b).empty_batch(), self._no_tokens)
            for filter_ in _DRAFT_FILTERS:
                self._run(BatchLayout(bucket, s, b).empty_batch(), self._no_tokens, padding, filter_)
        if self._shadow_step is not None:
            for bucket in self.runner.buckets:
                self._shadow(BatchLayout(bucket, s, b).empty_batch(), self._no_tokens)
        # The verification's inputs placed as serving has them: the target's final-normed rows (committed), its
        # sampler's outputs (uncommitted on one device; replicated on a mesh) and its uploaded sampling part.
        runner, target = self.runner, self.runner.stages[-1]
        hidden = self._commit(jnp.zeros((s, runner.model_config.hidden_size), target.model.dtype))
        out = SamplerOutput(target.place(jnp.zeros(s, jnp.int32)), None, None, None)
        with jax.transfer_guard_host_to_device("allow"):
            sampling = target.upload(padding)
        for rows in runner.row_ladder:
            for filter_ in _DRAFT_FILTERS:
                self._verify(out._replace(logprobs=target.place(jnp.zeros(rows, jnp.float32))), hidden,
                             target.lm_head_weight, sampling, rows, target.lm_head(), filter_,
                             np.full(s, -1, np.int32), np.zeros(s, np.int32))
        jax.block_until_ready(self.stage.kv_cache)

    def propose(self, granted: Sequence[tuple[Seq, int]]) -> list[list[int]]:
        """Each (sequence, n)'s n draft tokens after its last token (known on the host: the scheduler grants
        drafts only to decodes without a pending token), the K/V slots of positions p .. p + n - 1 allocated.
        Sampled requests' drafts are drawn from q (kept for `verify`) when `sampling_of` is set."""
        order = sorted(range(len(granted)), key=lambda i: -granted[i][1])  # rows still drafting: a prefix
        seqs = [granted[i][0] for i in order]
        counts = np.asarray([granted[i][1] for i in order])
        n, bs = len(seqs), self.block_size
        settings = [self.sampling_of(seq) for seq in seqs] if self.sampling_of is not None else []
        sampled = {seq.seq_id: row for row, seq in enumerate(seqs)
                   if settings and settings[row][0].temperature >= SAMPLING_EPS}
        self._filter = "exact" if any(_filters(settings[row][0]) for row in sampled.values()) else "none"
        starts = np.asarray([seq.num_computed_tokens for seq in seqs], np.int32)
        tables = np.zeros((n, self.max_blocks_per_seq), np.int32)
        for i, seq in enumerate(seqs):
            tables[i, : len(seq.block_table)] = seq.block_table
        rows = np.arange(n, dtype=np.int32)
        outputs, probs, prev = [], [], self._no_tokens
        for j in range(int(counts[0])):
            m = int((counts > j).sum())  # the rows still drafting at step j
            bucket = bucket_for(self.buckets, m)
            layout = BatchLayout(bucket, self.max_num_seqs, self.max_blocks_per_seq)
            batch = layout.empty_batch()
            v = layout.host_views(batch)
            positions = starts[:m] + j
            v["kv_lens"][:m] = positions + 1
            v["cu_q_lens"][1 : m + 1] = rows[:m] + 1
            v["cu_q_lens"][m + 1 :] = m
            v["num_seqs"][0] = m
            v["logits_indices"][:m] = rows[:m]
            v["block_tables"][:m] = tables[:m]
            v["positions"][:m] = positions
            v["slot_mapping"][:m] = tables[rows[:m], positions // bs] * bs + positions % bs
            if j == 0:
                v["token_ids"][:m] = [seq.token_ids[-1] for seq in seqs]
            else:
                v["src_rows"][:m] = rows[:m]  # the previous step's token in the same row
            if sampled:
                prev, q = self._run(batch, prev, self._sampling(seqs[:m], settings, j), self._filter)
                probs.append(q)
            else:
                prev = self._run(batch, prev)
            outputs.append(prev)
        self._sampled_rows = sampled
        self._draft_probs = tuple(probs) + (self._no_probs,) * (self.num_speculative_tokens - len(probs))
        with jax.transfer_guard_device_to_host("allow"):
            tokens = np.stack([np.asarray(out) for out in outputs])  # [steps, S]: one wait, for the last step
        drafts: list[list[int]] = [[] for _ in granted]
        for row, i in enumerate(order):
            drafts[i] = tokens[: counts[row], row].tolist()
        return drafts

    def verify(self, chunks: Sequence[ScheduledChunk], out: SamplerOutput, hidden: jax.Array, head_weight: jax.Array,
               sampling: Any, rows: int, head: Any) -> SamplerOutput:
        """The runner's `step_verify`: a step's sampler output with the verification rows of the drafts the last
        `propose` drew from q replaced by rejection sampling (`rejection_sampling.verify_sampled_drafts`)."""
        sampled, s = self._sampled_rows, self.max_num_seqs
        if not sampled or not any(chunk.draft_token_ids for chunk in chunks):
            return out
        self._sampled_rows = {}  # one verification step per proposal
        q_index, draft_ids = np.full(s, -1, np.int32), np.zeros(s, np.int32)
        starts = verify_rows(len(chunks), [chunk.num_draft_tokens for chunk in chunks])
        for chunk, start in zip(chunks, starts):
            row = sampled.get(chunk.seq.seq_id)
            if row is not None:
                for j, token in enumerate(chunk.draft_token_ids):
                    q_index[start + j], draft_ids[start + j] = j * s + row, token
        return self._verify(out, hidden, head_weight, sampling, rows, head, self._filter, q_index, draft_ids)

    def _verify(self, out: SamplerOutput, hidden: jax.Array, head_weight: jax.Array, sampling: Any, rows: int,
                head: Any, filter_: str, q_index: np.ndarray, draft_ids: np.ndarray) -> SamplerOutput:
        probs = self._draft_probs or (self._no_probs,) * self.num_speculative_tokens
        with jax.transfer_guard_host_to_device("allow"):  # the small host index arrays (and sampling part)
            q_index, draft_ids = self.runner.stages[-1].upload((q_index, draft_ids))
            token_ids, logprobs = verify_sampled_drafts_jit(hidden, head_weight, sampling, out.token_ids,
                                                            out.logprobs, probs, q_index, draft_ids,
                                                            rows=rows, head=head, filter_=filter_)
        self._draft_probs = ()
        return out._replace(token_ids=token_ids, logprobs=logprobs)

    def _sampling(self, seqs: Sequence[Seq], settings: Sequence[RequestSampling], j: int) -> np.ndarray:
        """Draft step j's sampling part: each row's settings at its request's step (its j-th draft), with
        min_tokens' bans while under it, as the target's row at that step has them."""
        rows = []
        for seq, (params, seed, banned) in zip(seqs, settings):
            step = len(seq.output_token_ids) + j
            rows.append((params, seed, step, banned if step < params.min_tokens else ()))
        return pack_sampling(make_sampling_arrays(rows, self.max_num_seqs))

    def _run(self, batch: np.ndarray, prev_tokens: jax.Array, sampling: np.ndarray | None = None,
             filter_: str = "none") -> Any:
        """A greedy draft step's tokens, or (with `sampling`) a sampled one's (tokens, q)."""
        stage = self.stage
        with jax.transfer_guard_host_to_device("allow"):  # the packed host batch (and sampling part), only
            if sampling is None:
                tokens, stage.kv_cache = self._step(stage.params, stage.kv_cache, stage.upload(batch), prev_tokens)
                return tokens
            batch, sampling = stage.upload((batch, sampling))
            tokens, probs, stage.kv_cache = self._sample_step(stage.params, stage.kv_cache, batch, prev_tokens,
                                                              sampling, filter_)
        return tokens, probs

    def _shadow(self, batch: np.ndarray, prev_tokens: jax.Array) -> None:
        """A target step's packed batch through the separate draft: its K/V into the draft's cache. The runner's
        previous tokens are committed as warm-up's are: on one device the sampler leaves them uncommitted and
        the rejection step committed, and each placement would compile the step again."""
        stage = self.stage
        with jax.transfer_guard_host_to_device("allow"):
            stage.kv_cache = self._shadow_step(stage.params, stage.kv_cache, stage.upload(batch),
                                               self._commit(prev_tokens))


def _filters(params: SamplingParams) -> bool:
    """Whether a sampled request needs the top-k / top-p filter (else filter "none" serves it: min-p only)."""
    return params.top_k > 0 or params.top_p < 1.0
