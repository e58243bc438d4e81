"""A request's host-side state (`Sequence`: its tokens, how many of them have K/V in the cache, its KV blocks),
and the runs of its tokens that one step computes (`ScheduledChunk`; a step's chunks: `SchedulerOutput`, what
`Scheduler.schedule()` hands the engine, built as a `Batch`).

Plain Python (no JAX): the schedulers, the engine, the runner, the tests and the simulator all share it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from sarathi_jax.request.outputs import IterationRecord, RequestMetrics
from sarathi_jax.request.sampling_params import SamplingParams


# The value of a pending token in `Sequence.token_ids`: sampled on the device, not yet on the host.
PENDING_TOKEN = -1
# The range a request's priority may take: a signed 32-bit integer, as the gRPC field carries it.
PRIORITY_MIN, PRIORITY_MAX = -(2**31), 2**31 - 1


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued: never scheduled, or preempted (by recompute) and re-queued
    RUNNING = "running"  # admitted: holds KV blocks
    FINISHED = "finished"


class Sequence:
    """One request. `num_computed_tokens` counts the tokens whose K/V are in the cache.

    Each step the scheduler picks `num_new_tokens <= num_uncomputed_tokens` query tokens starting at
    `num_computed_tokens`; a chunk that reaches `num_tokens` samples the next token. Prompt chunks, decodes
    and the re-prefill after a preemption all go through that one rule.

    Pending tokens (the overlapped engine loop): when a step that samples for this sequence is dispatched, a
    placeholder (`PENDING_TOKEN`) is appended at once, so the next step can be scheduled before the sampled
    value reaches the host; the model runner feeds that position from the device. `resolve_pending_token`
    fills the oldest placeholder in when the step retires. `output_token_ids` holds resolved tokens only;
    `token_ids` and `num_tokens` include the placeholders.
    """

    def __init__(
        self, seq_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams, arrival_time: float,
        priority: int = 0,
        slo_ttft_s: float | None = None,
        slo_tbt_s: float | None = None,
    ) -> None:
        self.seq_id = seq_id
        self.priority = priority  # lower is served first under scheduling_policy="priority" (scheduler/base.py)
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.sampling_params = sampling_params
        # Fixed for the sequence's life, and read several times per step: plain attributes, not properties.
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.max_total_tokens = self.num_prompt_tokens + sampling_params.max_tokens  # stop conditions aside
        self.num_computed_tokens = 0
        self.block_table: list[int] = []  # owned by the BlockManager: only it grows it or replaces it (on free)
        # Prefix caching, also the BlockManager's: content hashes of the leading full blocks of known tokens
        # (kept across preemption: the tokens do not change), and how many table entries it has registered.
        self.block_hashes: list[bytes] = []
        self.num_registered_blocks = 0
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.error_param: str | None = None  # RequestOutput.error_param
        # The request's SLO targets live with its timestamps (outputs report whether they were met); the
        # dynamic token budget reads slo_tbt_s of running requests (scheduler/budget.py).
        self.metrics = RequestMetrics(arrival_time=arrival_time, slo_ttft_s=slo_ttft_s, slo_tbt_s=slo_tbt_s)
        # Prompt + output (+ placeholders) in one list so `token_ids` costs nothing (the runner slices it).
        self._token_ids = list(self.prompt_token_ids)
        self._num_pending = 0

    @property
    def token_ids(self) -> list[int]:
        """Prompt + output tokens. The live list, not a copy: read it, do not mutate it."""
        return self._token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._token_ids)

    @property
    def num_pending_tokens(self) -> int:
        """Sampled tokens dispatched but not yet known on the host (placeholders at the end of `token_ids`)."""
        return self._num_pending

    @property
    def num_generated_tokens(self) -> int:
        """Output tokens including pending ones: the sampling step index of the next token."""
        return len(self.output_token_ids) + self._num_pending

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self._token_ids) - self.num_computed_tokens

    @property
    def is_decode(self) -> bool:
        """Past its (re-)prefill: exactly the last sampled token still needs its K/V computed. (A prompt whose
        last token alone is left, after chunks or a cached prefix, is still prefilling.)"""
        computed = self.num_computed_tokens
        return computed >= self.num_prompt_tokens and len(self._token_ids) - computed == 1

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        """Append a known token (no placeholder outstanding)."""
        assert not self._num_pending, "resolve the pending tokens first"
        self.output_token_ids.append(token_id)
        self._token_ids.append(token_id)

    def append_pending_token(self) -> None:
        """A step that samples this sequence's next token was dispatched; its value is not known yet."""
        self._token_ids.append(PENDING_TOKEN)
        self._num_pending += 1

    def resolve_pending_token(self, token_id: int) -> None:
        """The oldest pending token's value arrived."""
        assert self._num_pending > 0, f"{self.seq_id!r} has no pending token"
        self._token_ids[len(self.output_token_ids) + self.num_prompt_tokens] = token_id
        self.output_token_ids.append(token_id)
        self._num_pending -= 1

    def accept_draft_token(self) -> None:
        """Speculative decoding: the last token (resolved) equals the draft whose K/V the verified chunk
        computed, so it counts as computed, and the target's next token is pending (resolved next)."""
        assert not self._num_pending and self.num_computed_tokens == len(self._token_ids) - 1, self
        self.num_computed_tokens += 1
        self.append_pending_token()

    def discard_pending_tokens(self) -> None:
        """Finished: tokens sampled for it after its last one are dropped, never emitted."""
        if self._num_pending:
            del self._token_ids[len(self._token_ids) - self._num_pending :]
            self._num_pending = 0
            self.num_computed_tokens = min(self.num_computed_tokens, len(self._token_ids))

    def reset_for_recompute(self) -> None:
        """Preemption by recompute: the cache contents are dropped (the caller frees the blocks first),
        generated tokens are kept and will be re-prefilled together with the prompt."""
        assert not self.block_table, "free the sequence's blocks before resetting it"
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING
        self.metrics.num_preemptions += 1

    def __repr__(self) -> str:
        return (
            f"Sequence({self.seq_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, pending={self._num_pending}, computed={self.num_computed_tokens}, blocks={len(self.block_table)})"
        )


