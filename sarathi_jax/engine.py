"""The serving loop: requests in, one scheduled and executed batch per `step()`, outputs out.

A request's path: `add_request` validates it and makes a `Sequence`; each `step` asks the scheduler for a
batch, runs it on the model runner, appends sampled tokens, checks stop conditions and frees finished
sequences' KV blocks. The engine is driven by one thread; servers hand it work through a queue.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from pallas_kernels import get_attention_fn
from sarathi_jax.block_manager import BlockManager
from sarathi_jax.config import EngineConfig
from sarathi_jax.model_runner import ModelRunner
from sarathi_jax.models import load_model
from sarathi_jax.outputs import IterationRecord, RequestOutput, TokenLogprob
from sarathi_jax.sampling import MAX_BANNED
from sarathi_jax.sampling_params import SamplingParams
from sarathi_jax.scheduler import SchedulerOutput, make_scheduler
from sarathi_jax.sizing import size_engine
from sarathi_jax.sequence import Sequence, SequenceStatus
from sarathi_jax.tokenizer import IncrementalDetokenizer, StopStringChecker, Tokenizer, load_tokenizer



@dataclass
class _RequestState:
    """Engine-side bookkeeping that the scheduler does not need."""

    seq: Sequence
    prompt_token_ids: tuple[int, ...]  # built once: every output carries it
    seed: int
    banned_until_min_tokens: tuple[int, ...]
    detokenizer: IncrementalDetokenizer | None
    stop_checker: StopStringChecker  # owns the released text; holds back what may become a stop string
    emitted_tokens: int = 0  # output tokens already reported to the caller
    text_delta: str = ""  # released text not yet reported
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)


class LLMEngine:
    def __init__(self, config: EngineConfig, *, warmup: bool = True) -> None:
        self.config = config
        dtype = jnp.dtype(config.dtype)
        self.parallel_plan = None  # sarathi_jax.parallel.ParallelPlan when tensor/pipeline parallel
        if config.tensor_parallel_size * config.pipeline_parallel_size > 1:
            from sarathi_jax.parallel import load_parallel_model  # ValueError on a split that cannot work

            self.parallel_plan, self.model_config, params = load_parallel_model(
                config.model, dtype, config.seed, config.tensor_parallel_size, config.pipeline_parallel_size
            )
        else:
            self.model_config, params = load_model(config.model, dtype, seed=config.seed)
        self.tokenizer: Tokenizer | None = load_tokenizer(config.model) if Path(config.model).is_dir() else None
        mc = self.model_config

        sizing = size_engine(config, mc)
        num_blocks, self.max_model_len = sizing.num_blocks, sizing.max_model_len
        self.scheduler_config = sizing.scheduler_config
        self.block_manager = BlockManager(
            num_blocks, config.block_size, watermark_blocks=int(config.watermark * num_blocks)
        )
        self.scheduler = make_scheduler(self.scheduler_config, self.block_manager)
        self.runner = ModelRunner(
            mc,
            params,
            dtype=dtype,
            attention_fn=get_attention_fn(config.attention_backend),
            num_blocks=num_blocks,
            block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_model_len=self.max_model_len,
            max_step_tokens=sizing.max_step_tokens,
            plan=self.parallel_plan,
        )
        if warmup:
            self.runner.warmup()
        self._in_flight_steps: deque = deque()  # pipeline parallelism: (output, pending step, start time)

        self._requests: dict[str, _RequestState] = {}
        self._pending_outputs: list[RequestOutput] = []  # aborts, reported by the next step()
        self._seed_rng = np.random.default_rng(config.seed)
        self._eos_token_ids = tuple(mc.eos_token_ids)
        self.iteration_log: list[IterationRecord] = []

    # ----------------------------------------------------------------------------------- requests in

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Validate and queue a request. Raises ValueError naming the bad field; the engine is unchanged then."""
        params = params or SamplingParams()
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        prompt_token_ids = self._prompt_to_ids(prompt)
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt: {len(prompt_token_ids)} tokens leave no room to generate within max_model_len={self.max_model_len}"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer, and this model has none (use stop_token_ids)")
        vocab_size = self.model_config.vocab_size
        bad_stop_ids = [t for t in params.stop_token_ids if t >= vocab_size]
        if bad_stop_ids:
            raise ValueError(f"stop_token_ids: {bad_stop_ids} outside the vocabulary of size {vocab_size}")
        banned = () if params.min_tokens == 0 else tuple(dict.fromkeys(
            (() if params.ignore_eos else self._eos_token_ids) + params.stop_token_ids
        ))
        if len(banned) > MAX_BANNED:
            raise ValueError(f"stop_token_ids: with min_tokens at most {MAX_BANNED} stop and EOS ids can be suppressed")

        seq = Sequence(request_id, prompt_token_ids, params, time.monotonic() if arrival_time is None else arrival_time)
        seed = params.seed if params.seed is not None else int(self._seed_rng.integers(0, 2**31 - 1))
        detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_token_ids) if self.tokenizer else None
        self._requests[request_id] = _RequestState(seq, tuple(prompt_token_ids), seed, banned, detokenizer, StopStringChecker(params.stop))
        self.scheduler.add_sequence(seq)

    def _prompt_to_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: text prompts need a tokenizer; this model has none, pass token ids")
            if not prompt:
                raise ValueError("prompt: empty")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("prompt: empty")
        vocab_size = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt: token ids {bad[:5]} outside the vocabulary [0, {vocab_size})")
        return ids

    def abort(self, request_id: str) -> bool:
        """Abort a request now: its KV blocks are freed at once and its last output says finish_reason='abort'."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return False
        self.scheduler.abort_sequence(request_id)
        seq = state.seq
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = "abort"
        seq.metrics.finished_time = time.monotonic()
        self._pending_outputs.append(self._make_output(state))
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests or self._pending_outputs or self._in_flight_steps)

    # ----------------------------------------------------------------------------------- one iteration

    def step(self) -> list[RequestOutput]:
        """Schedule and dispatch one batch, then retire the oldest batch in flight.

        With pipeline_parallel_size = pp > 1 up to pp micro-batches are in flight: a new one is dispatched
        without waiting (the scheduler never picks a sequence still in flight), and the oldest is retired only
        when pp are in flight or nothing new could be scheduled, so stage k runs micro-batch i while stage
        k+1 runs i-1. With pp = 1 every batch is retired by the call that dispatched it.
        """
        outputs, self._pending_outputs = self._pending_outputs, []
        sched = self.scheduler.schedule()
        for seq in sched.rejected:
            state = self._requests.pop(seq.seq_id)
            seq.metrics.finished_time = time.monotonic()
            outputs.append(self._make_output(state))
        if sched.chunks:
            start = time.monotonic()
            for chunk in sched.chunks:
                if chunk.seq.metrics.first_scheduled_time is None:
                    chunk.seq.metrics.first_scheduled_time = start
            pending = self.runner.submit(sched.chunks, [self._sampling_row(chunk.seq) for chunk in sched.chunks])
            self._in_flight_steps.append((sched, pending, start))
        if not self._in_flight_steps or (
            sched.chunks and len(self._in_flight_steps) < self.config.pipeline_parallel_size
        ):
            return outputs

        sched, pending, start = self._in_flight_steps.popleft()
        sampled = pending.result()
        self.scheduler.on_step_done(sched)
        now = time.monotonic()
        for i, chunk in enumerate(sched.chunks):
            if not chunk.needs_sample:
                continue
            state = self._requests.get(chunk.seq.seq_id)
            if state is None:  # aborted while its micro-batch was in flight
                continue
            self._append_token(state, sampled, i, now)
            outputs.append(self._make_output(state))
            if state.seq.status == SequenceStatus.FINISHED:
                del self._requests[chunk.seq.seq_id]
        # Under pp > 1 the duration runs from dispatch to retirement and overlaps other micro-batches.
        self._record_iteration(sched, start, now)
        return outputs

    # ----------------------------------------------------------------------------------- pipeline parallelism

    def pipeline_stats(self) -> dict:
        """Pipeline accounting since start (or `reset_pipeline_stats`): `bubble_fraction`
        (1 - busy / (stages x wall)), `stage_busy_s`, `wall_s`, `num_microbatches`, `max_in_flight` (most
        micro-batches dispatched and not yet retired at once) and `max_overlap` (most whose device work
        overlapped in time). See `sarathi_jax.parallel.pipeline`. With pipeline_parallel_size 1 nothing is
        measured: bubble_fraction is None."""
        timeline = self.runner.timeline
        if timeline is None:
            return {"num_stages": 1, "num_microbatches": len(self.iteration_log),
                    "max_in_flight": min(1, len(self.iteration_log)), "bubble_fraction": None}
        return timeline.stats()

    def reset_pipeline_stats(self) -> None:
        if self.runner.timeline is not None:
            self.runner.timeline.reset()

    @property
    def max_microbatches_in_flight(self) -> int:
        timeline = self.runner.timeline
        return timeline.max_in_flight if timeline is not None else min(1, len(self.iteration_log))

    # ----------------------------------------------------------------------------------- sampling rows

    def _sampling_row(self, seq: Sequence) -> tuple:
        state = self._requests[seq.seq_id]
        banned = state.banned_until_min_tokens if seq.num_output_tokens < seq.sampling_params.min_tokens else ()
        return (seq.sampling_params, state.seed, seq.num_output_tokens, banned)

    def _append_token(self, state: _RequestState, sampled, row: int, now: float) -> None:
        seq, params = state.seq, state.seq.sampling_params
        token_id = int(sampled.token_ids[row])
        seq.append_token(token_id)
        if seq.metrics.first_token_time is None:
            seq.metrics.first_token_time = now
        seq.metrics.token_times.append(now)
        if params.logprobs is not None:
            n = params.logprobs
            state.pending_logprobs.append(TokenLogprob(
                token_id,
                float(sampled.logprobs[row]),
                tuple(int(t) for t in sampled.top_token_ids[row, :n]),
                tuple(float(x) for x in sampled.top_logprobs[row, :n]),
            ))

        reason = None
        if state.detokenizer is not None:
            delta = state.detokenizer.append(token_id)
            checker = state.stop_checker
            state.text_delta += checker.add(delta, detect=seq.num_output_tokens >= params.min_tokens)
            if checker.stopped:
                reason = "stop"
        if reason is None and seq.num_output_tokens >= params.min_tokens:
            if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in self._eos_token_ids):
                reason = "stop"
        # prompt + max_tokens <= max_model_len is enforced at admission (longer requests are rejected).
        if reason is None and seq.num_output_tokens >= params.max_tokens:
            reason = "length"
        if reason is not None:
            if state.detokenizer is not None and reason != "stop":
                # Release a held-back partial character and any tail held for stop strings.
                state.text_delta += state.stop_checker.add(state.detokenizer.flush(), detect=False)
                state.text_delta += state.stop_checker.flush()
            self.scheduler.finish_sequence(seq, reason)
            seq.metrics.finished_time = now

    def _make_output(self, state: _RequestState) -> RequestOutput:
        seq = state.seq
        new_ids = tuple(seq.output_token_ids[state.emitted_tokens :])
        finished = seq.status == SequenceStatus.FINISHED
        text_delta, state.text_delta = state.text_delta, ""
        state.emitted_tokens = seq.num_output_tokens
        logprobs, state.pending_logprobs = tuple(state.pending_logprobs), []
        return RequestOutput(
            request_id=seq.seq_id,
            prompt_token_ids=state.prompt_token_ids,
            new_token_ids=new_ids,
            token_ids=tuple(seq.output_token_ids),
            text_delta=text_delta,
            text=state.stop_checker.text,
            new_logprobs=logprobs,
            finished=finished,
            finish_reason=seq.finish_reason if finished else None,
            metrics=seq.metrics,
            error=seq.error,
        )

    def _record_iteration(self, sched: SchedulerOutput, start: float, end: float) -> None:
        self.iteration_log.append(IterationRecord(
            iteration=len(self.iteration_log),
            start_time=start,
            duration=end - start,
            num_prefill_tokens=sched.num_prefill_tokens,
            num_decode_tokens=sched.num_decode_tokens,
            num_seqs=len(sched.chunks),
            chunk_sizes=tuple(c.num_new_tokens for c in sched.chunks if not c.is_decode),
            num_preemptions=len(sched.preempted),
            num_padded_tokens=self.runner.bucket_for(sched.num_batched_tokens),
        ))

    # ----------------------------------------------------------------------------------- introspection

    def stats(self) -> dict:
        return self.scheduler.stats()
