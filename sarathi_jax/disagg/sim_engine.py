"""Prefill/decode disaggregation in the simulator: `DisaggregatedSimEngine`, the engine API
(`engine_api.Engine`) on a virtual clock, like `SimulatedEngine`, with prefill and decode on separate instances
(`config.disaggregation.DisaggregationSplit`). The request flow (queue, prefill, hand-off, back-pressure, landing,
aborts) is sarathi_jax/disagg/flow.py, shared with the real engine (sarathi_jax/disagg/real_engine.py);
this module owns the time. Each instance's core runs on its own cost model (`CostModelExecutor` on its own
virtual clock; on tp devices a `tp_cost.TensorParallelCost`); a KV transfer takes
`link.transfer_time(computed tokens x KV bytes per token)` (the prompt; a recompute's prompt and outputs), one
transfer at a time (one shared link); each is in `transfer_log` and the receiving instance's next record.

`step()` runs the earliest pending event (a landing, decode room, an instance's next iteration) once the engine's
clock (the driver's: arrivals are added up to it) has reached it, so nothing runs before an event it depends on;
a decode iteration frees its finished requests' blocks when it ends (`Instance.room_at`). No JAX.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from functools import partial

from sarathi_jax.core.admission import Admission, KVCapacity, Prompt
from sarathi_jax.scheduler.block_manager import BlockManager
from sarathi_jax.config.disaggregation import DisaggregationSplit, InstanceGroup, KVLink
from sarathi_jax.disagg.flow import DisaggregationFlow, Handoff, Instance
from sarathi_jax.core.engine_core import EngineCore, LoopConfig
from sarathi_jax.request.outputs import RequestOutput
from sarathi_jax.request.sampling_params import SamplingParams
from sarathi_jax.scheduler import SchedulerConfig, make_scheduler
from sarathi_jax.sim.simulator import DUMMY_VOCAB, CostModelExecutor, IterationCost, VirtualClock, dummy_prompt


class _SimInstance(Instance):
    """An instance whose core runs on its own cost model and virtual clock."""

    def __init__(self, name: str, scheduler_config: SchedulerConfig, block_manager: BlockManager,
                 cost_model: IterationCost, vocab_size: int) -> None:
        self.executor = CostModelExecutor(cost_model, vocab_size)
        super().__init__(name, EngineCore(make_scheduler(scheduler_config, block_manager), self.executor,
                                          loop=LoopConfig(async_scheduling=False)))
        self.room_seen = 0.0  # the last `freed_until` that waiting hand-offs were offered

    @property
    def clock(self) -> VirtualClock:
        return self.executor.clock


class DisaggregatedSimEngine(DisaggregationFlow):
    """The engine API on a virtual clock with prefill and decode on separate instances (module docstring).

    `blocks_per_device`: KV blocks one device holds (an instance of tp devices holds tp x that); `cost_of(tp)`:
    the cost model of an instance of tp devices; `kv_bytes_per_token`: the K and V of one token, all layers."""

    def __init__(self, split: DisaggregationSplit, scheduler_config: SchedulerConfig, blocks_per_device: int,
                 cost_of: Callable[[int], IterationCost], *, link: KVLink, kv_bytes_per_token: int,
                 block_size: int = 16, enable_prefix_caching: bool = False, vocab_size: int = DUMMY_VOCAB) -> None:
        self.split, self.link, self.kv_bytes_per_token = split, link, kv_bytes_per_token
        self.scheduler_config = scheduler_config
        self.config = self.budget_setup = self.model_config = None  # as SimulatedEngine's
        self.clock = VirtualClock()

        def side(role: str, group: InstanceGroup, caching: bool) -> list[_SimInstance]:
            tp = group.tensor_parallel_size
            return [_SimInstance(f"{role}{i}", scheduler_config,
                                 BlockManager(blocks_per_device * tp, block_size, enable_prefix_caching=caching),
                                 cost_of(tp), vocab_size) for i in range(group.num_instances)]

        # Prefix caching on both sides: a decode side that holds a prompt's leading blocks is sent only the rest.
        prefill = side("prefill", split.prefill, enable_prefix_caching)
        decode = side("decode", split.decode, enable_prefix_caching)
        smallest = min(prefill + decode, key=lambda i: i.block_manager.num_total_blocks)
        # A request must fit whole on every instance it may go to (as colocated: it may grow to prompt + max_tokens).
        admission = Admission(vocab_size=vocab_size, max_model_len=scheduler_config.max_model_len,
                              kv_cache=KVCapacity.of(smallest.block_manager), stop_strings=True)
        super().__init__(prefill, decode, admission)
        self._link_free = 0.0  # when the link has sent what it was given

    def dummy_prompt(self, length: int) -> list[int]:
        return dummy_prompt(length, self.admission.vocab_size)

    def add_request(self, request_id: str, prompt: Prompt | int, params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0, *, slo_ttft_s: float | None = None,
                    slo_tbt_s: float | None = None) -> None:
        """As `SimulatedEngine.add_request` (a prompt may be a length). Raises AdmissionError naming the field."""
        if isinstance(prompt, int):
            prompt = self.dummy_prompt(prompt)
        super().add_request(request_id, prompt, params, arrival_time, priority, slo_ttft_s=slo_ttft_s,
                            slo_tbt_s=slo_tbt_s)

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
        if self.waiting_for_room():
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

    def _prefill_start(self, p: _SimInstance) -> float | None:
        """When prefill instance `p` runs next (None: not until something else happens)."""
        if p.busy:
            return None if p.stalled else p.clock.now()
        if not p.queue or self.waiting_for_room():
            return None
        unblocked = max((h.start for h in self._handoffs.values()), default=0.0)
        return max(p.clock.now(), p.queue[0].arrival, unblocked)

    def _step_prefill(self, p: _SimInstance, t: float) -> list[RequestOutput]:
        p.clock.wait_until(t)
        if not self._blocked_at(t):
            self.admit_arrivals(p, t)
        return self.run_prefill(p)

    def now_of(self, inst: _SimInstance) -> float:
        return inst.clock.now()

    def begin_transfer(self, h: Handoff, at: float) -> None:
        """The computed tokens' K/V (a prompt's; a recompute's prompt and outputs) over the link, after what it
        was given before, less the blocks the decode side's prefix cache held."""
        cached = h.num_cached_blocks * h.target.block_manager.block_size
        h.num_bytes = (h.state.seq.num_computed_tokens - cached) * self.kv_bytes_per_token
        h.start = max(at, self._link_free)
        h.end = self._link_free = h.start + self.link.transfer_time(h.num_bytes)

    def _room(self, d: _SimInstance, t: float) -> list[RequestOutput]:
        d.room_seen = d.freed_until
        self.start_transfers(t)
        return []

    def _land(self, h: Handoff, t: float) -> list[RequestOutput]:
        h.target.clock.wait_until(t)  # an idle instance starts at the landing (a busy one is already past it)
        self.land(h, t)
        self.start_transfers(t)
        return []

    def _step_decode(self, d: _SimInstance, t: float) -> list[RequestOutput]:
        d.clock.wait_until(t)
        bm, sched = d.block_manager, d.core.scheduler
        free, running = bm.num_free_blocks, sched.num_running
        outputs = self.run_decode(d)
        d.freed_until = d.clock.now()
        d.freed_blocks, d.freed_seqs = max(0, bm.num_free_blocks - free), max(0, running - sched.num_running)
        return outputs

    # ----------------------------------------------------------------------------------- the rest of the API

    def pipeline_stats(self) -> None:
        return None

    def reset_pipeline_stats(self) -> None:
        """No pipeline."""

    startup_stats = pipeline_stats  # nothing loads or compiles
