"""The engine core: the one serving loop that the engine, the simulator and the tests drive.

`EngineCore` owns the scheduler (and through it the KV blocks), each request's host state, the postprocessing
of sampled tokens (append, grammar, stop checks, finish: `_postprocess`, the one place a sampled token is
handled), the outputs and the iteration records. An `Executor` runs batches: the model runner (`LLMEngine`)
or a cost model on a virtual clock (`SimulatedEngine`). No JAX here.

One `step()`: 1. schedule a batch and dispatch it (`Executor.submit` returns at once). Each sequence it
samples for gets a pending token at once (`Sequence.append_pending_token`); 2. retire the oldest batches in
flight beyond `max_in_flight`: fetch their tokens, resolve the pending ones, check stops, build outputs.

How many batches stay in flight after a step (`LoopConfig`):
  * synchronous (`async_scheduling=False`, pipeline depth 1): none. Dispatch, wait, postprocess.
  * overlapped (`async_scheduling=True`, depth 1): one. Batch N+1 is scheduled and dispatched before batch
    N's tokens reach the host: the scheduler is told a batch is done as soon as it is dispatched, and a
    decode whose input token is still pending reads it on the device (the runner takes it from batch N's
    sampled tokens). Then the host fetches and postprocesses N while the device runs N+1. A sequence that N
    finished (stop token, stop string, length) or that was aborted meanwhile may have run in N+1: that extra
    token is dropped, never emitted, and its KV blocks were freed when it finished (the device runs batches
    in order, so N+1's stale writes land before any later owner of those blocks writes them).
  * pipeline parallel (depth pp > 1): up to pp micro-batches in flight, a sequence in at most one (the scheduler
    is told a batch is done when it retires). The host already overlaps there; async_scheduling adds nothing.
A constrained row's bitmask (`_token_bitmask`) and a draft model's proposal need the last token on the host:
while such a request is unfinished, the overlapped loop retires every batch before it schedules. A verified
chunk's 1 to k + 1 tokens are known only at retirement: the loop also retires first while a running sequence's
verification is in flight (n-gram lookups guess a pending last token: docs/design/speculative-decoding.md,
"The loop"). In every mode a request's tokens depend only on its own tokens and seed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field

import numpy as np

from sarathi_jax.core.admission import Admission, AdmittedRequest, Prompt
from sarathi_jax.core.engine_api import Executor, SampledBatch, StepHandle
from sarathi_jax.request.outputs import IterationRecord, RequestOutput, TokenLogprob
from sarathi_jax.request.sampling_params import AdmissionError, RequestSampling, SamplingParams
from sarathi_jax.scheduler import Scheduler
from sarathi_jax.spec_decode.speculative import SpeculationStats, emitted_rows, verify_rows
from sarathi_jax.request.structured_outputs import GrammarMatcher, step_bitmask
from sarathi_jax.request.sequence import ScheduledChunk, SchedulerOutput, Sequence, SequenceStatus
from sarathi_jax.request.tokenizer import IncrementalDetokenizer, StopStringChecker, Tokenizer


@dataclass(frozen=True)
class LoopConfig:
    """async_scheduling: overlap the host's work on batch N with the device running N + 1 (depth 1 only).
    pipeline_depth: pipeline stages; that many micro-batches are kept in flight."""

    async_scheduling: bool = True
    pipeline_depth: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.pipeline_depth, int) or self.pipeline_depth < 1:
            raise ValueError(f"pipeline_depth must be a positive integer, got {self.pipeline_depth!r}")

    @property
    def max_in_flight(self) -> int:
        """Batches in flight right after a dispatch; the oldest is retired when this many are."""
        if self.pipeline_depth > 1:
            return self.pipeline_depth
        return 2 if self.async_scheduling else 1

    @property
    def done_at_dispatch(self) -> bool:
        """Tell the scheduler a batch is done when it is dispatched (depth 1), not when it retires (PP)."""
        return self.pipeline_depth == 1


@dataclass
class RequestState:
    """Core-side bookkeeping of one request that the scheduler does not need."""

    seq: Sequence
    seed: int
    banned_until_min_tokens: tuple[int, ...]  # stop and EOS ids suppressed while outputs < min_tokens
    detokenizer: IncrementalDetokenizer | None  # None, with stop_checker: no tokenizer, so no text
    stop_checker: StopStringChecker | None  # owns the released text; holds back what may become a stop string
    prompt_token_ids: tuple[int, ...] = ()  # built once: every output carries it
    emitted_tokens: int = 0  # output tokens already reported to the caller
    text_delta: str = ""  # released text not yet reported
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    grammar: GrammarMatcher | None = None  # structured outputs: the request's grammar state

    def __post_init__(self) -> None:
        self.prompt_token_ids = tuple(self.seq.prompt_token_ids)


@dataclass
class _InFlight:
    sched: SchedulerOutput
    handle: StepHandle
    start: float
    verifying: tuple[Sequence, ...]  # sequences whose chunk carries drafts


class EngineCore:
    """Requests in, one scheduled batch per `step()`, outputs out. Validation happens before `add_request`.

    tokenizer: detokenizes outputs and finds stop strings (None: outputs have no text). seed: where the seeds
    of requests that set none are drawn from (drawn once, so a preempted request resamples the same tokens).
    """

    def __init__(self, scheduler: Scheduler, executor: Executor, *, loop: LoopConfig = LoopConfig(),
                 eos_token_ids: SequenceOf[int] = (), tokenizer: Tokenizer | None = None, seed: int = 0) -> None:
        self.scheduler = scheduler
        self.executor, self.loop, self.eos_token_ids, self.tokenizer = executor, loop, tuple(eos_token_ids), tokenizer
        self._seed_rng = np.random.default_rng(seed)
        self.iteration_log: list[IterationRecord] = []
        self._requests: dict[str, RequestState] = {}
        self._pending_outputs: list[RequestOutput] = []  # aborts, reported by the next step()
        self._in_flight: deque[_InFlight] = deque()
        self._num_constrained = 0  # unfinished requests with a grammar
        self._num_synchronous = 0  # unfinished requests that need their tokens on the host to schedule (above)
        self.speculation_stats = SpeculationStats() if scheduler.speculation is not None else None

    # ----------------------------------------------------------------------------------- requests in

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def add_request(self, request_id: str, request: AdmittedRequest, arrival_time: float | None = None) -> None:
        """Queue an admitted request under a new id (nothing is re-checked: the scheduler asserts the lengths)."""
        ids, params = list(request.prompt_token_ids), request.params
        arrival = self.executor.now() if arrival_time is None else arrival_time
        seq = Sequence(request_id, ids, params, arrival, request.priority, request.slo_ttft_s, request.slo_tbt_s)
        seed = params.seed if params.seed is not None else int(self._seed_rng.integers(0, 2**31 - 1))
        text = self.tokenizer is not None
        self.add(RequestState(seq, seed, request.banned_until_min_tokens,
                              IncrementalDetokenizer(self.tokenizer, ids) if text else None,
                              StopStringChecker(params.stop) if text else None, grammar=request.grammar))

    def add(self, state: RequestState) -> None:
        """Queue a validated request (a new id: the caller checked with `in`)."""
        assert state.seq.seq_id not in self._requests, state.seq.seq_id
        self._requests[state.seq.seq_id] = state
        self._num_constrained += state.grammar is not None
        self._num_synchronous += self._is_synchronous(state)
        self.scheduler.add_sequence(state.seq)

    def abort(self, request_id: str) -> bool:
        """Abort a request now: its KV blocks are freed at once and its last output says finish_reason='abort'.
        A token of it still in flight is dropped when its batch retires."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return False
        self._forget(state)
        self.scheduler.abort_sequence(request_id)
        seq = state.seq
        seq.discard_pending_tokens()
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = "abort"
        seq.metrics.finished_time = self.executor.now()
        self._pending_outputs.append(self._make_output(state))
        return True

    def release(self, request_id: str) -> RequestState:
        """Take a preempted request (waiting, nothing pending) out with no output: another core runs it on
        (a disaggregated decode instance's recompute goes through a prefill instance: disagg/flow.py)."""
        state = self._requests.pop(request_id)
        assert state.seq.status is SequenceStatus.WAITING and not state.seq.num_pending_tokens, state.seq
        self._forget(state)
        self.scheduler.finish_sequence(state.seq, "moved")  # forgotten there (it holds no blocks)
        state.seq.status, state.seq.finish_reason = SequenceStatus.WAITING, None
        return state

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests or self._pending_outputs or self._in_flight)

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    # ----------------------------------------------------------------------------------- one iteration

    def step(self) -> list[RequestOutput]:
        """Schedule and dispatch one batch, then retire what the loop mode says (see the module docstring).
        When nothing new could be scheduled, the oldest batch in flight is retired, so every call progresses."""
        outputs, self._pending_outputs = self._pending_outputs, []
        outputs.extend(self.retire_for_schedule())
        sched = self.scheduler.schedule(self.executor.now())  # now: the priority policy's aging
        if sched.chunks:
            self._dispatch(sched)
        while self._in_flight and (len(self._in_flight) >= self.loop.max_in_flight or not sched.chunks):
            outputs.extend(self._retire(self._in_flight.popleft()))
            if not sched.chunks:
                break
        return outputs

    def retire_for_schedule(self) -> list[RequestOutput]:
        """Retire the batches in flight when the next schedule needs their tokens on the host (masks, a draft
        model's proposals, a running sequence's verified tokens). A disaggregated prefill instance calls it
        before `step`, to hold the blocks of what it finishes before that step could give them to another request."""
        outputs, running = [], SequenceStatus.RUNNING
        while self._in_flight and self.loop.done_at_dispatch and (self._num_synchronous or any(
                seq.status is running for batch in self._in_flight for seq in batch.verifying)):
            outputs.extend(self._retire(self._in_flight.popleft()))
        return outputs

    def _dispatch(self, sched: SchedulerOutput) -> None:
        start, bitmask = self.executor.now(), self._token_bitmask(sched.chunks) if self._num_constrained else None
        handle = self.executor.submit(sched.chunks, self.sampling_of, bitmask)
        for chunk in sched.chunks:
            seq = chunk.seq
            if chunk.needs_sample:
                seq.append_pending_token()
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = start
        if self.loop.done_at_dispatch:
            self.scheduler.on_step_done(sched)
        self._in_flight.append(_InFlight(sched, handle, start, tuple(c.seq for c in sched.chunks if c.draft_token_ids)))

    def _retire(self, batch: _InFlight) -> list[RequestOutput]:
        sampled = batch.handle.result()
        if not self.loop.done_at_dispatch:
            self.scheduler.on_step_done(batch.sched)
        now = self.executor.now()
        outputs = []
        requests, finished, chunks = self._requests, SequenceStatus.FINISHED, batch.sched.chunks
        verify = (verify_rows(len(chunks), [c.num_draft_tokens for c in chunks])  # where drafts' rows are
                  if self.speculation_stats is not None else None)
        for i, chunk in enumerate(chunks):
            if not chunk.needs_sample:
                continue
            seq = chunk.seq
            state = requests.get(seq.seq_id)
            if state is None or state.seq is not seq or seq.status is finished:
                continue  # finished or aborted since it was dispatched: the extra token is dropped
            if chunk.draft_token_ids:
                self._postprocess_verified(state, sampled, emitted_rows(i, verify[i], chunk.draft_token_ids,
                                                                        sampled.token_ids), chunk, now)
            else:
                self._postprocess(state, sampled, i, now)
            outputs.append(self._make_output(state))
            if seq.status is finished:
                self._forget(requests.pop(seq.seq_id))
        # Overlapped or pipelined batches overlap in time: the duration runs from dispatch to retirement.
        log = self.iteration_log
        log.append(batch.sched.iteration_record(len(log), batch.start, now, batch.handle.num_padded_tokens))
        return outputs

    def _is_synchronous(self, state: RequestState) -> bool:
        spec = self.scheduler.speculation
        return state.grammar is not None or (spec is not None and spec.synchronous(state.seq.sampling_params))

    def _forget(self, state: RequestState) -> None:
        """A request left `_requests` (finished or aborted): its part of the loop's counters."""
        self._num_constrained -= state.grammar is not None
        self._num_synchronous -= self._is_synchronous(state)

    # ----------------------------------------------------------------------------------- sampled tokens

    def _postprocess_verified(self, state: RequestState, sampled: SampledBatch, rows: list[int],
                              chunk: ScheduledChunk, now: float) -> None:
        """A verified chunk's tokens (`rows`, `speculative.emitted_rows`) one by one through `_postprocess`, so a
        stop inside an accepted run ends it there; then the blocks of rejected drafts go back."""
        seq = state.seq
        for j, row in enumerate(rows):
            if j:
                seq.accept_draft_token()  # the previous token is the draft whose K/V the chunk wrote
            self._postprocess(state, sampled, row, now)
            if seq.status is SequenceStatus.FINISHED:
                break
        self.speculation_stats.add(seq.metrics, chunk.num_draft_tokens, len(rows) - 1, j + 1)
        if seq.status is not SequenceStatus.FINISHED:  # (blocks the accepted drafts filled register next step)
            self.scheduler.block_manager.trim(seq, seq.num_tokens)

    def _token_bitmask(self, chunks: SequenceOf[ScheduledChunk]) -> np.ndarray | None:
        """The step's token bitmask (None when no row that samples is constrained)."""
        return step_bitmask([(self._requests[c.seq.seq_id].grammar, c.seq.sampling_params.stop_token_ids)
                             if c.needs_sample else None for c in chunks])

    def sampling_of(self, seq: Sequence) -> RequestSampling:
        state = self._requests[seq.seq_id]
        return (seq.sampling_params, state.seed, state.banned_until_min_tokens)

    def _postprocess(self, state: RequestState, sampled: SampledBatch, row: int, now: float) -> None:
        """Append row `row`'s token to the request, record its logprobs and text, and finish the request when
        a stop condition holds (stop string, stop token or EOS after min_tokens, max_tokens)."""
        seq, params = state.seq, state.seq.sampling_params
        token_id = int(sampled.token_ids[row])
        seq.resolve_pending_token(token_id)
        metrics = seq.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.token_times.append(now)
        if params.logprobs is not None:
            n = params.logprobs
            state.pending_logprobs.append(TokenLogprob(
                token_id, float(sampled.logprobs[row]), tuple(int(t) for t in sampled.top_token_ids[row, :n]),
                tuple(float(x) for x in sampled.top_logprobs[row, :n])))

        reason = grammar_end = None
        num_outputs = len(seq.output_token_ids)
        past_min_tokens = num_outputs >= params.min_tokens
        if state.detokenizer is not None:
            delta = state.detokenizer.append(token_id)
            checker = state.stop_checker
            state.text_delta += checker.add(delta, detect=past_min_tokens)
            if checker.stopped:
                reason = "stop"
        if reason is None and state.grammar is not None:  # complete ("stop", its text all kept) or "error"
            reason = grammar_end = state.grammar.take(token_id, params.stop_token_ids)
            seq.error = f"structured_outputs: {state.grammar.error}" if reason == "error" else None
            seq.error_param = "structured_outputs" if reason == "error" else None
        if reason is None and past_min_tokens:
            if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in self.eos_token_ids):
                reason = "stop"
        # prompt + max_tokens <= max_model_len is enforced at admission (longer requests are refused).
        if reason is None and num_outputs >= params.max_tokens:
            reason = "length"
        if reason is not None:
            if state.detokenizer is not None and (reason != "stop" or grammar_end):
                # Release a held-back partial character and any tail held for stop strings.
                state.text_delta += state.stop_checker.add(state.detokenizer.flush(), detect=False)
                state.text_delta += state.stop_checker.flush()
                if state.stop_checker.stopped:  # a stop string that waited on an earlier candidate
                    reason = "stop"
            seq.discard_pending_tokens()
            self.scheduler.finish_sequence(seq, reason)
            seq.metrics.finished_time = now

    def _make_output(self, state: RequestState) -> RequestOutput:
        seq = state.seq
        output_ids = seq.output_token_ids
        new_ids = tuple(output_ids[state.emitted_tokens :])
        finished = seq.status is SequenceStatus.FINISHED
        text_delta, state.text_delta = state.text_delta, ""
        state.emitted_tokens = len(output_ids)
        logprobs = ()
        if state.pending_logprobs:
            logprobs, state.pending_logprobs = tuple(state.pending_logprobs), []
        return RequestOutput(
            request_id=seq.seq_id, prompt_token_ids=state.prompt_token_ids, new_token_ids=new_ids,
            token_ids=tuple(output_ids), text_delta=text_delta,
            text=state.stop_checker.text if state.stop_checker is not None else "", new_logprobs=logprobs,
            finished=finished, finish_reason=seq.finish_reason if finished else None, metrics=seq.metrics,
            error=seq.error, error_param=seq.error_param)

    def stats(self) -> dict:
        stats = self.scheduler.stats()
        return stats if self.speculation_stats is None else {**stats, **self.speculation_stats.as_dict()}