class ScheduledChunk:
    """`num_new_tokens` query tokens of `seq`, at positions start_position .. start_position+num_new_tokens-1.

    `needs_sample` and `is_decode` are fixed at schedule time (the sequence keeps changing afterwards).
    `decode`: whether the scheduler ran it as a decode; None derives it from the shape (one sampled token
    after others), which a prompt's last token after a cached prefix also has.
    `draft_token_ids` (speculative decoding, a decode only): k proposed tokens after the sequence's last one;
    they are not the sequence's tokens, and `num_new_tokens` counts them (1 + k: what the step computes).

    Read-only by convention. A plain `__slots__` class, not a frozen dataclass: the scheduler makes one per
    sequence per step, and enforced immutability would cost more than the rest of building it.
    """

    __slots__ = ("seq", "num_new_tokens", "start_position", "needs_sample", "is_decode", "draft_token_ids")

    def __init__(self, seq: Sequence, num_new_tokens: int, start_position: int, decode: bool | None = None,
                 draft_token_ids: tuple[int, ...] = ()) -> None:
        num_tokens = seq.num_tokens + len(draft_token_ids)
        end = start_position + num_new_tokens
        if num_new_tokens < 1 or end > num_tokens or (draft_token_ids and (end != num_tokens or decode is False)):
            raise ValueError(f"bad chunk for {seq!r}: {num_new_tokens} tokens at {start_position}, "
                             f"{len(draft_token_ids)} drafts")
        self.seq = seq
        self.num_new_tokens = num_new_tokens
        self.start_position = start_position
        self.needs_sample = end == num_tokens
        self.draft_token_ids = draft_token_ids
        if decode is None:
            decode = start_position > 0 and num_new_tokens == 1 + len(draft_token_ids) and self.needs_sample
        self.is_decode = decode

    @property
    def num_draft_tokens(self) -> int:
        return len(self.draft_token_ids)

    def __repr__(self) -> str:
        return (f"ScheduledChunk(seq={self.seq!r}, num_new_tokens={self.num_new_tokens}, start_position="
                f"{self.start_position}, needs_sample={self.needs_sample}, is_decode={self.is_decode}, "
                f"draft_token_ids={self.draft_token_ids})")


