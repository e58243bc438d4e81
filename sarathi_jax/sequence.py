"""A request's host-side state: its tokens, how many of them have K/V in the cache, and its KV blocks.

Plain Python (no JAX): the schedulers, the engine, the tests and the simulator all share it.
"""

from __future__ import annotations

import enum

from sarathi_jax.outputs import RequestMetrics
from sarathi_jax.sampling_params import SamplingParams


# The value of a pending token in `Sequence.token_ids`: sampled on the device, not yet on the host.
PENDING_TOKEN = -1


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
        self, seq_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams, arrival_time: float
    ) -> None:
        self.seq_id = seq_id
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
        self.metrics = RequestMetrics(arrival_time=arrival_time)
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