class CoreFrontEnd:
    """The requests-facing calls of the engine API (`engine_api.Engine`) that an engine built on an
    `EngineCore` (`LLMEngine`, `SimulatedEngine`) hands straight to it: one copy for both. The engine sets
    `core` and `admission`."""

    core: EngineCore
    admission: Admission

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0, *, slo_ttft_s: float | None = None,
                    slo_tbt_s: float | None = None) -> None:
        """Validate and queue a request (`priority`: lower first under scheduling_policy="priority"; SLO targets:
        outputs.RequestMetrics). Raises AdmissionError (a ValueError) naming the bad field; nothing is queued then."""
        self.check_new_id(request_id)
        self.add_admitted(request_id, self.admission.admit(prompt, params, priority, slo_ttft_s=slo_ttft_s,
                                                           slo_tbt_s=slo_tbt_s), arrival_time)

    def add_admitted(self, request_id: str, request: AdmittedRequest, arrival_time: float | None = None) -> None:
        """Queue a request that `self.admission` admitted, under a new id. Nothing is re-checked (the scheduler
        asserts what admission guarantees): servers admit in their own thread and hand this the result."""
        assert request_id not in self.core, request_id
        self.core.add_request(request_id, request, arrival_time)

    def step(self) -> list[RequestOutput]:
        """One iteration of the engine core: schedule and dispatch a batch, retire the oldest in flight.

        Synchronous loop: the batch dispatched is also retired. Overlapped loop (the default): call N+1
        queues its batch before it fetches and postprocesses batch N (a token is reported one call after its
        batch was dispatched); with pipeline parallelism up to pp micro-batches are in flight."""
        return self.core.step()

    def check_new_id(self, request_id: str) -> None:
        """The one request rule admission cannot decide: the id must not be in use here."""
        if request_id in self.core:
            raise AdmissionError("request_id", f"{request_id!r} is already in use")

    def abort(self, request_id: str) -> bool:
        """Abort a request now: its KV blocks are freed at once and its last output says finish_reason='abort'."""
        return self.core.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    @property
    def iteration_log(self) -> list[IterationRecord]:
        return self.core.iteration_log

    def stats(self) -> dict:
        return self.core.stats()  # queue and KV-cache occupancy (`Scheduler.stats`)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks in use stay with their requests; nothing is reused after)."""
        self.core.scheduler.block_manager.reset_prefix_cache()
