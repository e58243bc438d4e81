"""The self-speculative draft (speculative_config method "self"): the target's first L decoder layers, its
final norm and its LM head, run over the target's own KV cache, proposing each speculating decode's k draft
tokens greedily (a point-mass proposal) before the step that verifies them.

Why the target's cache serves the draft exactly (docs/design.md, "Speculative decoding"):
  * Committed tokens' K/V in layers < L is what the draft's own layers would write: the draft's layers are
    the target's layers, on the same tokens at the same positions. So the draft needs no cache and no
    prefill of its own, and sees every prompt chunk, prefix-cache hit and recomputed preemption as the
    target wrote it.
  * The draft writes K/V (layers < L only) into the slots of positions p .. p + k - 1 of a decode at position
    p: slots the scheduler has just allocated for the (1 + k)-token verification chunk, past every committed
    token. The verification step writes all layers of slots p .. p + k before its attention reads them, so the
    target never reads a value the draft wrote; rejected tokens' slots lie past the committed tokens and are
    trimmed or rewritten before anything reads them, as with any proposer. The target's tokens are therefore
    the non-speculative run's whatever the draft proposes; the draft only decides how many are accepted.

The proposal is the draft's argmax, for greedy and sampled requests alike: a point mass, for which the
verification's sample-and-compare is exact rejection sampling (`speculative`'s docstring).

The k steps: step j runs one token per sequence still drafting (those granted more than j drafts; rows
sorted by grant, so they are a prefix of the rows), position p + j, its token read on the device from the
previous step's output row (the `src_rows` path the overlapped loop uses), so only the last step's tokens
are fetched. Each step runs in the smallest of the draft's buckets that holds its rows: the runner's token
buckets up to the first that holds max_num_seqs rows, each compiled once (`warmup`), never while serving.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sarathi_jax.model_runner import ModelRunner
from sarathi_jax.sequence import Sequence as Seq
from sarathi_jax.sizing import bucket_for
from sarathi_jax.step_inputs import BatchLayout


def draft_params(params: dict, num_layers: int) -> dict:
    """The draft's parameter tree: the target's `params` with its first `num_layers` layers (stacked `layers`
    sliced; unrolled `layers_i` kept for i < num_layers), the embedding, final norm and LM head as they are."""
    out = {name: leaf for name, leaf in params.items() if not name.startswith("layers")}
    if "layers" in params:
        out["layers"] = jax.tree.map(lambda x: x[:num_layers], params["layers"])
    for i in range(num_layers):
        if f"layers_{i}" in params:
            out[f"layers_{i}"] = params[f"layers_{i}"]
    return out


class SelfDraftRunner:
    """Proposes draft tokens with the first `num_layers` layers of `runner`'s model (`propose`)."""

    def __init__(self, runner: ModelRunner, num_layers: int) -> None:
        target = runner.model_config
        if not 1 <= num_layers < target.num_hidden_layers:
            raise ValueError(f"speculative_config.num_layers must be in [1, {target.num_hidden_layers}) for this "
                             f"model's {target.num_hidden_layers} layers, got {num_layers}")
        if len(runner.stages) != 1 or runner.plan is not None:
            raise ValueError("speculative_config method 'self' runs on one device only (no tensor or pipeline "
                             "parallelism yet)")
        self.runner, self.num_layers = runner, num_layers
        s = self.max_num_seqs = runner.max_num_seqs
        b = self.max_blocks_per_seq = runner.max_blocks_per_seq
        self.block_size = runner.block_size
        top = bucket_for(runner.buckets, s) or runner.buckets[-1]
        self.buckets = tuple(bucket for bucket in runner.buckets if bucket <= top)
        model = runner.stages[0].model.clone(config=dataclasses.replace(target, num_hidden_layers=num_layers),
                                             kv_cache_layers=target.num_hidden_layers)
        self.num_traces = 0  # the draft step's traces: one per bucket
        self._no_tokens = jnp.zeros(s, jnp.int32)

        def step(params, kv_cache, batch, prev_tokens):
            self.num_traces += 1  # Python side effect: once per trace, never per call
            layout = BatchLayout.of_packed(batch.shape[0], s, b)
            token_ids, src_rows, positions, metadata, logits_indices = layout.unpack_batch(batch)
            x = jnp.where(src_rows >= 0, prev_tokens[jnp.clip(src_rows, 0, s - 1)], token_ids)
            logits, kv_cache = model.apply({"params": draft_params(params, num_layers)}, x, positions, kv_cache,
                                           metadata, logits_indices)
            return jnp.argmax(logits, axis=-1).astype(jnp.int32), kv_cache

        self._step = jax.jit(step, donate_argnums=(1,))  # the target's KV cache, updated in place

    def warmup(self) -> None:
        """Compile every draft bucket: an all-padding batch writes nothing and proposes nothing."""
        for bucket in self.buckets:
            self._run(BatchLayout(bucket, self.max_num_seqs, self.max_blocks_per_seq).empty_batch(), self._no_tokens)
        jax.block_until_ready(self.runner.stages[0].kv_cache)

    def propose(self, granted: Sequence[tuple[Seq, int]]) -> list[list[int]]:
        """Each (sequence, n)'s n draft tokens after its last token (known on the host: the scheduler grants
        drafts only to decodes without a pending token), the K/V slots of positions p .. p + n - 1 allocated."""
        order = sorted(range(len(granted)), key=lambda i: -granted[i][1])  # rows still drafting: a prefix
        seqs = [granted[i][0] for i in order]
        counts = np.asarray([granted[i][1] for i in order])
        n, bs = len(seqs), self.block_size
        starts = np.asarray([seq.num_computed_tokens for seq in seqs], np.int32)
        tables = np.zeros((n, self.max_blocks_per_seq), np.int32)
        for i, seq in enumerate(seqs):
            tables[i, : len(seq.block_table)] = seq.block_table
        rows = np.arange(n, dtype=np.int32)
        outputs, prev = [], self._no_tokens
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
            prev = self._run(batch, prev)
            outputs.append(prev)
        with jax.transfer_guard_device_to_host("allow"):
            tokens = np.stack([np.asarray(out) for out in outputs])  # [steps, S]: one wait, for the last step
        drafts: list[list[int]] = [[] for _ in granted]
        for row, i in enumerate(order):
            drafts[i] = tokens[: counts[row], row].tolist()
        return drafts

    def _run(self, batch: np.ndarray, prev_tokens: jax.Array) -> jax.Array:
        stage = self.runner.stages[0]
        with jax.transfer_guard_host_to_device("allow"):  # the packed host batch, only
            tokens, stage.kv_cache = self._step(stage.params, stage.kv_cache, batch, prev_tokens)
        return tokens
