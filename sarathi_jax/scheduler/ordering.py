"""The order of requests in the scheduler's queues: one key per unfinished sequence.

Two scheduling policies (`SCHEDULING_POLICIES`, `EngineConfig.scheduling_policy`):
- "fcfs": the key is the arrival rank (the order of `Scheduler.add_sequence`).
- "priority" (vLLM's meaning): the key is (priority, arrival rank); a lower priority value is served first,
  ties in arrival order. Aging bounds the wait of a low-priority request: once `max_wait_s` seconds have
  passed since its arrival (on the engine's clock), its key becomes (PRIORITY_MIN, arrival rank), the most
  urgent priority there is, for the rest of its life. From then on no request that arrived after it is
  admitted before it, nor preempts it; it is behind only earlier arrivals that aged too, or that asked for
  PRIORITY_MIN themselves. `max_wait_s=None`: no aging (strict priority, as vLLM).

Every queue of the scheduler (waiting, running) is kept sorted by this key, so admission takes the head of
`waiting`, running prefills are served in key order, and preemption takes the running sequence with the
largest key (lowest priority, latest arrival) first. Plain Python.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque

from sarathi_jax.sequence import Sequence

SCHEDULING_POLICIES: tuple[str, ...] = ("fcfs", "priority")
# The range a priority may take: a signed 32-bit integer, as the gRPC field carries it.
PRIORITY_MIN, PRIORITY_MAX = -(2**31), 2**31 - 1

OrderKey = int | tuple[int, int]


class RequestOrder:
    """The order keys of a scheduler's unfinished sequences, by seq id (`keys`: compare them with <)."""

    def __init__(self, scheduling_policy: str, max_wait_s: float | None) -> None:
        if scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {scheduling_policy!r}")
        self.by_priority = scheduling_policy == "priority"
        self.max_wait_s = max_wait_s if self.by_priority else None
        self.keys: dict[str, OrderKey] = {}
        self._counter = itertools.count()
        # (aging time, rank, seq id) of sequences not aged yet: a heap, so each step pops only those due.
        self._aging: list[tuple[float, int, str]] = []

    def add(self, seq: Sequence) -> None:
        rank = next(self._counter)
        if not self.by_priority:
            self.keys[seq.seq_id] = rank
            return
        self.keys[seq.seq_id] = (seq.priority, rank)
        if self.max_wait_s is not None and seq.priority > PRIORITY_MIN:
            heapq.heappush(self._aging, (seq.metrics.arrival_time + self.max_wait_s, rank, seq.seq_id))

    def remove(self, seq_id: str) -> None:
        del self.keys[seq_id]  # its aging entry, if any, is skipped when it comes due

    def age(self, now: float) -> bool:
        """Give the most urgent priority to the sequences that arrived at least `max_wait_s` before `now`.
        True when a key changed (the caller re-sorts its queues)."""
        changed, aging, keys = False, self._aging, self.keys
        while aging and aging[0][0] <= now:
            _, rank, seq_id = heapq.heappop(aging)
            key = keys.get(seq_id)
            if key is not None and key[1] == rank:  # not finished (an id may be reused by a later request)
                keys[seq_id] = (PRIORITY_MIN, rank)
                changed = True
        return changed

    def insert(self, queue: list[Sequence] | deque[Sequence], seq: Sequence) -> None:
        """Insert `seq` into `queue` (sorted by key) at its key's position."""
        keys = self.keys
        key, i = keys[seq.seq_id], len(queue)
        while i > 0 and keys[queue[i - 1].seq_id] > key:  # from the back: admissions are usually latest
            i -= 1
        queue.insert(i, seq)

    def sort(self, queue: list[Sequence] | deque[Sequence]) -> None:
        """Re-sort `queue` in place after keys changed (`age`)."""
        items = sorted(queue, key=lambda s: self.keys[s.seq_id])
        queue.clear()
        queue.extend(items)
