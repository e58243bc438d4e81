"""Prefill/decode disaggregation's request flow (docs/design/disaggregation.md), the one copy that the simulated engine
(sarathi_jax/disagg/sim_engine.py: cost models on virtual clocks) and the real one (sarathi_jax/disagg/real_engine.py:
model runners on their own devices, the wall clock) share. No JAX.

Each instance is the engine's own core (`EngineCore`: scheduler, block manager, postprocessing) with its own KV
blocks. A request:

1. queues at the prefill instance with the least prompt work (`Queued`);
2. enters that instance's core when it next steps, unless back-pressure (below) holds new prefills back; the core
   runs it up to one more token (`prefill_params`: max_tokens 1): its prompt, chunked or whole as the policy
   does, and its first token sampled there (a structured output's grammar state is the request's one matcher:
   the prefill core advances it, the decode core goes on from there);
3. is held (`Handoff`): the prefill core finished it and freed its blocks; they are taken back at once, the same
   blocks (`BlockManager.retake`: they hold the prompt's K/V, and nothing was allocated in between), by `holder`
   until the request has moved. The decode side's state takes the token (its text, a stop string in it);
4. moves (`start_transfers`): a decode instance with room reserves the blocks of its computed tokens (as a
   colocated engine holds them after a prefill; decodes grow them), sharing the leading ones its own prefix
   cache holds (the same hashes: the same tokens at the same positions, their K/V already there), and the
   engine moves the K/V of the rest (`begin_transfer`: the simulator prices it on its link, the real engine
   copies the blocks between devices);
5. decodes (`land`): the prefill blocks are freed and the decode core runs the request as a decode at once
   (`Scheduler.add_sequence` of a sequence with its prompt computed), with the same `RequestMetrics`: TTFT is
   the prefill side's, and the gap to the second token holds the wait and the transfer. The real engine lands
   as soon as the copy is dispatched (the devices order it before the decode steps that read it); its record
   waits until the copy is seen done (`Handoff.copy`, `finish_transfers`).
6. A decode core that runs out of blocks preempts as any core does (its scheduler's victim order: blocks freed,
   outputs kept); the flow takes the victim out of it (`EngineCore.release`) and queues it at a prefill instance
   as a recompute (`Queued.resume`): its prompt and outputs so far are prefilled there, the next token sampled,
   and it moves again (steps 3-5), as a colocated recompute re-prefills the same tokens.

Back-pressure: while a finished prefill waits for room on the decode side, no new request enters a prefill core
(new prefills stop; those already in a core go on while its blocks last). Nothing is dropped. Aborts free the
request's blocks on both sides at any stage. Records name their instance (`IterationRecord.instance`); each
done transfer is a `TransferRecord` (`transfer_log`, summed in `stats()`, and on the receiving instance's next
record).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from sarathi_jax.core.admission import Admission, AdmittedRequest, Prompt
from sarathi_jax.disagg.state import (Handoff, Instance, Queued, TransferRecord, aborted_output,
                                              prefill_params)
from sarathi_jax.core.engine_api import Clock
from sarathi_jax.core.engine_core import RequestState
from sarathi_jax.request.outputs import IterationRecord, RequestMetrics, RequestOutput
from sarathi_jax.request.sampling_params import AdmissionError, SamplingParams
from sarathi_jax.request.sequence import Sequence, SequenceStatus
from sarathi_jax.request.tokenizer import IncrementalDetokenizer, StopStringChecker, Tokenizer


class DisaggregationFlow:
    """The request flow over `prefill` and `decode` instances (module docstring). A subclass says when things
    run (`step`) and how the K/V moves (`begin_transfer`); `clock` stamps what happens outside the cores."""

    clock: Clock
    tokenizer: Tokenizer | None = None  # the decode side's text (None: outputs carry no text)

    def __init__(self, prefill: list[Instance], decode: list[Instance], admission: Admission, seed: int = 0) -> None:
        self.prefill, self.decode, self.admission = prefill, decode, admission
        self.max_model_len = admission.max_model_len
        self.iteration_log: list[IterationRecord] = []
        self._requests: dict[str, AdmittedRequest] = {}  # unfinished, by id
        self._handoffs: dict[str, Handoff] = {}  # held or moving, in the order their prefills ended
        self._outputs: list[RequestOutput] = []  # ends outside a core, reported by the next step
        self._resuming: dict[str, RequestState] = {}  # recomputes queued or in a prefill core: decode-side state
        # Seeds drawn here, as one colocated core would draw them (in arrival order), so both sides use the same.
        self._seed_rng = np.random.default_rng(seed)
        self.transfer_log: list[TransferRecord] = []  # every transfer done, in the order it was seen done
        # Landed, their copy not yet seen done (the real engine's): each with its record but for the time.
        self._copying: list[tuple[Handoff, TransferRecord]] = []
        self.num_transfers, self.transfer_bytes, self.transfer_seconds = 0, 0, 0.0

    @property
    def instances(self) -> list[Instance]:
        return self.prefill + self.decode

    # ----------------------------------------------------------------------------------- requests in

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0, *, slo_ttft_s: float | None = None,
                    slo_tbt_s: float | None = None) -> None:
        """Admit and queue a request. Raises AdmissionError naming the field."""
        self.check_new_id(request_id)
        self.add_admitted(request_id, self.admission.admit(prompt, params, priority, slo_ttft_s=slo_ttft_s,
                                                           slo_tbt_s=slo_tbt_s), arrival_time)

    def check_new_id(self, request_id: str) -> None:
        if request_id in self._requests:
            raise AdmissionError("request_id", f"{request_id!r} is already in use")

    def add_admitted(self, request_id: str, request: AdmittedRequest, arrival_time: float | None = None) -> None:
        assert request_id not in self._requests, request_id
        if request.params.seed is None:
            seed = int(self._seed_rng.integers(0, 2**31 - 1))
            request = dataclasses.replace(request, params=dataclasses.replace(request.params, seed=seed))
        self._requests[request_id] = request
        arrival = self.clock.now() if arrival_time is None else arrival_time
        min(self.prefill, key=lambda i: i.load).queue.append(Queued(request_id, request, arrival))

    def abort(self, request_id: str) -> bool:
        """Abort a request wherever it is: every block it holds, on either side, is freed now."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        self._resuming.pop(request_id, None)
        now = self.clock.now()
        for inst in self.instances:
            queued = next((q for q in inst.queue if q.request_id == request_id), None)
            if queued is not None:
                inst.queue.remove(queued)
                if queued.resume is None:
                    metrics = RequestMetrics(queued.arrival, slo_ttft_s=request.slo_ttft_s,
                                             slo_tbt_s=request.slo_tbt_s)
                    tokens: tuple[int, ...] = ()
                else:  # a recompute: its outputs so far were reported
                    metrics, tokens = queued.resume.seq.metrics, tuple(queued.resume.seq.output_token_ids)
                self._outputs.append(aborted_output(request_id, request.prompt_token_ids, tokens, metrics, now))
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
            self._outputs.append(aborted_output(request_id, request.prompt_token_ids, tuple(seq.output_token_ids),
                                                 seq.metrics, now))
        self.start_transfers(now)
        return True

    def stage_of(self, request_id: str) -> str | None:
        """Where an unfinished request is: queued, prefill, held, moving or decode (None: unknown or finished).
        Moving: its K/V on the way (the real engine: its copy not yet seen done, the decode core already has it)."""
        if request_id not in self._requests:
            return None
        if request_id in self._handoffs:
            return "held" if self._handoffs[request_id].start is None else "moving"
        if any(q.request_id == request_id for p in self.prefill for q in p.queue):
            return "queued"
        if any(request_id in p.core for p in self.prefill):
            return "prefill"
        return "moving" if any(h.request_id == request_id for h, _ in self._copying) else "decode"

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests or self._outputs or self._copying or any(i.busy for i in self.instances))

    # ----------------------------------------------------------------------------------- the flow

    def waiting_for_room(self) -> bool:
        """A finished prefill is held, waiting for decode room (back-pressure: no new prefill starts)."""
        return any(h.start is None for h in self._handoffs.values())

    def admit_arrivals(self, p: Instance, t: float) -> None:
        """Requests queued at `p` that have arrived by `t` enter its core (the caller checked back-pressure)."""
        while p.queue and p.queue[0].arrival <= t:
            q = p.queue.popleft()
            request, state = q.request, q.resume
            if state is None:
                p.core.add_request(q.request_id, dataclasses.replace(request, params=prefill_params(request.params)),
                                   q.arrival)
            else:  # a recompute: prompt + outputs re-prefilled, the next token sampled (the same seed and step)
                done = state.seq
                seq = Sequence(q.request_id, done.prompt_token_ids, prefill_params(request.params,
                               done.num_output_tokens), done.metrics.arrival_time, request.priority)
                seq.metrics = done.metrics
                for token in done.output_token_ids:
                    seq.append_token(token)
                p.core.add(RequestState(seq, state.seed, state.banned_until_min_tokens, None, None,
                                        emitted_tokens=done.num_output_tokens, grammar=state.grammar))
            p.stalled = False

    def run(self, inst: Instance, *, step: bool = True) -> list[RequestOutput]:
        """One iteration of `inst`'s core (step=False: only what it retires before it schedules,
        `EngineCore.retire_for_schedule`); its records go to the engine's log, named."""
        self.finish_transfers()  # so the records seen done by now go with this iteration's
        log = inst.core.iteration_log
        before = len(log)
        outputs = inst.core.step() if step else inst.core.retire_for_schedule()
        if step:
            inst.stalled = len(log) == before and not outputs
        for rec in log[before:]:
            landed, inst.landed = inst.landed, []
            self.iteration_log.append(dataclasses.replace(
                rec, iteration=len(self.iteration_log), instance=inst.name,
                transfer_bytes=sum(t.num_bytes for t in landed), transfer_seconds=sum(t.seconds for t in landed)))
        return outputs

    def now_of(self, inst: Instance) -> float:
        """The time at `inst` (the simulator's instances have clocks of their own)."""
        return self.clock.now()

    def run_prefill(self, p: Instance) -> list[RequestOutput]:
        """One iteration of prefill instance `p`; requests whose prompt it finished are handed off (held). What
        it retires before it schedules (a constrained request's batch) is handed off first: the blocks a finished
        request frees must be taken back before that schedule could give them to another request."""
        outputs = []
        for step in (False, True):
            # Each table as it stands: allocation appends to it, freeing replaces it (never clears it).
            sched = p.core.scheduler
            tables = {s.seq_id: s.block_table for s in (*sched.running, *sched.waiting)}
            done = self.run(p, step=step)
            now = self.now_of(p)
            for out in done:
                request = self._requests.get(out.request_id)
                if out.finished and request is not None and out.finish_reason != "abort":
                    self._after_prefill(p, out, request, tables[out.request_id], now)
            outputs += done
        self.start_transfers(now)
        return outputs

    def _decode_state(self, out: RequestOutput, request: AdmittedRequest) -> RequestState:
        """The decode side's state of a request whose first prefill just ended (no token yet)."""
        prompt, params = list(out.prompt_token_ids), request.params
        seq = Sequence(out.request_id, prompt, params, out.metrics.arrival_time, request.priority,
                       request.slo_ttft_s, request.slo_tbt_s)
        seq.metrics = out.metrics  # one request: TTFT from the prefill side, its TBTs from both
        text = self.tokenizer is not None
        return RequestState(seq, params.seed, request.banned_until_min_tokens,
                            IncrementalDetokenizer(self.tokenizer, prompt) if text else None,
                            StopStringChecker(params.stop) if text else None, grammar=request.grammar)

    def _after_prefill(self, p: Instance, out: RequestOutput, request: AdmittedRequest, blocks: list[int],
                       now: float) -> None:
        """The prefill core finished `out`'s run (one more token: its first, or a recompute's next) and freed
        `blocks`. The decode side's state takes the token and its text (a stop string in it, as the colocated
        core would find it); `out` carries that text. The request ends here (a stop, or its max_tokens), or goes
        on: its blocks are taken back at once and held until moved, and `out` says unfinished."""
        resume = self._resuming.pop(out.request_id, None)
        state = resume if resume is not None else self._decode_state(out, request)
        seq, params, token = state.seq, request.params, out.token_ids[-1]
        seq.append_token(token)
        seq.num_computed_tokens = seq.num_tokens - 1
        reason = out.finish_reason if len(out.token_ids) >= params.max_tokens or out.finish_reason != "length" \
            else None
        checker = state.stop_checker
        if checker is not None:
            state.text_delta += checker.add(state.detokenizer.append(token),
                                            detect=seq.num_output_tokens >= params.min_tokens)
            grammar_end = reason == "stop" and state.grammar is not None and state.grammar.is_finished()
            if checker.stopped:
                reason = "stop"
            elif reason is not None and (reason != "stop" or grammar_end):  # release held-back text, as the core
                state.text_delta += checker.add(state.detokenizer.flush(), detect=False) + checker.flush()
                reason = "stop" if checker.stopped else reason
            out.text_delta, out.text, state.text_delta = state.text_delta, checker.text, ""
        state.emitted_tokens = seq.num_output_tokens
        if reason is not None:  # it ends here, as the colocated engine would end it
            del self._requests[out.request_id]
            out.finish_reason, seq.status, seq.finish_reason = reason, SequenceStatus.FINISHED, reason
            return
        out.metrics.finished_time = None
        out.finished, out.finish_reason = False, None
        holder = Sequence(out.request_id, list(out.prompt_token_ids), params, out.metrics.arrival_time)
        p.block_manager.retake(holder, blocks)
        self._handoffs[out.request_id] = Handoff(out.request_id, p, holder, state, ready=now)

    def start_transfers(self, t: float) -> None:
        """Start the waiting hand-offs, in order, while a decode instance has room for the next one at its time."""
        for h in list(self._handoffs.values()):
            if h.start is not None:
                continue
            seq, at = h.state.seq, max(h.ready, t)
            rooms = [d for d in self.decode
                     if d.room_at(at, d.block_manager.blocks_for_tokens(seq.num_computed_tokens))]
            if not rooms:
                return  # in order: a later one does not overtake it
            d = min(rooms, key=lambda i: i.core.scheduler.num_running + i.incoming)
            bm = d.block_manager
            # Its leading blocks that this side's prefix cache holds (the same tokens at the same positions: the
            # same K/V, from an earlier transfer or decode) are shared, not copied (`begin_transfer`: the rest).
            hit = bm.match_prefix(seq)
            bm.acquire_prefix(seq, hit)
            bm.allocate(seq, seq.num_computed_tokens)  # what it holds colocated; decodes grow it
            h.num_cached_blocks = len(hit.blocks)
            d.incoming += 1
            h.target = d
            self.begin_transfer(h, at)

    def begin_transfer(self, h: Handoff, at: float) -> None:
        """Move `h`'s K/V from `h.source` to `h.target` (whose blocks are reserved), starting at `at`: set
        `h.start`, `h.num_bytes` and `h.end`, or `h.copy` for a copy whose end is seen later (the landing,
        `land`, is the subclass's to call)."""
        raise NotImplementedError

    def land(self, h: Handoff, t: float) -> None:
        """The KV cache has moved, or its copy is ordered before the decode side's next step (`h.copy`): free
        the prefill blocks; the decode instance runs the request from now on. Its `TransferRecord` now, or
        once the copy is seen done (`finish_transfers`)."""
        d = h.target
        num_blocks = len(h.holder.block_table) - h.num_cached_blocks  # those copied
        record = TransferRecord(h.request_id, h.source.name, d.name, num_blocks, h.num_bytes, h.start,
                                0.0)  # its seconds when the transfer is done
        del self._handoffs[h.request_id]
        h.source.block_manager.free(h.holder)
        h.source.stalled = False
        d.incoming -= 1
        d.core.add(h.state)
        d.stalled = False
        if h.end is None:
            self._copying.append((h, record))
        else:
            self._record(h, record)

    def finish_transfers(self, *, wait: bool = False) -> None:
        """Record the landed copies seen done by now (wait: every one, waiting for them), in landing order."""
        copying, self._copying = self._copying, []
        for h, record in copying:
            h.end = h.copy.done_at(wait=wait)
            if h.end is None:
                self._copying.append((h, record))
            else:
                self._record(h, record)

    def _record(self, h: Handoff, record: TransferRecord) -> None:
        record, d = dataclasses.replace(record, seconds=h.end - h.start), h.target
        self.transfer_log.append(record)
        d.landed.append(record)
        self.num_transfers += 1
        self.transfer_bytes += record.num_bytes
        self.transfer_seconds += record.seconds

    def run_decode(self, d: Instance) -> list[RequestOutput]:
        """One iteration of decode instance `d`; what it preempted goes back to a prefill instance (step 6)."""
        outputs = self.run(d)
        for out in outputs:
            if out.finished:
                self._requests.pop(out.request_id, None)
        now = self.now_of(d)
        # Its waiting sequences are the preempted ones (a landing runs at once); their tokens are all resolved
        # here (a victim is in no batch in flight: the scheduler skips those, and a step retires the previous).
        for seq in d.core.scheduler.waiting:
            if not seq.num_pending_tokens:
                self.recompute(d.core.release(seq.seq_id), now)
        return outputs

    def recompute(self, state: RequestState, now: float) -> None:
        """Queue a request preempted on the decode side at the prefill instance with the least work, first."""
        request_id = state.seq.seq_id
        self._resuming[request_id] = state
        p = min(self.prefill, key=lambda i: i.load)
        p.queue.appendleft(Queued(request_id, self._requests[request_id], now, resume=state))
        p.stalled = False

    # ----------------------------------------------------------------------------------- the rest of the API

    def stats(self) -> dict:
        """The instances' `Scheduler.stats` summed, each one's under "instances", and the transfers done so far.
        The prefix cache's counters are the prefill side's (prompts looked up, as a colocated engine counts
        them); the decode side's (blocks shared, not moved) are under "instances"."""
        self.finish_transfers()
        per = {i.name: i.core.stats() for i in self.instances}
        keys = ("num_running", "num_waiting", "num_free_blocks", "num_total_blocks", "num_preemptions")
        total = {k: sum(s[k] for s in per.values()) for k in keys}
        for k in ("prefix_cache_queries", "prefix_cache_hits"):
            total[k] = sum(per[p.name][k] for p in self.prefill)
        total["kv_cache_usage"] = 1.0 - total["num_free_blocks"] / total["num_total_blocks"]
        return {**total, "instances": per, "num_queued": sum(len(i.queue) for i in self.instances),
                "num_held": sum(h.start is None for h in self._handoffs.values()),
                "num_moving": sum(h.start is not None for h in self._handoffs.values()) + len(self._copying),
                "num_transfers": self.num_transfers, "transfer_bytes": self.transfer_bytes,
                "transfer_seconds": self.transfer_seconds,
                "clock": self.clock.now()}

    def reset_prefix_cache(self) -> None:
        for i in self.instances:
            i.block_manager.reset_prefix_cache()
