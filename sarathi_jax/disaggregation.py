"""Prefill/decode disaggregation in the simulator (issue 33; partial: simulator only, no real engine, one process).

`DisaggregatedSimEngine` has the engine API (`engine_api.Engine`) on a virtual clock, like `SimulatedEngine`, but
runs each request on two sides (`disaggregation_config.DisaggregationSplit`): prefill instances, then decode
instances. Each instance is the engine's own core (`EngineCore`: scheduler, block manager, postprocessing) with
its own KV blocks and its own cost model (`CostModelExecutor` on its own virtual clock; on tp devices a
`tp_cost.TensorParallelCost`). A request:

1. queues at the prefill instance with the least prompt work (`_Queued`);
2. enters that instance's core when it next steps, unless back-pressure (below) holds new prefills back; the core
   runs it with max_tokens 1: its prompt, chunked or whole as the policy does, and its first token sampled there;
3. is held (`_Handoff`): its prompt's blocks stay taken on the prefill instance (`holder`) until it has moved;
4. moves: a decode instance with room reserves blocks for the whole request (prompt + max_tokens, so it never
   grows into a preemption there), and the KV cache of the prompt crosses the link in
   `link.transfer_time(prompt tokens x KV bytes per token)`, one transfer at a time (one shared link);
5. decodes: when it lands, its prefill blocks are freed and the decode core runs it as a decode at once
   (`Scheduler.add_sequence` of a sequence with its prompt computed), with the same `RequestMetrics`: TTFT is the
   prefill side's, and the gap to the second token holds the wait and the transfer.

Back-pressure: while a finished prefill waits for room on the decode side, no new request enters a prefill core
(new prefills stop; those already in a core go on while its blocks last). Nothing is dropped.

Time: each instance has its own clock. `step()` runs the earliest pending event (a landing, decode room, an
instance's next iteration) once the engine's clock (the driver's: arrivals are added up to it) has reached it,
so nothing runs before an event it depends on; a decode iteration frees its finished requests' blocks when it
ends (`_Instance.room_at`). Records name their instance (`IterationRecord.instance`: prefill0, decode0). No JAX.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from sarathi_jax.admission import Admission, AdmittedRequest, KVCapacity, Prompt
from sarathi_jax.block_manager import BlockManager
from sarathi_jax.disaggregation_config import DisaggregationSplit, InstanceGroup, KVLink
from sarathi_jax.engine_core import EngineCore, LoopConfig, RequestState
from sarathi_jax.outputs import IterationRecord, RequestMetrics, RequestOutput
from sarathi_jax.sampling_params import AdmissionError, SamplingParams
from sarathi_jax.scheduler import SchedulerConfig, make_scheduler
from sarathi_jax.sequence import Sequence, SequenceStatus
from sarathi_jax.simulator import DUMMY_VOCAB, CostModelExecutor, IterationCost, VirtualClock, dummy_prompt


@dataclass
class _Queued:
    request_id: str
    request: AdmittedRequest
    arrival: float


class _Instance:
    """One instance: a core on its own cost model and clock, and (prefill) its queue of requests not yet in it."""

    def __init__(self, name: str, scheduler_config: SchedulerConfig, block_manager: BlockManager,
                 cost_model: IterationCost, vocab_size: int) -> None:
        self.name = name
        self.executor = CostModelExecutor(cost_model, vocab_size)
        self.core = EngineCore(make_scheduler(scheduler_config, block_manager), self.executor,
                               loop=LoopConfig(async_scheduling=False))
        self.queue: deque[_Queued] = deque()
        self.stalled = False  # its last step ran nothing: it waits for blocks (a landing or an abort frees some)
        self.incoming = 0  # transfers that reserved blocks here and have not landed
        # What its last iteration freed (finished requests), visible from the iteration's end on (`room_at`).
        self.freed_until, self.freed_blocks, self.freed_seqs = 0.0, 0, 0
        self.room_seen = 0.0  # the last `freed_until` that waiting hand-offs were offered

    @property
    def clock(self) -> VirtualClock:
        return self.executor.clock

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
class _Handoff:
    """A request whose prompt is done: held on `source` until a decode instance has room, then moving."""

    request_id: str
    source: _Instance
    holder: Sequence  # stands for the prompt's blocks held on the prefill instance
    state: RequestState  # the decode side's (its sequence: the prompt computed, the first token appended)
    ready: float  # when its prefill iteration ended
    target: _Instance | None = None
    start: float | None = None  # the transfer: decode blocks reserved at start, prefill blocks freed at end
    end: float | None = None


def prefill_only(request: AdmittedRequest) -> AdmittedRequest:
    """The request as its prefill instance runs it: up to its first token. A min_tokens > 1 keeps that token from
    being a stop (as the colocated engine would not stop there)."""
    p = request.params
    extra = {"stop_token_ids": (), "ignore_eos": True} if p.min_tokens > 1 else {}
    return dataclasses.replace(request, params=dataclasses.replace(p, max_tokens=1, min_tokens=min(p.min_tokens, 1),
                                                                   **extra))


def _aborted(request_id: str, prompt: tuple[int, ...], tokens: tuple[int, ...], metrics: RequestMetrics,
             now: float) -> RequestOutput:
    """The last output of a request aborted outside any core (queued, held or moving)."""
    metrics.finished_time = now
    return RequestOutput(request_id=request_id, prompt_token_ids=prompt, new_token_ids=(), token_ids=tokens,
                         text_delta="", text="", new_logprobs=(), finished=True, finish_reason="abort",
                         metrics=metrics)


class DisaggregatedSimEngine:
    """The engine API on a virtual clock with prefill and decode on separate instances (module docstring).

    `blocks_per_device`: KV blocks one device holds (an instance of tp devices holds tp x that); `cost_of(tp)`:
    the cost model of an instance of tp devices; `kv_bytes_per_token`: the K and V of one token, all layers."""

    def __init__(self, split: DisaggregationSplit, scheduler_config: SchedulerConfig, blocks_per_device: int,
                 cost_of: Callable[[int], IterationCost], *, link: KVLink, kv_bytes_per_token: int,
                 block_size: int = 16, enable_prefix_caching: bool = False, vocab_size: int = DUMMY_VOCAB) -> None:
        self.split, self.link, self.kv_bytes_per_token = split, link, kv_bytes_per_token
        self.scheduler_config = scheduler_config
        self.max_model_len = scheduler_config.max_model_len
        self.config = self.budget_setup = self.model_config = self.tokenizer = None  # as SimulatedEngine's
        self.clock = VirtualClock()
        self.iteration_log: list[IterationRecord] = []

        def side(role: str, group: InstanceGroup, caching: bool) -> list[_Instance]:
            tp = group.tensor_parallel_size
            return [_Instance(f"{role}{i}", scheduler_config,
                              BlockManager(blocks_per_device * tp, block_size, enable_prefix_caching=caching),
                              cost_of(tp), vocab_size) for i in range(group.num_instances)]

        # Prefix caching on the prefill side only: decode blocks arrive by transfer.
        self.prefill = side("prefill", split.prefill, enable_prefix_caching)
        self.decode = side("decode", split.decode, False)
        smallest = min(self.prefill + self.decode, key=lambda i: i.block_manager.num_total_blocks)
        # A request must fit whole on every instance it may go to (the decode side reserves prompt + max_tokens).
        self.admission = Admission(vocab_size=vocab_size, max_model_len=self.max_model_len,
                                   kv_cache=KVCapacity.of(smallest.block_manager), stop_strings=True)
        self._requests: dict[str, AdmittedRequest] = {}  # unfinished, by id
        self._handoffs: dict[str, _Handoff] = {}  # held or moving, in the order their prefills ended
        self._outputs: list[RequestOutput] = []  # aborts outside a core, reported by the next step
        self._link_free = 0.0  # when the link has sent what it was given
        self.num_transfers, self.transfer_seconds = 0, 0.0

    @property
    def instances(self) -> list[_Instance]:
        return self.prefill + self.decode

    def dummy_prompt(self, length: int) -> list[int]:
        return dummy_prompt(length, self.admission.vocab_size)
    # ----------------------------------------------------------------------------------- requests in

    def add_request(self, request_id: str, prompt: Prompt | int, params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0, *, slo_ttft_s: float | None = None,
                    slo_tbt_s: float | None = None) -> None:
        """As `SimulatedEngine.add_request` (a prompt may be a length). Raises AdmissionError naming the field."""
        if isinstance(prompt, int):
            prompt = self.dummy_prompt(prompt)
        self.check_new_id(request_id)
        self.add_admitted(request_id, self.admission.admit(prompt, params, priority, slo_ttft_s=slo_ttft_s,
                                                           slo_tbt_s=slo_tbt_s), arrival_time)

    def check_new_id(self, request_id: str) -> None:
        if request_id in self._requests:
            raise AdmissionError("request_id", f"{request_id!r} is already in use")

    def add_admitted(self, request_id: str, request: AdmittedRequest, arrival_time: float | None = None) -> None:
        assert request_id not in self._requests, request_id
        self._requests[request_id] = request
        arrival = self.clock.now() if arrival_time is None else arrival_time
        min(self.prefill, key=lambda i: i.load).queue.append(_Queued(request_id, request, arrival))

    def abort(self, request_id: str) -> bool:
        """Abort a request wherever it is: every block it holds, on either side, is freed now."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        now = self.clock.now()
        for inst in self.instances:
            queued = next((q for q in inst.queue if q.request_id == request_id), None)
            if queued is not None:
                inst.queue.remove(queued)
                metrics = RequestMetrics(queued.arrival, slo_ttft_s=request.slo_ttft_s, slo_tbt_s=request.slo_tbt_s)
                self._outputs.append(_aborted(request_id, request.prompt_token_ids, (), metrics, now))
            elif request_id in inst.core:
                inst.core.abort(request_id)  # its output comes with the instance's next step
                inst.stalled = False
            else:
                continue
            break
        else:
            h = self._handoffs.pop(request_id)
            h.source.block_manager.free(h.holder)
            h.source.stalled = False
            seq = h.state.seq
            if h.target is not None:  # moving: its decode blocks were reserved
                h.target.block_manager.free(seq)
                h.target.incoming -= 1
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
            self._outputs.append(_aborted(request_id, request.prompt_token_ids, tuple(seq.output_token_ids),
                                          seq.metrics, now))
        self._start_transfers(now)
        return True

    def stage_of(self, request_id: str) -> str | None:
        """Where an unfinished request is: queued, prefill, held, moving or decode (None: unknown or finished)."""
        if request_id not in self._requests:
            return None
        if request_id in self._handoffs:
            return "held" if self._handoffs[request_id].start is None else "moving"
        if any(q.request_id == request_id for p in self.prefill for q in p.queue):
            return "queued"
        return "prefill" if any(request_id in p.core for p in self.prefill) else "decode"

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests or self._outputs or any(i.busy for i in self.instances))

    # ----------------------------------------------------------------------------------- events

    def step(self) -> list[RequestOutput]:
        """Run the earliest pending event; if it lies past the engine's clock, move the clock there first and
        return (the driver then adds the requests that arrive until then)."""
        outputs, self._outputs = self._outputs, []
        event = self._next_event()
        if event is None:
            return outputs
        t, _, _, action = event
        if t > self.clock.now():
            self.clock.wait_until(t)
            return outputs
        return outputs + action(t)

    def _next_event(self) -> tuple | None:
        order = itertools.count()
        events = [(h.end, 0, next(order), partial(self._land, h)) for h in self._handoffs.values() if h.end is not None]
        if any(h.start is None for h in self._handoffs.values()):
            events += [(d.freed_until, 1, next(order), partial(self._room, d))
                       for d in self.decode if d.freed_until > d.room_seen]
        events += [(d.clock.now(), 2, next(order), partial(self._step_decode, d))
                   for d in self.decode if d.busy and not d.stalled]
        for p in self.prefill:
            t = self._prefill_start(p)
            if t is not None:
                events.append((t, 3, next(order), partial(self._step_prefill, p)))
        return min(events, default=None)

    def _blocked_at(self, t: float) -> bool:
        """Back-pressure: a finished prefill is still waiting for decode room at time `t`."""
        return any(h.start is None or h.start > t for h in self._handoffs.values())

    def _prefill_start(self, p: _Instance) -> float | None:
        """When prefill instance `p` runs next (None: not until something else happens)."""
        if p.busy:
            return None if p.stalled else p.clock.now()
        if not p.queue or any(h.start is None for h in self._handoffs.values()):
            return None
        unblocked = max((h.start for h in self._handoffs.values()), default=0.0)
        return max(p.clock.now(), p.queue[0].arrival, unblocked)

    def _run(self, inst: _Instance, t: float) -> list[RequestOutput]:
        """One iteration of `inst`'s core starting at `t`; its record goes to the engine's log, named."""
        inst.clock.wait_until(t)
        log = inst.core.iteration_log
        before = len(log)
        outputs = inst.core.step()
        inst.stalled = len(log) == before and not outputs
        for rec in log[before:]:
            self.iteration_log.append(dataclasses.replace(rec, iteration=len(self.iteration_log), instance=inst.name))
        return outputs

    def _step_prefill(self, p: _Instance, t: float) -> list[RequestOutput]:
        if not self._blocked_at(t):
            while p.queue and p.queue[0].arrival <= t:
                q = p.queue.popleft()
                p.core.add_request(q.request_id, prefill_only(q.request), q.arrival)
                p.stalled = False
        outputs = self._run(p, t)
        for out in outputs:
            request = self._requests.get(out.request_id)
            if not out.finished or request is None:
                continue
            if out.finish_reason == "length" and request.params.max_tokens > 1:
                self._hand_off(p, out, request)
            else:
                del self._requests[out.request_id]  # done on the prefill side (max_tokens 1, a stop, an abort)
        self._start_transfers(p.clock.now())
        return outputs

    def _hand_off(self, p: _Instance, out: RequestOutput, request: AdmittedRequest) -> None:
        """`out` (its first token; the prefill core finished it and freed its blocks) continues on the decode side:
        the prompt's blocks are taken again at once, held until the transfer ends, and `out` says unfinished."""
        prompt, metrics = list(out.prompt_token_ids), out.metrics
        holder = Sequence(out.request_id, prompt, request.params, metrics.arrival_time)
        p.block_manager.allocate(holder, len(prompt))
        seq = Sequence(out.request_id, prompt, request.params, metrics.arrival_time, request.priority,
                       request.slo_ttft_s, request.slo_tbt_s)
        seq.metrics = metrics  # one request: TTFT from the prefill side, its TBTs from both
        metrics.finished_time = None
        seq.append_token(out.token_ids[0])
        seq.num_computed_tokens = len(prompt)
        seed = request.params.seed if request.params.seed is not None else 0
        state = RequestState(seq, seed, request.banned_until_min_tokens, None, None, emitted_tokens=1)
        self._handoffs[out.request_id] = _Handoff(out.request_id, p, holder, state, ready=p.clock.now())
        out.finished, out.finish_reason = False, None

    def _start_transfers(self, t: float) -> None:
        """Start the waiting hand-offs, in order, while a decode instance has room for the next one at its time."""
        for h in self._handoffs.values():
            if h.start is not None:
                continue
            seq, at = h.state.seq, max(h.ready, t)
            rooms = [d for d in self.decode
                     if d.room_at(at, d.block_manager.blocks_for_tokens(seq.max_total_tokens))]
            if not rooms:
                return  # in order: a later one does not overtake it
            d = min(rooms, key=lambda i: i.core.scheduler.num_running + i.incoming)
            d.block_manager.allocate(seq, seq.max_total_tokens)
            d.incoming += 1
            h.target, h.start = d, max(at, self._link_free)
            h.end = self._link_free = h.start + self.link.transfer_time(seq.num_prompt_tokens * self.kv_bytes_per_token)

    def _room(self, d: _Instance, t: float) -> list[RequestOutput]:
        d.room_seen = d.freed_until
        self._start_transfers(t)
        return []

    def _land(self, h: _Handoff, t: float) -> list[RequestOutput]:
        """The KV cache has moved: free the prefill blocks; the decode instance runs the request from now on."""
        del self._handoffs[h.request_id]
        h.source.block_manager.free(h.holder)
        h.source.stalled = False
        d = h.target
        d.incoming -= 1
        d.clock.wait_until(t)  # an idle instance starts at the landing (a busy one is already past it)
        d.core.add(h.state)
        d.stalled = False
        self.num_transfers += 1
        self.transfer_seconds += h.end - h.start
        self._start_transfers(t)
        return []

    def _step_decode(self, d: _Instance, t: float) -> list[RequestOutput]:
        bm, sched = d.block_manager, d.core.scheduler
        free, running = bm.num_free_blocks, sched.num_running
        outputs = self._run(d, t)
        d.freed_until = d.clock.now()
        d.freed_blocks, d.freed_seqs = max(0, bm.num_free_blocks - free), max(0, running - sched.num_running)
        for out in outputs:
            if out.finished:
                self._requests.pop(out.request_id, None)
        return outputs

    # ----------------------------------------------------------------------------------- the rest of the API

    def stats(self) -> dict:
        """The instances' `Scheduler.stats` summed, each one's under "instances", and the transfers so far."""
        per = {i.name: i.core.stats() for i in self.instances}
        keys = ("num_running", "num_waiting", "num_free_blocks", "num_total_blocks", "num_preemptions",
                "prefix_cache_queries", "prefix_cache_hits")
        total = {k: sum(s[k] for s in per.values()) for k in keys}
        total["kv_cache_usage"] = 1.0 - total["num_free_blocks"] / total["num_total_blocks"]
        return {**total, "instances": per, "num_queued": sum(len(i.queue) for i in self.instances),
                "num_held": sum(h.start is None for h in self._handoffs.values()),
                "num_moving": sum(h.start is not None for h in self._handoffs.values()),
                "num_transfers": self.num_transfers, "transfer_seconds": self.transfer_seconds,
                "clock": self.clock.now()}

    def reset_prefix_cache(self) -> None:
        for i in self.instances:
            i.block_manager.reset_prefix_cache()

    def pipeline_stats(self) -> None:
        return None

    def reset_pipeline_stats(self) -> None:
        """No pipeline."""

    startup_stats = pipeline_stats  # nothing loads or compiles