@dataclass(frozen=True)
class SchedulerOutput:
    """One batch.

    chunks: the work of this iteration, in a fixed order (the runner packs them in this order).
    preempted: sequences evicted (by recompute) while building this batch; they are back in the waiting queue.
    token_limit: the token limit the batch was built under (the budget; "dynamic": this iteration's).
    predicted_s, slack_s: the budget policy's predicted time of the batch, and the part of it that is the
        measured slack added to the cost model's (None: no policy predicts it).
    """

    chunks: tuple[ScheduledChunk, ...] = ()
    preempted: tuple[Sequence, ...] = ()
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    token_limit: int | None = None
    predicted_s: float | None = None
    slack_s: float | None = None

    @classmethod
    def of(cls, chunks: tuple[ScheduledChunk, ...], *, preempted: tuple[Sequence, ...] = (),
           token_limit: int | None = None, prediction: tuple[float, float] | None = None) -> SchedulerOutput:
        """The output for `chunks`, with its prefill / decode token counts."""
        num_decode = sum([c.num_new_tokens for c in chunks if c.is_decode])  # a decode's drafts count as decode
        num_prefill = sum([c.num_new_tokens for c in chunks]) - num_decode
        predicted_s, slack_s = prediction or (None, None)
        return cls(chunks, preempted, num_prefill, num_decode, token_limit, predicted_s, slack_s)

    @property
    def num_batched_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def is_empty(self) -> bool:
        """No work to run (there may still be preempted sequences to report)."""
        return not self.chunks

    def iteration_record(self, iteration: int, start: float, end: float, num_padded_tokens: int) -> IterationRecord:
        """The record of this batch, run from `start` to `end` in `num_padded_tokens` (its bucket)."""
        return IterationRecord(
            iteration=iteration,
            start_time=start,
            duration=end - start,
            num_prefill_tokens=self.num_prefill_tokens,
            num_decode_tokens=self.num_decode_tokens,
            num_seqs=len(self.chunks),
            chunk_sizes=tuple(c.num_new_tokens for c in self.chunks if not c.is_decode),
            num_preemptions=len(self.preempted),
            num_padded_tokens=num_padded_tokens,
            token_limit=self.token_limit,
            predicted_s=self.predicted_s,
            slack_s=self.slack_s,
        )


class Batch:
    """A batch being built: (seq, num_new_tokens, is_prefill) items under a token and a sequence limit."""

    def __init__(self, token_limit: int, max_seqs: int) -> None:
        self.token_limit = token_limit
        self.max_seqs = max_seqs
        self.items: list[list] = []  # [seq, num_new_tokens, is_prefill]; lists so tile alignment can shrink
        self.seq_ids: set[str] = set()
        self.num_tokens = 0
        # The budget policy's (predicted seconds, of which measured slack) for this batch, when it has one.
        self.prediction: tuple[float, float] | None = None

    @property
    def room(self) -> int:
        return self.token_limit - self.num_tokens

    @property
    def has_seq_room(self) -> bool:
        return len(self.items) < self.max_seqs

    def add(self, seq: Sequence, num_new_tokens: int, *, is_prefill: bool) -> None:
        seq_id = seq.seq_id
        assert 0 < num_new_tokens <= self.token_limit - self.num_tokens and len(self.items) < self.max_seqs
        assert seq_id not in self.seq_ids
        self.items.append([seq, num_new_tokens, is_prefill])
        self.seq_ids.add(seq_id)
        self.num_tokens += num_new_tokens

    def __bool__(self) -> bool:
        return bool(self.items)
