"""The parts of a disaggregated engine's request flow (the flow: sarathi_jax/disagg/flow.py):
an instance (`Instance`: a core, its queue, its room), a request between instances (`Queued` at a prefill
instance, `Handoff` while held and moving), a copy still on the device (`CopyInFlight`), a finished transfer
(`TransferRecord`), and the sampling settings a prefill instance runs a request with (`prefill_params`). No JAX.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from sarathi_jax.core.admission import AdmittedRequest
from sarathi_jax.scheduler.block_manager import BlockManager
from sarathi_jax.core.engine_core import EngineCore, RequestState
from sarathi_jax.request.outputs import RequestMetrics, RequestOutput
from sarathi_jax.request.sampling_params import SamplingParams
from sarathi_jax.request.sequence import Sequence


@dataclass(frozen=True)
class TransferRecord:
    """One request's K/V moved from a prefill instance to a decode instance. `seconds`: the simulator's link
    time; the real engine's, from the gather's dispatch to when the device-to-device copy was seen done
    (`disagg.kv_transfer.PendingCopy`: it includes any wait behind device work dispatched before it, such as
    the prefill side's next step). `num_blocks`: the blocks copied (those the decode side's prefix cache held
    are not); `num_bytes`: what was copied (the real engine: the blocks of its padded bucket; the simulator:
    the copied tokens' K/V)."""

    request_id: str
    source: str
    target: str
    num_blocks: int
    num_bytes: int
    start: float
    seconds: float


class CopyInFlight(Protocol):
    """A K/V copy dispatched to the devices and not yet seen done (the real engine's `PendingCopy`)."""

    def done_at(self, *, wait: bool = False) -> float | None:
        """When the copy was seen done (the engine's clock), or None while it is not (wait: until it is)."""
        ...


@dataclass
class Queued:
    request_id: str
    request: AdmittedRequest
    arrival: float  # when it may enter a prefill core (a recompute: when it was preempted)
    resume: RequestState | None = None  # a recompute: the decode side's state (its sequence keeps its outputs)


class Instance:
    """One instance: a core and (prefill) its queue of requests not yet in it."""

    def __init__(self, name: str, core: EngineCore) -> None:
        self.name, self.core = name, core
        self.queue: deque[Queued] = deque()
        self.stalled = False  # its last step ran nothing: it waits for blocks (a landing or an abort frees some)
        self.incoming = 0  # transfers that reserved blocks here and have not landed
        # What its last iteration freed (finished requests), visible from the iteration's end on (`room_at`): the
        # simulator's clocks; the real engine leaves freed_until at 0 (what is freed is free at once).
        self.freed_until, self.freed_blocks, self.freed_seqs = 0.0, 0, 0
        self.landed: list[TransferRecord] = []  # transfers into it since its last iteration (that record's)

    @property
    def block_manager(self) -> BlockManager:
        return self.core.scheduler.block_manager

    @property
    def busy(self) -> bool:
        return self.core.has_unfinished_requests()

    @property
    def load(self) -> int:
        """Prompt tokens queued here or not yet computed in its core."""
        sched = self.core.scheduler
        return (sum(len(q.request.prompt_token_ids) for q in self.queue)
                + sum(s.num_uncomputed_tokens for s in (*sched.running, *sched.waiting)))

    def room_at(self, t: float, num_blocks: int) -> bool:
        """Room at time `t` for one more request of `num_blocks` blocks, above the watermark."""
        late = self.freed_until > t
        bm, sched = self.block_manager, self.core.scheduler
        free = bm.num_free_blocks - bm.watermark_blocks - (self.freed_blocks if late else 0)
        seqs = sched.num_running + self.incoming + (self.freed_seqs if late else 0)
        return free >= num_blocks and seqs < sched.config.max_num_seqs


@dataclass
class Handoff:
    """A request whose prompt is done: held on `source` until a decode instance has room, then moving."""

    request_id: str
    source: Instance
    holder: Sequence  # holds the prompt's blocks on the prefill instance
    state: RequestState  # the decode side's (its sequence: the prompt computed, the first token appended)
    ready: float  # when its prefill iteration ended
    target: Instance | None = None
    start: float | None = None  # the transfer: decode blocks reserved at start, prefill blocks freed at landing
    end: float | None = None  # when it was done (None while a copy is in flight: `copy`)
    num_bytes: int = 0  # what the transfer copies (`TransferRecord.num_bytes`)
    num_cached_blocks: int = 0  # leading blocks the decode side's prefix cache held: shared there, not copied
    copy: CopyInFlight | None = None  # the real engine's copy, landed before it is done: its end comes later


def prefill_params(p: SamplingParams, num_outputs: int = 0) -> SamplingParams:
    """`p` as a prefill instance runs a request with `num_outputs` outputs so far (0, or a recompute's): up to one
    more token. A min_tokens past it keeps that token from being a stop (the colocated engine would not stop
    there); EOS and stop ids stay banned for it all the same (the sampler bans them while outputs < min_tokens)."""
    n = num_outputs + 1
    extra = {"stop_token_ids": (), "ignore_eos": True, "stop": ()} if p.min_tokens > n else {}
    return dataclasses.replace(p, max_tokens=n, min_tokens=min(p.min_tokens, n), **extra)


def aborted_output(request_id: str, prompt: tuple[int, ...], tokens: tuple[int, ...], metrics: RequestMetrics,
                   now: float) -> RequestOutput:
    """The last output of a request aborted outside any core (queued, held or moving): no new token."""
    metrics.finished_time = now
    return RequestOutput(request_id=request_id, prompt_token_ids=prompt, new_token_ids=(), token_ids=tokens,
                         text_delta="", text="", new_logprobs=(), finished=True, finish_reason="abort",
                         metrics=metrics)
