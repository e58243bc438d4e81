"""Token budgets from a TBT target: `pick_auto_budget` (token_budget="auto": one budget, picked at start-up)
and `SloTokenBudget` (token_budget="dynamic": a budget per iteration). Plain Python, no JAX. The design:
docs/design/scheduler.md.

Both ask an `IterationPredictor` (a cost model calibrated on the device: `sarathi_jax.sim.cost_model.BucketCostModel`,
or the simulator's `CostModel`) how long a batch of running decodes plus one prefill chunk takes, and take the
largest multiple of `TILE` tokens whose predicted time is at most `margin` x the target. The margin
(`EngineConfig.slo_margin`, default `DEFAULT_MARGIN` = 0.9) leaves room for what the prediction misses: the
fit's error, the host's own time per iteration, noise. A budget never goes below the decodes it must hold, so
running decodes always fit (stall-free): when even they alone are predicted over the target, the budget is just
big enough for them.

"auto" predicts a worst-case iteration of B tokens (`reference_batch`): min(REFERENCE_DECODES, max_num_seqs - 1,
B // 2) decodes at the longest context a request may reach (max_model_len), and a prefill chunk of the rest
ending there. It thus holds the target whatever the contexts, and is conservative where they stay short (a
fixed 512-token reference picks budgets whose iterations overrun the target on longer traces).
"dynamic" predicts the iteration it is about to build: the ready decodes at their own contexts, and a prefill
chunk of the rest starting where the earliest running prefill stands (0 when none: a new prompt). Its limit is
margin x the tightest `slo_tbt_s` among the running requests that have produced a token (a request without its
own target has the engine's), and at most ARRIVAL_SHARE x the tightest `slo_ttft_s` among the recent arrivals
(so that an arrival does not wait behind a long iteration); with neither, the budget is the compiled maximum.
On a real engine the prediction adds what the cost model misses on this device, measured per bucket as the
engine runs (`IterationFeedback`: a high quantile of measured minus predicted step times).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from sarathi_jax.request.sequence import Batch, Sequence

TILE = 16  # budgets are multiples of a matmul tile of rows (EngineConfig's rule for token_budget)
DEFAULT_MARGIN = 0.9
REFERENCE_DECODES = 32
ARRIVAL_SHARE = 0.2  # "dynamic": no iteration longer than this share of the tightest TTFT among recent arrivals
RECENT_ARRIVALS = 32  # how many of the latest admitted requests make "the recent arrival mix"


class IterationPredictor(Protocol):
    """A cost model's prediction of one iteration: decodes whose K/V start at `decode_positions` (a decode at
    position p sees p + 1 keys), and one prefill chunk of `prefill_tokens` tokens after `prefill_start` cached
    ones (no chunk when 0)."""

    def mixed_batch_time(self, decode_positions: SequenceOf[int], prefill_start: int, prefill_tokens: int) -> float: ...


@runtime_checkable
class BudgetPolicy(Protocol):
    """What the Sarathi scheduler asks each iteration: the most tokens this batch may hold, given the running
    sequences (in order), those of them ready to decode now, and those still prefilling."""

    def token_limit(self, running: SequenceOf[Sequence], decodes: SequenceOf[Sequence],
                    prefills: SequenceOf[Sequence]) -> int: ...

    def scheduled(self, batch: Batch) -> tuple[float, float] | None:
        """The batch built under the last limit, as it will run; returns its (predicted seconds, of which
        measured slack), None when the policy predicts nothing."""


@dataclass(frozen=True)
class BudgetChoice:
    """A budget picked for a TBT target: `predicted_s` for its reference iteration; `meets`: predicted_s <=
    margin x target_s (False when no budget does: then the smallest allowed)."""

    budget: int
    predicted_s: float
    target_s: float
    margin: float
    meets: bool


def round_up(n: int, tile: int = TILE) -> int:
    return -(-n // tile) * tile


def largest_budget(predict: Callable[[int], float], limit_s: float, lo: int, hi: int) -> int:
    """The largest multiple of TILE in [lo, hi] (both multiples of TILE) with predict(b) <= limit_s, or lo
    when none. A binary search: the predicted time grows with the budget (a larger bucket, more prefill)."""
    assert lo % TILE == 0 and hi % TILE == 0 and TILE <= lo <= hi, (lo, hi)
    if predict(hi) <= limit_s:
        return hi
    if predict(lo) > limit_s:
        return lo
    good, bad = lo, hi  # predict(good) fits, predict(bad) does not
    while bad - good > TILE:
        mid = (good + bad) // (2 * TILE) * TILE
        if predict(mid) <= limit_s:
            good = mid
        else:
            bad = mid
    return good


def reference_batch(budget: int, max_num_seqs: int, max_model_len: int) -> tuple[list[int], int, int]:
    """"auto"'s worst-case iteration of `budget` tokens, as `mixed_batch_time`'s arguments: the decodes at the
    last position a request may reach, the prefill chunk ending at max_model_len."""
    num_decodes = min(REFERENCE_DECODES, max_num_seqs - 1, budget // 2)  # and the prefill chunk: max_num_seqs
    chunk = budget - num_decodes
    return [max_model_len - 1] * num_decodes, max(0, max_model_len - chunk), chunk


def pick_auto_budget(predictor: IterationPredictor, slo_tbt_s: float, *, max_budget: int, max_num_seqs: int,
                     max_model_len: int, margin: float = DEFAULT_MARGIN) -> BudgetChoice:
    """token_budget="auto": the largest budget in [max_num_seqs rounded up to TILE, max_budget] whose worst-case
    iteration (`reference_batch`) is predicted within margin x slo_tbt_s."""
    def predict(b: int) -> float:
        return predictor.mixed_batch_time(*reference_batch(b, max_num_seqs, max_model_len))

    lo = min(max(TILE, round_up(max_num_seqs)), max_budget)
    budget = largest_budget(predict, margin * slo_tbt_s, lo, max_budget)
    predicted = predict(budget)
    return BudgetChoice(budget, predicted, slo_tbt_s, margin, predicted <= margin * slo_tbt_s)


class SloTokenBudget:
    """token_budget="dynamic" (a `BudgetPolicy`): each iteration, the largest budget in [the ready decodes
    rounded up to TILE, max_budget] whose iteration is predicted within its time limit: the smaller of margin x
    the tightest TBT target among the running requests that have produced a token, and `arrival_share` x the
    tightest TTFT target among the last `recent_arrivals` requests admitted (room for arrivals: a request that
    arrives while an iteration runs waits for it before its prefill can start, so no iteration, a batch-only one
    included, takes more than that share of the TTFT the recent mix asks for). The prediction is the cost model's
    plus the measured slack of its bucket (`IterationFeedback`, when the engine installs one). With neither
    target, the budget is the compiled maximum. `default_slo_tbt_s`: the TBT target of requests without their
    own. `bucket_of(tokens)`: the padded bucket a batch of that many tokens runs at (the feedback's key).
    `last`: the most recent (budget, time limit) pair, for reports."""

    def __init__(self, predictor: IterationPredictor, *, max_budget: int, default_slo_tbt_s: float | None,
                 margin: float = DEFAULT_MARGIN, bucket_of: Callable[[int], int] | None = None,
                 arrival_share: float = ARRIVAL_SHARE, recent_arrivals: int = RECENT_ARRIVALS) -> None:
        if max_budget % TILE or max_budget < TILE:
            raise ValueError(f"max_budget must be a positive multiple of {TILE}, got {max_budget}")
        self.predictor = predictor
        self.max_budget = max_budget
        self.default_slo_tbt_s = default_slo_tbt_s
        self.margin = margin
        self.bucket_of = bucket_of or round_up
        self.arrival_share = arrival_share
        self.last: tuple[int, float | None] = (max_budget, None)
        self.feedback: IterationFeedback | None = None  # the engine's measured slack (token_budget.install)
        self._recent_arrivals = recent_arrivals
        self._arrivals: dict[str, float] = {}  # the TTFT targets of the latest admitted requests, oldest first

    def target(self, running: SequenceOf[Sequence]) -> float | None:
        """The tightest TBT target among running requests past their first token (None: none has one)."""
        default = self.default_slo_tbt_s
        targets = [t for s in running if s.num_generated_tokens
                   for t in ((s.metrics.slo_tbt_s if s.metrics.slo_tbt_s is not None else default),) if t is not None]
        return min(targets, default=None)

    def time_limit(self, running: SequenceOf[Sequence]) -> float | None:
        """This iteration's predicted-time limit (class doc); None: no target bounds it."""
        target = self.target(running)
        limits = [self.margin * target] if target is not None else []
        if self._arrivals:
            limits.append(self.arrival_share * min(self._arrivals.values()))
        return min(limits, default=None)

    def predict(self, decode_positions: SequenceOf[int], prefill_start: int, prefill_tokens: int) -> float:
        """The cost model's time for this batch plus its bucket's measured slack."""
        return sum(self._prediction(decode_positions, prefill_start, prefill_tokens))

    def _prediction(self, decode_positions: SequenceOf[int], prefill_start: int, prefill_tokens: int
                    ) -> tuple[float, float]:
        """(the cost model's seconds, the measured slack of the batch's bucket)."""
        prior = self.predictor.mixed_batch_time(decode_positions, prefill_start, prefill_tokens)
        if self.feedback is None:
            return prior, 0.0
        return prior, self.feedback.slack_s(self.bucket_of(len(decode_positions) + prefill_tokens))

    def token_limit(self, running: SequenceOf[Sequence], decodes: SequenceOf[Sequence],
                    prefills: SequenceOf[Sequence]) -> int:
        if self.feedback is not None:
            self.feedback.observe()
        limit_s = self.time_limit(running)
        if limit_s is None:
            self.last = (self.max_budget, None)
            return self.max_budget
        positions = [s.num_computed_tokens for s in decodes]
        start = prefills[0].num_computed_tokens if prefills else 0
        lo = min(max(TILE, round_up(len(positions))), self.max_budget)
        budget = largest_budget(lambda b: self.predict(positions, start, b - len(positions)), limit_s, lo,
                                self.max_budget)
        self.last = (budget, limit_s)
        return budget

    def scheduled(self, batch: Batch) -> tuple[float, float]:
        """The batch built under this iteration's limit: its (predicted seconds, of which measured slack), for
        its iteration record (which the feedback reads back). The TTFT targets of the requests it admits join the
        recent arrivals."""
        for seq, _, is_prefill in batch.items:
            ttft = seq.metrics.slo_ttft_s
            if is_prefill and ttft is not None and not seq.num_generated_tokens and seq.seq_id not in self._arrivals:
                self._arrivals[seq.seq_id] = ttft
                if len(self._arrivals) > self._recent_arrivals:
                    del self._arrivals[next(iter(self._arrivals))]  # the oldest
        decodes = [seq.num_computed_tokens for seq, n, is_prefill in batch.items if not is_prefill]
        prefill = [(seq.num_computed_tokens, n) for seq, n, is_prefill in batch.items if is_prefill]
        extra = sum(n - 1 for _, n, is_prefill in batch.items if not is_prefill)  # speculative rows
        start = prefill[0][0] if prefill else 0
        prior, slack = self._prediction(decodes, start, sum(n for _, n in prefill) + extra)
        return prior + slack, slack


class IterationFeedback:
    """What the cost model misses, measured on the device it runs on, per compiled bucket, from the engine's own
    iteration records (`log`: the engine core's `iteration_log`, read as it grows). For each iteration that holds
    decodes and was predicted, the time from the previous iteration's end to its end (the time between tokens
    of its decodes: the device's step plus whatever the host added, in either loop; an overlapped batch's
    record also spans its wait for the one before; after an idle gap, its own duration) less the cost model's
    prediction of it (its `predicted_s` less its `slack_s`): the last `window` residuals of each padded bucket.
    `slack_s(bucket)` is their `quantile`: added to a prediction of that bucket, it keeps that share of the
    bucket's iterations within the prediction, the tail included (a noisy small bucket and a steady large one each
    get their own). A bucket with fewer than `min_samples` residuals takes the quantile of the recent residuals
    of all buckets; with fewer than `min_samples` in all, 0 (the calibrated prior alone). The slack is negative
    where the prior over-predicts, which lets the budget use that room. On a virtual clock the iterations take
    the cost model's time, so it stays near 0."""

    def __init__(self, log: SequenceOf[Any], *, window: int = 64, quantile: float = 0.99,
                 min_samples: int = 8) -> None:
        self.log = log
        self.window = window
        self.quantile = quantile
        self.min_samples = min_samples
        self.by_bucket: dict[int, deque[float]] = {}
        self.pooled: deque[float] = deque(maxlen=4 * window)
        self._slack: dict[int, float] = {}  # this iteration's slack per bucket (cleared when a residual lands)
        self._read = 0  # records of `log` already read
        self._previous_end: float | None = None

    def observe(self) -> None:
        """Read the records the engine appended since the last call (a log cleared by its owner starts over)."""
        log = self.log
        if len(log) < self._read:
            self._read, self._previous_end = 0, None
        for record in log[self._read:]:
            end = record.start_time + record.duration
            previous, self._previous_end = self._previous_end, end
            predicted, slack = record.predicted_s, record.slack_s
            if previous is None or predicted is None or not record.num_decode_tokens:
                continue  # no time between tokens to learn from
            prior = predicted - (slack or 0.0)
            # From the previous end (its dispatch waited on that, or the host's time followed it); after a gap
            # longer than a step the engine was idle, and its own duration is its time.
            measured = end - previous if record.start_time - previous < prior else record.duration
            self.add(record.num_padded_tokens, prior, measured)
        self._read = len(log)

    def add(self, bucket: int, predicted_s: float, measured_s: float) -> None:
        """One iteration of `bucket`: the cost model predicted `predicted_s`, it took `measured_s`."""
        residual = measured_s - predicted_s
        self.by_bucket.setdefault(bucket, deque(maxlen=self.window)).append(residual)
        self.pooled.append(residual)
        self._slack.clear()

    def slack_s(self, bucket: int) -> float:
        """Seconds to add to a prediction of `bucket` (see the class doc)."""
        slack = self._slack.get(bucket)
        if slack is None:
            own = self.by_bucket.get(bucket, ())
            samples = own if len(own) >= self.min_samples else self.pooled
            slack = _quantile(samples, self.quantile) if len(samples) >= self.min_samples else 0.0
            self._slack[bucket] = slack
        return slack


def _quantile(samples: SequenceOf[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
