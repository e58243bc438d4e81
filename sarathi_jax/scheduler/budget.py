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
chunk of the rest starting where the earliest running prefill stands (0 when none: a new prompt). Its target is
the tightest `slo_tbt_s` among the running requests that have produced a token (a request without its own
target has the engine's); with none of them, the budget is the compiled maximum.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from sarathi_jax.request.sequence import Batch, Sequence

TILE = 16  # budgets are multiples of a matmul tile of rows (EngineConfig's rule for token_budget)
DEFAULT_MARGIN = 0.9
REFERENCE_DECODES = 32


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

    def scheduled(self, batch: Batch) -> None:
        """The batch built under the last limit, as it will run."""


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
    rounded up to TILE, max_budget] whose iteration is predicted within margin x the tightest TBT target among
    the running requests that have produced a token. `default_slo_tbt_s`: the target of requests without their
    own. `last`: the most recent (budget, target) pair, for reports."""

    def __init__(self, predictor: IterationPredictor, *, max_budget: int, default_slo_tbt_s: float | None,
                 margin: float = DEFAULT_MARGIN) -> None:
        if max_budget % TILE or max_budget < TILE:
            raise ValueError(f"max_budget must be a positive multiple of {TILE}, got {max_budget}")
        self.predictor = predictor
        self.max_budget = max_budget
        self.default_slo_tbt_s = default_slo_tbt_s
        self.margin = margin
        self.last: tuple[int, float | None] = (max_budget, None)
        self.feedback: IterationFeedback | None = None  # the engine's measured correction (token_budget.install)

    def target(self, running: SequenceOf[Sequence]) -> float | None:
        """The tightest TBT target among running requests past their first token (None: none has one)."""
        default = self.default_slo_tbt_s
        targets = [t for s in running if s.num_generated_tokens
                   for t in ((s.metrics.slo_tbt_s if s.metrics.slo_tbt_s is not None else default),) if t is not None]
        return min(targets, default=None)

    def token_limit(self, running: SequenceOf[Sequence], decodes: SequenceOf[Sequence],
                    prefills: SequenceOf[Sequence]) -> int:
        target = self.target(running)
        if target is None:
            self.last = (self.max_budget, None)
            return self.max_budget
        positions = [s.num_computed_tokens for s in decodes]
        start = prefills[0].num_computed_tokens if prefills else 0
        lo = min(max(TILE, round_up(len(positions))), self.max_budget)
        correction = 1.0 if self.feedback is None else self.feedback.correction(busy=bool(decodes))
        budget = largest_budget(
            lambda b: self.predictor.mixed_batch_time(positions, start, b - len(positions)),
            self.margin * target / correction, lo, self.max_budget)
        self.last = (budget, target)
        return budget

    def scheduled(self, batch: Batch) -> None:
        """The batch built under this iteration's limit: its own predicted time, for the feedback's ratio."""
        if self.feedback is None:
            return
        decodes = [seq.num_computed_tokens for seq, n, is_prefill in batch.items if not is_prefill]
        if not decodes:  # only iterations that hold decodes are some request's time between tokens
            self.feedback.start(None)
            return
        prefill = [(seq.num_computed_tokens, n) for seq, n, is_prefill in batch.items if is_prefill]
        extra = sum(n - 1 for _, n, is_prefill in batch.items if not is_prefill)  # speculative rows
        start = prefill[0][0] if prefill else 0
        self.feedback.start(self.predictor.mixed_batch_time(decodes, start, sum(n for _, n in prefill) + extra))


class IterationFeedback:
    """What the cost model misses, measured: the ratio of each iteration's time (from its scheduling to the next
    one's, while decodes keep the engine busy: a decode's time between tokens) to its predicted time, over the
    last `window` iterations. `correction()` is their `quantile` (at least 1, and 1 until `min_samples`):
    dividing the limit by it keeps that share of iterations within the prediction's limit even where the
    machine's own noise (other processes, the host's time, a slow step's tail) makes steps take longer than
    the calibration measured. On a virtual clock the iterations take their predicted time, so it stays 1."""

    def __init__(self, clock: Callable[[], float], *, window: int = 128, quantile: float = 0.95,
                 min_samples: int = 16) -> None:
        self.clock = clock
        self.ratios: deque[float] = deque(maxlen=window)
        self.quantile = quantile
        self.min_samples = min_samples
        self._started: tuple[float, float] | None = None  # (predicted seconds, clock at scheduling)

    def correction(self, *, busy: bool) -> float:
        """Called as the next iteration is scheduled: the last one's ratio is recorded if `busy` (decodes were
        ready, so the engine went straight on), then the current correction."""
        if self._started is not None and busy:
            predicted, t0 = self._started
            if predicted > 0:
                self.ratios.append((self.clock() - t0) / predicted)
        self._started = None
        if len(self.ratios) < self.min_samples:
            return 1.0
        ordered = sorted(self.ratios)
        return max(1.0, ordered[min(len(ordered) - 1, int(self.quantile * len(ordered)))])

    def start(self, predicted_s: float | None) -> None:
        self._started = None if predicted_s is None else (predicted_s, self.clock())
