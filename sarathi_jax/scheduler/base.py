"""Scheduler base: queues, admission, KV allocation with preemption, rejection. Policies only pick the order.

Shared rules (every policy):
- Order (`SCHEDULING_POLICIES`): `waiting` and `running` are kept sorted by each request's order key: its
  arrival rank ("fcfs"), or (priority, arrival rank) ("priority", vLLM's meaning: a lower value first). Aging
  bounds a low-priority request's wait: `priority_max_wait_s` after its arrival (engine clock) its key becomes
  (PRIORITY_MIN, rank) for good, so no later arrival is admitted before it or preempts it (None: strict
  priority). "deadline": (tier, TTFT deadline, priority, rank), the deadline being arrival + `slo_ttft_s`
  (infinite without one: after every request that has one), tier 0: earliest deadline first, priority first
  among equal deadlines. Relegation: a request still without its first token when its deadline passes has
  missed its TTFT whatever happens next; its key moves to tier 1 for good, behind every request that can still
  meet its own, so under overload the requests that can be served in time are (a relegated one is still
  served, in deadline order, when they leave room). Admission takes the head of `waiting` and stops at the
  first request that does not fit (no skipping ahead); a preempted sequence goes back into `waiting` at its
  key's position. "Earliest"/"latest" below mean first/last in that order.
- At most `max_num_seqs` sequences are running (admitted) at once, and at most that many are in a batch.
- Admission never over-commits memory: a request is admitted only when the blocks for its whole
  (re-)prefill (or, for policies that reserve, its whole request) are free above the watermark, after what
  the running prefills still need. Growth of a running sequence may dip into the watermark.
- When a running sequence needs a block and none is free, the latest running sequence that is neither in
  this batch nor in flight is preempted by recompute (blocks freed, outputs kept, re-queued); if there is
  none later than the one growing, a decode preempts itself and a prefill chunk shrinks to fit (or waits).
- Pipeline parallelism: a sequence in an output not yet done ("in flight") is neither scheduled nor preempted.
- The overlapped loop (pipeline_parallel_size 1) calls `on_step_done` as soon as a batch is dispatched, so a
  sequence whose sampled token is still pending on the device (`Sequence.num_pending_tokens`) is scheduled
  again at once: its next decode reads that token on the device. A sequence whose outputs, pending ones
  included, already reach max_tokens is not scheduled again.
- Requests that could never run (past max_model_len or the KV cache) are refused by admission.
- Speculative decoding: draft tokens fill the room a policy's batch leaves (scheduler/speculation.py).
- Prefix caching (when the block manager has it on): a request admitted, or re-admitted after a preemption,
  takes the leading full blocks already cached (shared, reference counted) and starts computing after them,
  so every policy simply prefills less. Admission counts the blocks past that prefix, plus the cached ones it
  takes from the evictable pool (free until taken). A computed full block is registered in `on_step_done`
  (at dispatch in the overlapped loop: the device runs batches in order) or when its sequence is freed.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections import deque
from typing import TYPE_CHECKING, ClassVar, Protocol, runtime_checkable

from sarathi_jax.scheduler.block_manager import NO_HIT, BlockManager, PrefixHit
from sarathi_jax.request.sequence import PRIORITY_MIN, Batch, ScheduledChunk, SchedulerOutput, Sequence, SequenceStatus

if TYPE_CHECKING:
    from sarathi_jax.scheduler.speculation import Speculation

SCHEDULING_POLICIES: tuple[str, ...] = ("fcfs", "priority", "deadline")
OrderKey = int | tuple[int, int] | tuple[int, float, int, int]


@runtime_checkable
class SchedulerSettings(Protocol):
    """What a scheduler reads from its settings. `SchedulerConfig` (scheduler/config.py) is the one
    implementation; it sits above the policies, since it validates itself against their registry."""

    @property
    def policy(self) -> str: ...
    @property
    def token_budget(self) -> int: ...
    @property
    def max_num_seqs(self) -> int: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def tile_size(self) -> int | None: ...
    @property
    def watermark(self) -> float: ...
    @property
    def batch_token_limit(self) -> int: ...
    @property
    def scheduling_policy(self) -> str: ...
    @property
    def priority_max_wait_s(self) -> float | None: ...
    @property
    def max_prefill_share(self) -> float | None: ...


class Scheduler:
    """Base class. Subclasses set `name`, `admission`, `uses_token_budget` and `chunks_prompts` and implement
    `_schedule() -> Batch`."""

    name: ClassVar[str] = ""
    # KV blocks a request takes when admitted: "chunk" (just its first chunk; allocation then grows chunk by
    # chunk and decode by decode), "prompt" (the whole prompt, then grows per decode), "request" (prompt +
    # max_tokens, reserved up front so it never grows and is never preempted).
    admission: ClassVar[str] = "chunk"
    # What bounds a normal batch: `token_budget` (True) or `max_num_batched_tokens` (False: policies that put
    # whole prompts into a batch, which must hold the longest one). hybrid_batching_only: token_budget, except
    # an over-budget prompt that runs alone.
    uses_token_budget: ClassVar[bool] = True
    # Whether prompts are split into chunks under the token budget (False: a prompt runs whole, or from the end
    # of its cached prefix).
    chunks_prompts: ClassVar[bool] = True
    speculation: Speculation | None = None  # draft tokens in the room a batch leaves (scheduler/speculation.py)

    def __init__(self, config: SchedulerSettings, block_manager: BlockManager) -> None:
        self.config = config
        self.batch_token_limit = config.batch_token_limit  # read per batch: resolved once
        self.block_manager = block_manager
        # The config's watermark is a fraction; the block manager counts blocks. Keep the larger one.
        block_manager.watermark_blocks = max(
            block_manager.watermark_blocks, int(config.watermark * block_manager.num_total_blocks)
        )
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []  # kept in order (see _keys)
        self._seqs: dict[str, Sequence] = {}  # unfinished sequences by id
        self._keys: dict[str, OrderKey] = {}  # the order keys of the unfinished sequences (module docstring)
        self._ranks = itertools.count()
        self._by_priority = config.scheduling_policy == "priority"
        self._max_wait_s = config.priority_max_wait_s if self._by_priority else None
        # (aging time, rank, seq id) of the sequences not aged yet: a heap, so each step pops only those due.
        self._aging: list[tuple[float, int, str]] = []
        self._by_deadline = config.scheduling_policy == "deadline"
        # (TTFT deadline, rank, seq id) of the sequences not relegated yet ("deadline"): a heap, as _aging.
        self._deadlines: list[tuple[float, int, str]] = []
        self._in_flight: set[str] = set()  # seq ids in outputs whose on_step_done has not come yet
        self._preempted: list[Sequence] = []  # during one schedule() call
        self._num_preemptions = 0
        self._num_relegations = 0

    # ------------------------------------------------------------------------------------------ public API

    def add_sequence(self, seq: Sequence) -> None:
        if seq.seq_id in self._seqs:
            raise ValueError(f"sequence id {seq.seq_id!r} is already scheduled")
        # Admission's guarantee (sarathi_jax/core/admission.py), asserted: a request past these limits would wait forever.
        bm = self.block_manager
        assert (0 < seq.num_prompt_tokens and seq.max_total_tokens <= self.config.max_model_len
                and bm.blocks_for_tokens(seq.max_total_tokens) <= bm.num_total_blocks - bm.watermark_blocks), seq
        self._seqs[seq.seq_id] = seq
        rank = next(self._ranks)
        self._keys[seq.seq_id] = self._new_key(seq, rank)
        if self._max_wait_s is not None and seq.priority > PRIORITY_MIN:
            heapq.heappush(self._aging, (seq.metrics.arrival_time + self._max_wait_s, rank, seq.seq_id))
        # A sequence that arrives with its prompt's K/V in blocks it holds here (the decode instance of a
        # disaggregated engine, sarathi_jax/disagg/sim_engine.py: the caller reserved them) runs as a decode at once.
        prefilled = seq.num_computed_tokens > 0
        seq.status = SequenceStatus.RUNNING if prefilled else SequenceStatus.WAITING
        self._insert(self._running if prefilled else self._waiting, seq)

    def abort_sequence(self, seq_id: str) -> Sequence | None:
        """Remove a sequence in any state and free its blocks now. None if unknown or already finished."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            return None
        self.finish_sequence(seq, "abort")
        return seq

    def finish_sequence(self, seq: Sequence, reason: str) -> None:
        """Mark `seq` finished (engine: a stop condition hit), free its blocks and forget it."""
        if self._seqs.pop(seq.seq_id, None) is not None:
            if seq.status is SequenceStatus.RUNNING:
                self._running.remove(seq)
            else:
                self._waiting.remove(seq)
            del self._keys[seq.seq_id]  # its aging entry, if any, is skipped when it comes due
        self._in_flight.discard(seq.seq_id)
        self.block_manager.free(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason

    def schedule(self, now: float | None = None) -> SchedulerOutput:
        """The next batch. `now`: the engine's clock, for aging under the priority policy and relegation under
        the deadline policy (None: neither)."""
        self._preempted = []
        if now is not None and (self._age(now) | self._relegate(now)):
            for queue in (self._waiting, self._running):
                items = sorted(queue, key=self._key_of)
                queue.clear()
                queue.extend(items)
        batch = self._schedule()
        drafts = (self.speculation.extend(batch, self.block_manager, self.config.max_num_seqs, bool(self._preempted))
                  if self.speculation is not None else {})  # after the policy, in the room it left
        chunks = tuple([ScheduledChunk(seq, n, seq.num_computed_tokens, not prefill, drafts.get(seq.seq_id, ()))
                        for seq, n, prefill in batch.items])
        self._in_flight |= batch.seq_ids
        return SchedulerOutput.of(chunks, preempted=tuple(self._preempted), token_limit=batch.token_limit,
                                  prediction=batch.prediction)

    def on_step_done(self, output: SchedulerOutput) -> None:
        """The batch ran: its tokens' K/V are in the cache. Call before appending sampled tokens."""
        in_flight, running = self._in_flight, SequenceStatus.RUNNING
        cache_full_blocks = self.block_manager.cache_full_blocks
        for chunk in output.chunks:
            seq = chunk.seq
            in_flight.discard(seq.seq_id)
            if seq.status is running:  # skip sequences aborted while in flight
                assert seq.num_computed_tokens == chunk.start_position, (seq, chunk.start_position)
                seq.num_computed_tokens += chunk.num_new_tokens - chunk.num_draft_tokens  # drafts: at retirement
                cache_full_blocks(seq)

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_preemptions(self) -> int:
        return self._num_preemptions

    def stats(self) -> dict:
        """Queue and KV-cache occupancy: what engines, servers and benchmarks report."""
        bm = self.block_manager
        return {
            "num_running": self.num_running,
            "num_waiting": self.num_waiting,
            "num_free_blocks": bm.num_free_blocks,
            "num_total_blocks": bm.num_total_blocks,
            "kv_cache_usage": bm.num_used_blocks / bm.num_total_blocks,
            "num_preemptions": self.num_preemptions,
            "num_relegations": self._num_relegations,  # "deadline": requests that missed their TTFT, cumulative
            "prefix_cache_queries": bm.num_prefix_queries,  # tokens, cumulative (vLLM's counters)
            "prefix_cache_hits": bm.num_prefix_hits,
        }

    @property
    def running(self) -> tuple[Sequence, ...]:
        """Admitted sequences, in order (earliest first)."""
        return tuple(self._running)

    @property
    def waiting(self) -> tuple[Sequence, ...]:
        """Queued sequences in admission order."""
        return tuple(self._waiting)

    def is_in_flight(self, seq: Sequence) -> bool:
        return seq.seq_id in self._in_flight

    # ------------------------------------------------------------------------------------------ policy hook

    def _schedule(self) -> Batch:
        raise NotImplementedError

    # ------------------------------------------------------------------------------------------ building blocks

    def _age(self, now: float) -> bool:
        """Give PRIORITY_MIN to the sequences that arrived at least `max_wait_s` before `now`: True if any."""
        changed, aging, keys = False, self._aging, self._keys
        while aging and aging[0][0] <= now:
            _, rank, seq_id = heapq.heappop(aging)
            key = keys.get(seq_id)
            if key is not None and key[1] == rank:  # not finished (an id may be reused by a later request)
                keys[seq_id] = (PRIORITY_MIN, rank)
                changed = True
        return changed

    def _new_key(self, seq: Sequence, rank: int) -> OrderKey:
        """A new sequence's order key (module docstring); "deadline" also queues its relegation."""
        if self._by_deadline:
            slo = seq.metrics.slo_ttft_s
            deadline = math.inf if slo is None else seq.metrics.arrival_time + slo
            if deadline < math.inf and not seq.num_generated_tokens:
                heapq.heappush(self._deadlines, (deadline, rank, seq.seq_id))
            return (0, deadline, seq.priority, rank)
        return (seq.priority, rank) if self._by_priority else rank

    def _relegate(self, now: float) -> bool:
        """Move to tier 1 the sequences whose TTFT deadline is at or before `now` and that have no token yet:
        True if any."""
        changed, due, keys, seqs = False, self._deadlines, self._keys, self._seqs
        while due and due[0][0] <= now:
            _, rank, seq_id = heapq.heappop(due)
            key, seq = keys.get(seq_id), seqs.get(seq_id)
            if key is not None and key[3] == rank and not seq.num_generated_tokens:  # not finished, no token yet
                keys[seq_id] = (1, *key[1:])
                self._num_relegations += 1
                changed = True
        return changed

    def _insert(self, queue: list[Sequence] | deque[Sequence], seq: Sequence) -> None:
        bisect.insort(queue, seq, key=self._key_of)  # keys are unique (the rank): one place for it

    def _key_of(self, seq: Sequence) -> OrderKey:
        return self._keys[seq.seq_id]

    def _new_batch(self, token_limit: int | None = None) -> Batch:
        return Batch(self.batch_token_limit if token_limit is None else token_limit, self.config.max_num_seqs)

    def _ready_running(self) -> tuple[list[Sequence], list[Sequence]]:
        """Running sequences that may be scheduled now, earliest arrival first, as (decodes, prefills): not in
        flight, and not already holding (with pending tokens) all max_tokens outputs, which only wait for the
        host to finish them. A snapshot: entries may get preempted while the caller iterates, so callers
        re-check `status` (scheduling, preemption aside, changes neither readiness nor `is_decode`)."""
        decodes, prefills, in_flight = [], [], self._in_flight
        for s in self._running:
            if s.seq_id not in in_flight and s.num_tokens < s.max_total_tokens:
                (decodes if s.is_decode else prefills).append(s)
        return decodes, prefills

    def _schedule_decodes(self, batch: Batch, decodes: list[Sequence] | None = None) -> None:
        """Every ready running decode (`decodes`: from `_ready_running()`, taken now if None), earliest arrival
        first; one that cannot get a block preempts later arrivals, or itself when there are none."""
        bm, block_size, running = self.block_manager, self.block_manager.block_size, SequenceStatus.RUNNING
        # A decode takes one token and one sequence slot, and only the decodes below change the batch.
        slots = min(batch.room, batch.max_seqs - len(batch.items))
        for seq in self._ready_running()[0] if decodes is None else decodes:
            if seq.status is not running:
                continue
            if slots < 1:
                break
            # Most decodes write into their last block; only every block_size-th one needs a new block.
            if len(seq.block_table) * block_size <= seq.num_computed_tokens:
                if not self._make_room(seq, bm.blocks_needed(seq, seq.num_computed_tokens + 1), batch):
                    self._preempt(seq)
                    continue
                bm.allocate(seq, seq.num_computed_tokens + 1)
            batch.add(seq, 1, is_prefill=False)
            slots -= 1

    def _schedule_running_prefills(self, batch: Batch, prefills: list[Sequence] | None = None, *,
                                   chunked: bool) -> None:
        """Running sequences still (re-)prefilling (`prefills`: from `_ready_running()`, taken now if None),
        earliest first. chunked: each gets min(left, room) tokens, shrunk to what memory allows; otherwise
        whole or not at all (stopping at the first misfit)."""
        cap = self._chunk_cap(batch) if chunked else batch.token_limit
        for seq in self._ready_running()[1] if prefills is None else prefills:
            if seq.status is not SequenceStatus.RUNNING:
                continue
            if batch.room < 1 or not batch.has_seq_room:
                break
            want = seq.num_uncomputed_tokens
            if chunked:
                want = min(want, batch.room, cap)
            elif want > batch.room:
                break
            n = self._grow_prefill(seq, want, batch, shrink_ok=chunked)
            if n:
                batch.add(seq, n, is_prefill=True)

    def _admit(self, batch: Batch, *, chunked: bool) -> int:
        """Admit waiting requests FCFS into `batch` (first chunk, or whole prompt) while room, sequence limits
        and memory allow. Returns how many were admitted.

        Memory: admitted only if the blocks it needs up front ("prompt": its (re-)prefill; "request": prompt +
        max_tokens; "chunk": allocated chunk by chunk but counted whole, plus what running prefills still need,
        so admitted prompts finish without evicting each other) are free above the watermark. A cached prefix is
        neither computed nor counted, except cached blocks nobody holds now.
        """
        if not self._admission_open(batch):
            return 0  # the usual case once requests run: skip the sum over the running sequences below
        bm = self.block_manager
        cap = self._chunk_cap(batch) if chunked else batch.token_limit
        committed = 0
        if self.admission == "chunk":
            committed = sum(bm.blocks_needed(s, s.num_tokens) for s in self._running if not s.is_decode)
        admitted = 0
        while self._admission_open(batch):
            seq = self._waiting[0]
            hit = bm.match_prefix(seq)  # a waiting sequence has nothing computed: it starts after its cached prefix
            tokens = seq.num_tokens - hit.num_tokens
            n = min(tokens, batch.room, cap) if chunked else tokens
            if n < 1 or n > batch.room:
                break
            reserve = seq.max_total_tokens if self.admission == "request" else seq.num_tokens
            need = self._admission_blocks(reserve, hit)
            if need > bm.num_free_blocks - bm.watermark_blocks - committed:
                break
            if self.admission == "chunk":
                reserve = hit.num_tokens + n  # allocate just this chunk; the rest of its prefill stays committed
                committed += bm.blocks_for_tokens(tokens) - bm.blocks_for_tokens(n)
            self._admit_seq(seq, reserve, hit)
            batch.add(seq, n, is_prefill=True)
            admitted += 1
        return admitted

    def _chunk_cap(self, batch: Batch) -> int:
        """The most tokens one request's prefill chunk may take in `batch`: `max_prefill_share` of its token limit
        while more than one request has a prompt to prefill (waiting, or running and not yet decoding), so that
        one long prompt does not hold the prefill share while short ones queue; else the whole limit."""
        share = self.config.max_prefill_share
        if share is None:
            return batch.token_limit
        wanting = len(self._waiting) + sum(1 for s in self._running if not s.is_decode)
        return max(1, int(share * batch.token_limit)) if wanting > 1 else batch.token_limit

    def _admission_open(self, batch: Batch) -> bool:
        """A waiting request could be admitted into `batch` as far as the queue and the sequence limits go."""
        return bool(self._waiting) and batch.has_seq_room and len(self._running) < self.config.max_num_seqs

    def _admission_blocks(self, reserve_tokens: int, hit: PrefixHit) -> int:
        """Free blocks that admitting a sequence for `reserve_tokens` takes: new blocks past its cached
        prefix, plus the cached blocks it revives from the evictable pool (those count as free until taken)."""
        return self.block_manager.blocks_for_tokens(reserve_tokens - hit.num_tokens) + hit.num_evictable

    def _admit_seq(self, seq: Sequence, reserve_tokens: int, hit: PrefixHit = NO_HIT) -> None:
        """Move the head of `waiting` to running with its cached prefix `hit` and blocks for `reserve_tokens`
        (caller checked memory); its computation starts after the prefix."""
        assert self._waiting[0] is seq
        self._waiting.popleft()
        self.block_manager.acquire_prefix(seq, hit)
        seq.num_computed_tokens = hit.num_tokens
        self.block_manager.allocate(seq, reserve_tokens)
        seq.status = SequenceStatus.RUNNING
        self._insert(self._running, seq)

    def _grow_prefill(self, seq: Sequence, want: int, batch: Batch, *, shrink_ok: bool) -> int:
        """Give a running prefill blocks for `want` more tokens (preempting later arrivals if needed), or
        with shrink_ok as many as fit. Returns the tokens it can run (0: none)."""
        bm = self.block_manager
        if not self._make_room(seq, bm.blocks_needed(seq, seq.num_computed_tokens + want), batch):
            if not shrink_ok:
                return 0
            capacity = (len(seq.block_table) + bm.num_free_blocks) * bm.block_size - seq.num_computed_tokens
            want = min(want, capacity)
            if want < 1:
                return 0
        bm.allocate(seq, seq.num_computed_tokens + want)
        return want

    def _make_room(self, seq: Sequence, num_blocks: int, batch: Batch) -> bool:
        """Ensure `num_blocks` free blocks for a running `seq` (watermark ignored), preempting the latest
        arrivals after it that are neither in `batch` nor in flight. False if that is not enough."""
        while not self.block_manager.can_allocate(num_blocks, use_watermark=False):
            victim = self._pick_victim(seq, batch)
            if victim is None:
                return False
            self._preempt(victim)
        return True

    def _pick_victim(self, seq: Sequence, batch: Batch) -> Sequence | None:
        for cand in reversed(self._running):  # latest arrival first
            if cand is seq:
                return None  # only later arrivals are evicted for seq
            # One holding all its outputs (a pending one included, in the overlapped loop) frees its blocks
            # when the host finishes it; evicting it would queue a recompute of tokens nobody will use.
            if (cand.seq_id not in batch.seq_ids and cand.seq_id not in self._in_flight
                    and cand.num_tokens < cand.max_total_tokens):
                return cand
        return None

    def _preempt(self, seq: Sequence) -> None:
        """Preemption by recompute: free blocks, keep outputs, re-queue at its arrival position."""
        assert seq.seq_id not in self._in_flight
        self._running.remove(seq)
        self.block_manager.free(seq)
        seq.reset_for_recompute()
        self._insert(self._waiting, seq)
        self._preempted.append(seq)
        self._num_preemptions += 1
