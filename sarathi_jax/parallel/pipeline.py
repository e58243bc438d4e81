"""Per-stage timing of pipelined micro-batches: busy time, bubble fraction, micro-batches in flight.

For every micro-batch the runner records, per stage, the host time the stage's computation was dispatched
(`jit` returns at once: dispatch is asynchronous) and the time its output became ready. Ready times are
taken by one helper thread per stage that calls `block_until_ready` on the stage's outputs in micro-batch
order (a stage runs its micro-batches in order, so waiting in order loses nothing; the threads wait with the
GIL released).

Busy time is an estimate from these timestamps: stage s starts micro-batch i at
`max(dispatch[s][i], ready[s-1][i], ready[s][i-1])` (its call was issued, its input activations arrived,
and it finished the previous micro-batch) and ends at `ready[s][i]`; the difference counts as busy (it
includes the activation transfer into the stage). Then

    bubble_fraction = 1 - sum(busy) / (num_stages * wall),   wall = last ready - first dispatch

so host time with nothing dispatched (scheduling, sampling post-processing, an empty queue) counts as bubble
on every stage, as it should. On virtual CPU devices that share cores these figures show the mechanism
(overlap, idle stages), not real speed.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import jax


@dataclass
class MicrobatchRecord:
    index: int
    num_tokens: int  # the bucket it ran at
    dispatch: list[float] = field(default_factory=list)  # per stage
    ready: list[float | None] = field(default_factory=list)  # per stage; None until the helper saw it
    retired: float | None = None  # when the engine took its result


def _watch(q: queue.Queue) -> None:
    while True:
        item = q.get()
        if item is None:
            q.task_done()
            return
        record, stage, outputs = item
        try:
            jax.block_until_ready(outputs)
        finally:
            record.ready[stage] = time.monotonic()
            q.task_done()


class PipelineTimeline:
    """Records dispatch/ready times of each stage of each micro-batch (see the module docstring)."""

    def __init__(self, num_stages: int) -> None:
        self.num_stages = num_stages
        self.records: list[MicrobatchRecord] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self._queues = [queue.Queue() for _ in range(num_stages)]
        self._threads: list[threading.Thread] = []
        # Stop the helpers when the timeline goes away, or at exit (finalize runs atexit), so that no helper
        # is left inside the JAX runtime while the interpreter shuts down.
        self._finalizer = weakref.finalize(self, _stop_threads, self._queues, self._threads)

    def _ensure_threads(self) -> None:
        if not self._threads:
            for s, q in enumerate(self._queues):
                t = threading.Thread(target=_watch, args=(q,), name=f"pipeline-stage-{s}-watch", daemon=True)
                t.start()
                self._threads.append(t)

    def begin(self, num_tokens: int) -> MicrobatchRecord:
        self._ensure_threads()
        record = MicrobatchRecord(len(self.records), num_tokens, ready=[None] * self.num_stages)
        self.records.append(record)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        return record

    def dispatched(self, record: MicrobatchRecord, stage: int, outputs: Any) -> None:
        """Stage `stage` of `record` was just dispatched; `outputs` are arrays it produces (never donated)."""
        record.dispatch.append(time.monotonic())
        self._queues[stage].put((record, stage, outputs))

    def retired(self, record: MicrobatchRecord) -> None:
        record.retired = time.monotonic()
        self.in_flight -= 1

    def wait(self) -> None:
        """Wait until the helpers have timed every dispatched stage."""
        for q in self._queues:
            q.join()

    def reset(self) -> None:
        """Forget the records (e.g. after warm-up); in-flight counting goes on."""
        self.wait()
        self.records = []
        self.max_in_flight = self.in_flight

    def stats(self) -> dict[str, Any]:
        """bubble_fraction, per-stage busy seconds, wall seconds, micro-batch counts (see the docstring)."""
        self.wait()
        done = [r for r in self.records if len(r.dispatch) == self.num_stages and None not in r.ready]
        ready = [_effective_ready(r) for r in done]
        busy = [0.0] * self.num_stages
        prev_ready = [float("-inf")] * self.num_stages
        for r, rr in zip(done, ready):
            for s in range(self.num_stages):
                start = max(r.dispatch[s], prev_ready[s], rr[s - 1] if s else float("-inf"))
                busy[s] += max(0.0, rr[s] - start)
                prev_ready[s] = rr[s]
        wall = (max(rr[-1] for rr in ready) - min(r.dispatch[0] for r in done)) if done else 0.0
        bubble = 1.0 - sum(busy) / (self.num_stages * wall) if wall > 0 else 0.0
        return {
            "num_stages": self.num_stages,
            "num_microbatches": len(done),
            "max_in_flight": self.max_in_flight,
            "max_overlap": _max_overlap(done, ready),
            "stage_busy_s": busy,
            "wall_s": wall,
            "bubble_fraction": bubble,
        }


def _effective_ready(r: MicrobatchRecord) -> list[float]:
    """Ready times tightened by what is known for sure: a stage's output is ready no later than the next
    stage's output (it is that stage's input) nor than the engine's retirement of the micro-batch. This
    removes the helper threads' wake-up lag where the main thread saw the result first."""
    ready = list(r.ready)
    bound = r.retired if r.retired is not None else float("inf")
    for s in reversed(range(len(ready))):
        ready[s] = bound = min(ready[s], bound)
    return ready


def _max_overlap(records: list[MicrobatchRecord], ready: list[list[float]]) -> int:
    """Most micro-batches between their first dispatch and their last stage's ready at one instant."""
    events = sorted([(r.dispatch[0], 1) for r in records] + [(rr[-1], -1) for rr in ready])
    current = best = 0
    for _, delta in events:
        current += delta
        best = max(best, current)
    return best


def _stop_threads(queues: list[queue.Queue], threads: list[threading.Thread]) -> None:
    for q in queues:
        q.put(None)
    for t in threads:
        t.join(timeout=5.0)
