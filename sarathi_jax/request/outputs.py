"""What the engine hands back to callers, one `RequestOutput` per request per step that changed it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

# Why a request ended. "stop": EOS, a stop token or a stop string; "length": max_tokens or max_model_len;
# "abort": cancelled by the caller; "error": the engine could not serve it (see RequestOutput.error).
FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclass(frozen=True)
class TokenLogprob:
    """Log-probability of a sampled token, and the top-N alternatives at that step (most likely first)."""

    token_id: int
    logprob: float
    top_token_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


def elapsed(start: float, end: float | None) -> float | None:
    """end - start, or None when `end` never happened."""
    return None if end is None else end - start


def token_gaps(token_times: Sequence[float]) -> list[float]:
    """The TBTs: time between consecutive tokens (the first token excluded)."""
    return [b - a for a, b in zip(token_times, token_times[1:])]


class RequestLatencies:
    """TTFT, TBTs, scheduling delay and end-to-end latency of a request, for the dataclasses that record its
    timestamps (`RequestMetrics`; the bench's `RequestRecord`): `arrival_time`, `first_scheduled_time`,
    `first_token_time`, `token_times` (one per generated token, first included) and `finished_time`, each
    None (or empty) until it happened."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    token_times: list[float]
    finished_time: float | None

    @property
    def ttft(self) -> float | None:
        return elapsed(self.arrival_time, self.first_token_time)

    @property
    def tbts(self) -> list[float]:
        return token_gaps(self.token_times)

    @property
    def scheduling_delay(self) -> float | None:
        return elapsed(self.arrival_time, self.first_scheduled_time)

    @property
    def e2e_latency(self) -> float | None:
        return elapsed(self.arrival_time, self.finished_time)


@dataclass
class RequestMetrics(RequestLatencies):
    """Wall-clock timestamps (time.monotonic seconds, or the simulator's virtual clock) of one request, and the
    request's own SLO targets (None: none) with whether it met them so far.

    slo_ttft_s: TTFT <= slo_ttft_s. slo_tbt_s: a deadline on every token after the first, counted from the token
    before it (every TBT <= slo_tbt_s, the bench's goodput rule; not a P99 of the request's TBTs)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # one per generated token, first included
    finished_time: float | None = None
    num_preemptions: int = 0
    slo_ttft_s: float | None = None
    slo_tbt_s: float | None = None

    @property
    def slo_ttft_met(self) -> bool | None:
        """TTFT within slo_ttft_s; None without a target, or before the first token unless the target passed."""
        if self.slo_ttft_s is None:
            return None
        if self.first_token_time is None:
            return False if self.finished_time is not None else None
        return self.first_token_time - self.arrival_time <= self.slo_ttft_s

    @property
    def slo_tbt_met(self) -> bool | None:
        """Every TBT so far within slo_tbt_s; None without a target."""
        if self.slo_tbt_s is None:
            return None
        times, limit = self.token_times, self.slo_tbt_s
        return all(b - a <= limit for a, b in zip(times, times[1:]))

    @property
    def slo_met(self) -> bool | None:
        """Every target it has met: True or False; None when it has none, or it is undecided yet (no first
        token). A finished request without a first token misses a TTFT target."""
        if self.slo_ttft_s is None and self.slo_tbt_s is None:
            return None
        met = [m for m, target in ((self.slo_ttft_met, self.slo_ttft_s), (self.slo_tbt_met, self.slo_tbt_s))
               if target is not None]
        return False if False in met else (None if None in met else True)

    # Speculative decoding: draft tokens verified for this request, how many the target accepted, in how many
    # verification steps (chunks that carried drafts).
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verify_steps: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / proposed draft tokens (None: never speculated)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens a verification step yields on average: accepted drafts + the target's own token."""
        steps = self.num_verify_steps
        return (self.num_accepted_tokens + steps) / steps if steps else None


@dataclass(slots=True)
class RequestOutput:
    """The state of one request after a step: a snapshot, read-only by convention.

    `new_token_ids` / `text_delta` / `new_logprobs` are what this step added; `token_ids` / `text` are the
    whole output so far. `text` is "" when no tokenizer is loaded. Not a frozen dataclass: the engine makes one
    per request per step, and a frozen one takes twice as long to build (3 against 1.3 microseconds here).
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    new_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text_delta: str
    text: str
    new_logprobs: tuple[TokenLogprob, ...]
    finished: bool
    finish_reason: str | None
    metrics: RequestMetrics
    error: str | None = None
    # With finish_reason "error": the request field at fault ("structured_outputs": its constraint failed on the
    # way, the client's error), or None (the engine could not serve it).
    error_param: str | None = None


@dataclass(frozen=True)
class IterationRecord:
    """One engine iteration, for timelines, stall analysis and pipeline-bubble accounting."""

    iteration: int
    start_time: float
    duration: float  # seconds, wall clock (virtual in the simulator)
    num_prefill_tokens: int
    num_decode_tokens: int
    num_seqs: int
    chunk_sizes: tuple[int, ...]  # prefill chunk sizes scheduled this iteration
    num_preemptions: int
    num_padded_tokens: int  # the bucket the step ran at (>= prefill + decode tokens)
    instance: str = ""  # which instance ran it: "" one (colocated); "prefill0", "decode0", ... (disaggregation)
    # Disaggregation: the K/V moved into this instance that landed since its previous iteration (bytes, and
    # seconds summed over those transfers: `disagg.state.TransferRecord`).
    transfer_bytes: int = 0
    transfer_seconds: float = 0.0
    token_limit: int | None = None  # the token budget this iteration was built under
    predicted_s: float | None = None  # token_budget "dynamic": its predicted time (cost model + measured slack)
    slack_s: float | None = None  # of which the measured slack (scheduler/budget.py, IterationFeedback)
