"""The host side of a step's inputs: one persistent batch, updated in place for what changed since the last step.

`InputBatch` owns the numpy buffers of `sarathi_jax.runner.step_inputs` (the batch part, laid out for the largest
bucket, and the sampling part) and keeps them between steps. Row i of a step is its i-th scheduled chunk. A
row remembers which sequence it held and how much of that sequence's block table it has written, so a
steady decode costs a few Python operations per row and a handful of vectorised numpy ones per step:

  * rows: when every chunk's sequence sits in the row it held last step (the steady state), nothing moves.
    Otherwise each row is gathered from the row its sequence held (one fancy-index copy per field) and rows
    of sequences new to the batch are written from scratch (block table, sampling settings via
    `sampling_inputs.write_sampling_row`). A block table is known by its list object: the block manager
    only appends to a live table and gives a freed sequence a new list (`BlockManager.free`).
  * block tables: only the entries appended since the row last saw the table are written.
  * tokens: positions, slot mapping, token ids and pending-token rows are rebuilt for the bucket in a few
    vectorised operations (padding rewritten too), so every byte equals a fresh build's.
  * sampling: settings stay with their rows; per step only `steps` (and the banned ids, while some row is
    under its min_tokens) change. The sampler variant is recomputed only when rows change.

`prepare` returns copies of the two buffers (a step in flight must never see the next step's writes) and the
sampler variant. A pending input token (overlapped loop; a speculating chunk's first token too) is read on the
device from the previous step's sampled row, which this batch remembers too; a verified chunk's row is not
remembered (its sequence's next token is known only when the step retires), so reading it raises.

The sampling part is written here, for the runner and for one-off builds alike: `write_sampling_row` (a
request's settings into a row), `variant_of` (the cheapest exact `SamplerVariant` for the rows), and for a
plain list of rows `make_sampling_arrays` and `sampler_variant` (tests, the bench's sampler probe).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from sarathi_jax.runner.sample.inputs import (
    MAX_BANNED,
    SAMPLER_VARIANTS,
    SAMPLING_EPS,
    TOP_K_CANDIDATES,
    SamplerVariant,
    SamplingArrays,
    SamplingRow,
    empty_sampling_arrays,
)
from sarathi_jax.request.sampling_params import RequestSampling, SamplingParams
from sarathi_jax.request.sequence import ScheduledChunk
from sarathi_jax.request.sequence import Sequence as Seq
from sarathi_jax.runner.step_inputs import BatchLayout, PackedStep, pack_sampling, sampling_views

_U32_MASK = 0xFFFFFFFF
_F32_MAX = float(np.finfo(np.float32).max)


class InputBatch:
    """Step inputs for up to `max_num_seqs` rows and the largest of `buckets` tokens, kept between steps."""

    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int, block_size: int, buckets: Sequence[int]) -> None:
        s, b, max_num_tokens = max_num_seqs, max_blocks_per_seq, max(buckets)
        self.max_num_seqs, self.max_blocks_per_seq, self.block_size = s, b, block_size
        self._batch = BatchLayout(max_num_tokens, s, b).empty_batch()  # any bucket's part is a prefix of it
        v = BatchLayout(max_num_tokens, s, b).host_views(self._batch)
        self._kv_lens, self._cu_q_lens, self._num_seqs = v["kv_lens"], v["cu_q_lens"], v["num_seqs"]
        self._logits_indices, self._block_tables = v["logits_indices"], v["block_tables"]
        # bucket -> (its token fields' views, its batch part's length), laid out once
        self._token_views = {bucket: (layout.host_views(self._batch), layout.batch_len)
                             for bucket in buckets for layout in [BatchLayout(bucket, s, b)]}
        self._sampling = pack_sampling(empty_sampling_arrays(s))
        self._sv = sampling_views(self._sampling, s)
        # Per-row settings that travel with the row: banned ids (shipped only while step < min_tokens).
        self._static = empty_sampling_arrays(s)._replace(
            temperature=self._sv.temperature, top_k=self._sv.top_k, top_p=self._sv.top_p, min_p=self._sv.min_p,
            keys=self._sv.keys, num_logprobs=self._sv.num_logprobs,
        )
        self._min_tokens = np.zeros(s, np.int32)
        # Python side of each row: the sequence, its block table (the list object) and entries written.
        self._row_seq: list[Seq | None] = [None] * s
        self._row_table: list[list[int] | None] = [None] * s
        self._row_blocks = [0] * s
        self._num_rows = 0
        self._variant = SamplerVariant(False, "none", False)
        self._sampled_rows: dict[str, int] = {}  # the previous step: seq_id -> the row that sampled it
        self._arange = np.arange(max(max_num_tokens, s), dtype=np.int32)

    # ----------------------------------------------------------------------------------- one step

    def prepare(self, chunks: Sequence[ScheduledChunk], bucket: int,
                sampling_of: Callable[[Seq], RequestSampling]) -> tuple[PackedStep, SamplerVariant]:
        """The packed inputs (copies) of a step running `chunks` in `bucket` tokens, and its sampler variant.
        `sampling_of(seq)` is asked only for sequences new to a row."""
        n = len(chunks)
        if n > self.max_num_seqs:
            raise ValueError(f"{n} chunks exceed max_num_seqs={self.max_num_seqs}")
        row_seq, row_table = self._row_seq, self._row_table
        for i, chunk in enumerate(chunks):
            seq = chunk.seq
            if row_seq[i] is not seq or row_table[i] is not seq.block_table:
                self._move_rows(chunks, sampling_of)
                break
        else:
            if n < self._num_rows:
                self._clear_rows(n, self._num_rows)
                self._variant = variant_of(self._sv, n)
        self._num_rows = n

        # One pass over the rows (a steady decode costs a few list operations): what changed in the block
        # tables, and the per-row and per-token values, vectorised below.
        bt, row_blocks, bs = self._block_tables, self._row_blocks, self.block_size
        starts, lens, tokens, steps, pending = [], [], [], [], []
        prev_sampled_rows, sampled_rows = self._sampled_rows, {}
        offset = 0
        for i, chunk in enumerate(chunks):
            seq, start, num = chunk.seq, chunk.start_position, chunk.num_new_tokens
            table = seq.block_table
            if len(table) != row_blocks[i]:  # blocks appended since the row last saw the table
                bt[i, row_blocks[i] : len(table)] = table[row_blocks[i] :]
                row_blocks[i] = len(table)
            starts.append(start)
            lens.append(num)
            num_pending, drafts = seq.num_pending_tokens, chunk.draft_token_ids
            # seq.num_generated_tokens (+ k: a speculating chunk samples at its last draft's position)
            steps.append(len(seq.output_token_ids) + num_pending + len(drafts))
            offset += num
            token_ids = seq.token_ids
            if num == 1:
                tokens.append(token_ids[start])
            else:
                tokens += token_ids[start : start + num - len(drafts)]
                tokens += drafts
            known_end = start + num - len(drafts)  # drafts follow the sequence's last token
            if num_pending and known_end > len(token_ids) - num_pending:
                # Only the previous step's sample can be read on the device, and it is the sequence's last token.
                row = prev_sampled_rows.get(seq.seq_id)
                if num_pending != 1 or known_end != len(token_ids) or row is None:
                    raise RuntimeError(f"{seq!r}: a chunk reads a token that the previous step did not sample")
                pending.append((offset - 1 - len(drafts), row))
            if chunk.needs_sample and not drafts:  # a verified chunk's row holds its bonus token, not its next one
                sampled_rows[seq.seq_id] = i
        self._sampled_rows = sampled_rows

        # Per-row fields.
        starts_a = np.asarray(starts, np.int32)
        lens_a = np.asarray(lens, np.int32)
        cu = np.cumsum(lens_a, dtype=np.int32)
        num_tokens = int(cu[-1]) if n else 0
        if num_tokens > bucket:
            raise ValueError(f"a batch of {num_tokens} tokens exceeds its bucket {bucket}")
        self._kv_lens[:n] = starts_a + lens_a
        self._cu_q_lens[1 : n + 1] = cu
        self._cu_q_lens[n + 1 :] = num_tokens
        self._num_seqs[0] = n
        self._logits_indices[:n] = cu - 1

        # Token fields of this bucket, padding included.
        v, size = self._token_views[bucket]
        if num_tokens == n:  # decodes only (or prompts' last tokens): one token per row
            positions = starts_a
            token_rows = self._arange[:n]
        else:
            token_rows = np.repeat(self._arange[:n], lens_a)
            positions = self._arange[:num_tokens] + np.repeat(starts_a - (cu - lens_a), lens_a)
        v["positions"][:num_tokens] = positions
        v["positions"][num_tokens:] = 0
        v["slot_mapping"][:num_tokens] = bt[token_rows, positions // bs] * bs + positions % bs
        v["slot_mapping"][num_tokens:] = -1
        token_ids, src_rows = v["token_ids"], v["src_rows"]
        token_ids[:num_tokens] = tokens
        token_ids[num_tokens:] = 0
        src_rows[:] = -1
        for t, row in pending:  # token_ids held PENDING_TOKEN there
            token_ids[t] = 0
            src_rows[t] = row

        # Sampling: steps, and the banned ids of rows still under their min_tokens.
        sv = self._sv
        sv.steps[:n] = steps
        if self._min_tokens[:n].any():
            under = (sv.steps[:n] < self._min_tokens[:n])[:, None]
            sv.banned_token_ids[:n] = np.where(under, self._static.banned_token_ids[:n], -1)
        packed = PackedStep(self._batch[:size].copy(), self._sampling.copy())
        if len(chunks) and any(chunk.draft_token_ids for chunk in chunks):
            self._write_verify_rows(packed, chunks, cu)
        return packed, self._variant

    def _write_verify_rows(self, packed: PackedStep, chunks: Sequence[ScheduledChunk], cu: np.ndarray) -> None:
        """Speculative decoding, into the step's copies only: each speculating chunk's k verification rows
        after the chunk rows (`speculative.verify_rows`): row j is the chunk's own row, read at chunk token j
        (its step k - j earlier, min_tokens' banned ids as of that step)."""
        n, s = len(chunks), self.max_num_seqs
        counts = [chunk.num_draft_tokens for chunk in chunks]
        owner = np.repeat(np.arange(n), counts)  # the chunk of each verification row
        back = np.concatenate([np.arange(k, 0, -1) for k in counts if k])  # k - j
        rows = slice(n, n + len(owner))
        assert rows.stop <= s, "the scheduler keeps chunks + drafts <= max_num_seqs"
        layout = BatchLayout.of_packed(packed.batch.size, s, self.max_blocks_per_seq)
        logits = layout.host_views(packed.batch)["logits_indices"]
        logits[rows] = cu[owner] - 1 - back
        sv = sampling_views(packed.sampling, s)
        for field in sv:
            field[rows] = field[owner]
        sv.steps[rows] -= back
        under = (sv.steps[rows] < self._min_tokens[owner])[:, None]
        sv.banned_token_ids[rows] = np.where(under, self._static.banned_token_ids[owner], -1)

    # ----------------------------------------------------------------------------------- rows

    def _move_rows(self, chunks: Sequence[ScheduledChunk], sampling_of: Callable[[Seq], RequestSampling]) -> None:
        """Put each chunk's sequence in its row: gathered from the row it held (same block table), else
        written from scratch; rows past the batch become padding."""
        n, old_n = len(chunks), self._num_rows
        row_of = {id(seq): i for i, seq in enumerate(self._row_seq[:old_n])}
        src, fresh = np.zeros(n, np.intp), []
        for i, chunk in enumerate(chunks):
            seq = chunk.seq
            j = row_of.get(id(seq))
            if j is None or self._row_table[j] is not seq.block_table:
                fresh.append(i)
            else:
                src[i] = j
        sv, static = self._sv, self._static
        arrays = (self._block_tables, static.banned_token_ids, self._min_tokens, sv.temperature, sv.top_k,
                  sv.top_p, sv.min_p, sv.keys, sv.num_logprobs)
        for a in arrays:
            a[:n] = a[src]  # the right side is a copy: rows may swap
        blocks = [self._row_blocks[j] for j in src.tolist()]
        self._row_blocks[:n] = blocks
        self._clear_rows(n, max(n, old_n))
        for i, chunk in enumerate(chunks):
            self._row_seq[i], self._row_table[i] = chunk.seq, chunk.seq.block_table
        for i in fresh:
            seq = chunks[i].seq
            params, seed, banned = sampling_of(seq)
            write_sampling_row(static, i, params, seed, banned)
            self._min_tokens[i] = params.min_tokens if banned else 0
            self._block_tables[i] = 0
            self._row_blocks[i] = 0
        self._variant = variant_of(sv, n)
        if not self._min_tokens[:n].any():
            sv.banned_token_ids[:n] = -1

    def _clear_rows(self, start: int, end: int) -> None:
        """Rows start..end-1 become padding (as `make_sampling_arrays` pads: temperature -1, no work)."""
        if start >= end:
            return
        pad = empty_sampling_arrays(end - start)
        sv = self._sv
        for field, value in zip(SamplingArrays._fields, pad):
            getattr(sv, field)[start:end] = value
        self._static.banned_token_ids[start:end] = -1
        self._min_tokens[start:end] = 0
        self._block_tables[start:end] = 0
        self._kv_lens[start:end] = 0
        self._logits_indices[start:end] = 0
        for i in range(start, end):
            self._row_seq[i] = self._row_table[i] = None
            self._row_blocks[i] = 0


# ----------------------------------------------------------------------------------------------- sampling rows


def write_sampling_row(arrays: SamplingArrays, i: int, params: SamplingParams, seed: int, banned: Sequence[int]) -> None:
    """Row i's settings (all but `steps`) from a request's params, its seed and the ids it bans."""
    assert len(banned) <= MAX_BANNED, (len(banned), "admission caps the banned ids")
    # SamplingParams takes any finite temperature; one beyond float32's range would overflow to inf (with a
    # RuntimeWarning). The largest float32 samples as it would: 1/t underflows, the logits flatten, uniform.
    temperature = min(params.temperature, _F32_MAX)
    arrays.temperature[i] = temperature if temperature >= SAMPLING_EPS else 0.0
    arrays.top_k[i] = min(params.top_k, 2**31 - 1) if params.top_k > 0 else 0  # >= V is "off" anyway
    arrays.top_p[i] = params.top_p
    arrays.min_p[i] = params.min_p
    seed = int(seed) & 0xFFFFFFFFFFFFFFFF
    arrays.keys[i] = (seed >> 32, seed & _U32_MASK)
    arrays.num_logprobs[i] = -1 if params.logprobs is None else params.logprobs
    arrays.banned_token_ids[i] = -1
    arrays.banned_token_ids[i, : len(banned)] = banned


# (sampled, filter, logprobs) -> the variant: `variant_of` picks one of the fixed set, it builds none (a step
# with a token bitmask runs `sampling_inputs.constrained_variant` of it).
_VARIANTS = {(v.sampled, v.filter, v.logprobs): v for v in SAMPLER_VARIANTS if not v.constrained}


def variant_of(arrays: SamplingArrays, num_rows: int) -> SamplerVariant:
    """The cheapest variant that is exact for the first `num_rows` rows of `arrays`.

    Mirrors the device's per-row tests: sampled iff temperature >= SAMPLING_EPS (greedy rows hold 0); of the
    sampled rows, filter "exact" if one has top_p < 1 or top_k > TOP_K_CANDIDATES, else "top_k" if one has
    top_k > 0, else "none" (k >= V is "off" on device, which the host cannot see: it only costs time);
    logprobs iff some row asked for logprobs, N = 0 included: the variant also decides whether the step's
    logprobs reach the host, so a variant without them would leave an N = 0 row with none.
    """
    n = num_rows
    sampled = arrays.temperature[:n] >= SAMPLING_EPS
    logprobs = bool((arrays.num_logprobs[:n] >= 0).any())
    if not sampled.any():
        return _VARIANTS[False, "none", logprobs]
    top_k = arrays.top_k[:n][sampled]
    if ((arrays.top_p[:n][sampled] < 1.0) | (top_k > TOP_K_CANDIDATES)).any():
        return _VARIANTS[True, "exact", logprobs]
    return _VARIANTS[True, "top_k" if (top_k > 0).any() else "none", logprobs]


def make_sampling_arrays(rows: Sequence[SamplingRow], max_num_seqs: int) -> SamplingArrays:
    """Host-side numpy arrays for `sample`; rows past len(rows) are padding (temperature -1: no work, ignored).

    rows[i] = (params, seed, step, banned): `seed` is the request's seed (the engine draws one for unseeded
    requests when it queues them, so that a preempted-and-recomputed request resamples the same tokens), `step`
    its number of already generated tokens, `banned` the token ids to suppress this step (at most MAX_BANNED).
    The runner keeps these arrays row by row instead (`InputBatch`), through the same `write_sampling_row`.
    """
    n = len(rows)
    if n > max_num_seqs:
        raise ValueError(f"{n} sampling rows exceed max_num_seqs={max_num_seqs}")
    arrays = empty_sampling_arrays(max_num_seqs)
    for i, (params, seed, step, banned) in enumerate(rows):
        write_sampling_row(arrays, i, params, seed, banned)
        arrays.steps[i] = step
    return arrays


def sampler_variant(rows: Sequence[SamplingRow]) -> SamplerVariant:
    """The cheapest variant that is exact for these rows (the same rows `make_sampling_arrays` takes)."""
    return variant_of(make_sampling_arrays(rows, len(rows)), len(rows))
