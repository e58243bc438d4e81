"""`Batch`: the batch a scheduler policy builds, (sequence, tokens, is_prefill) items under a token and a sequence
limit. Plain Python, no JAX."""

from __future__ import annotations

from sarathi_jax.sequence import Sequence


class Batch:
    """A batch being built: (seq, num_new_tokens, is_prefill) items under a token and a sequence limit."""

    def __init__(self, token_limit: int, max_seqs: int) -> None:
        self.token_limit = token_limit
        self.max_seqs = max_seqs
        self.items: list[list] = []  # [seq, num_new_tokens, is_prefill]; lists so tile alignment can shrink
        self.seq_ids: set[str] = set()
        self.num_tokens = 0

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
