"""Token budgets from a TBT target (sarathi_jax/scheduler/budget.py, sarathi_jax/engine/token_budget.py): "auto" picks
the budget a synthetic cost model's known answer says; the dynamic budget stays within its bounds and running
decodes are never displaced, on random traces under hypothesis on the plain-Python Sarathi scheduler; bad
configurations are refused."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sarathi_jax.engine import token_budget
from sarathi_jax.scheduler.block_manager import BlockManager
from sarathi_jax.config.engine_config import EngineConfig
from sarathi_jax.sim.cost_model import BucketCostModel
from sarathi_jax.request.sampling_params import SamplingParams
from sarathi_jax.scheduler import SchedulerConfig
from sarathi_jax.scheduler.budget import (TILE, IterationFeedback, SloTokenBudget, largest_budget, pick_auto_budget,
                                          reference_batch)
from sarathi_jax.scheduler.registry import SCHEDULERS
from sarathi_jax.request.sequence import Sequence
from sarathi_jax.config.sizing import bucket_for, bucket_ladder, platform_buckets
from scheduler_harness import complete

MAX_MODEL_LEN = 256


@dataclass(frozen=True)
class Linear:
    """A synthetic cost model: overhead + per_token x tokens + per_key x (decode keys + prefill pairs)."""

    overhead_s: float = 0.01
    per_token_s: float = 1e-4
    per_key_s: float = 0.0

    def mixed_batch_time(self, decode_positions, prefill_start, prefill_tokens) -> float:
        keys = sum(p + 1 for p in decode_positions) + prefill_tokens * prefill_start + prefill_tokens * (
            prefill_tokens + 1) // 2
        return (self.overhead_s + self.per_token_s * (len(decode_positions) + prefill_tokens)
                + self.per_key_s * keys)


# ----------------------------------------------------------------------------------------------- "auto"


def test_auto_picks_the_known_answer():
    # 0.01 + 1e-4 x B <= 0.9 x 0.05 = 0.045  <=>  B <= 350: the largest multiple of 16 is 336.
    choice = pick_auto_budget(Linear(), 0.05, max_budget=2048, max_num_seqs=8, max_model_len=1024)
    assert (choice.budget, choice.meets) == (336, True)
    assert choice.predicted_s == pytest.approx(0.01 + 336e-4)
    assert pick_auto_budget(Linear(), 10.0, max_budget=512, max_num_seqs=8, max_model_len=1024).budget == 512  # everything fits
    tight = pick_auto_budget(Linear(), 0.001, max_budget=512, max_num_seqs=40, max_model_len=1024)  # nothing fits: room for the seqs
    assert (tight.budget, tight.meets) == (48, False)
    assert pick_auto_budget(Linear(), 0.05, max_budget=2048, max_num_seqs=8, max_model_len=1024, margin=1.0).budget == 400


def test_auto_reference_batch_is_the_worst_case_iteration():
    positions, start, tokens = reference_batch(256, max_num_seqs=8, max_model_len=1024)
    assert len(positions) == 7 and len(positions) + tokens == 256
    assert positions == [1023] * 7 and start + tokens == 1024  # decodes at the last position, the chunk ends there
    positions, _, tokens = reference_batch(16, max_num_seqs=128, max_model_len=1024)
    assert len(positions) == 8 and tokens == 8


def test_auto_holds_the_target_at_the_longest_context():
    # Keys cost too: the same target admits a smaller budget when requests may grow longer.
    model = Linear(per_key_s=1e-7)
    short = pick_auto_budget(model, 0.05, max_budget=2048, max_num_seqs=8, max_model_len=512)
    long = pick_auto_budget(model, 0.05, max_budget=2048, max_num_seqs=8, max_model_len=4096)
    assert short.meets and long.meets and long.budget < short.budget
    assert long.predicted_s == pytest.approx(model.mixed_batch_time(*reference_batch(long.budget, 8, 4096)))


def test_auto_with_a_bucket_cost_model_predicts_each_candidate_as_its_own_top_bucket():
    """Measured buckets 16 and 1024 with a base linear in between: the engine compiled for B pads a B-token
    batch to B, so the answer is the linear model's 336, not a measured bucket."""
    model = BucketCostModel({16: 0.01 + 16e-4, 1024: 0.01 + 1024e-4}, 0.0, 0.0)
    config = EngineConfig(token_budget="auto", slo_tbt_s=0.05, max_token_budget=1024, max_num_seqs=8)
    resolved, setup = token_budget.resolve(config, model, "test", max_model_len=1024)
    assert resolved.token_budget == setup.budget == 336 and setup.mode == "auto"
    assert "token budget auto 336" in setup.describe() and "<= 0.9 x TBT target 50 ms" in setup.describe()
    looser = dataclasses.replace(config, slo_margin=1.0)  # 0.01 + 1e-4 x B <= 0.05  <=>  B <= 400
    assert token_budget.resolve(looser, model, "test", max_model_len=1024)[0].token_budget == 400
    dynamic, setup = token_budget.resolve(EngineConfig(token_budget="dynamic", slo_tbt_s=0.05, max_token_budget=1024,
                                                       max_num_seqs=8), model, "test", (16, 512, 1024),
                                          max_model_len=1024)
    assert dynamic.token_budget == 1024 and setup.policy is not None and setup.policy.max_budget == 1024
    assert setup.policy.margin == 0.9 and "<= 0.9 x the tightest running TBT target" in setup.describe()


@given(st.lists(st.floats(0, 1), min_size=1, max_size=40), st.floats(0, 40))
def test_largest_budget_is_the_last_candidate_that_fits(steps, limit):
    """Against a scan over every candidate, for any non-decreasing prediction."""
    times = [sum(steps[: i + 1]) for i in range(len(steps))]  # candidate k x TILE costs times[k - 1]
    predict = lambda b: times[b // TILE - 1]  # noqa: E731
    hi = len(times) * TILE
    fits = [b for b in range(TILE, hi + 1, TILE) if predict(b) <= limit]
    assert largest_budget(predict, limit, TILE, hi) == (max(fits) if fits else TILE)


# ----------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("kwargs,words", [
    ({"token_budget": "auto"}, "token_budget='auto' needs slo_tbt_s"),
    ({"token_budget": "dynamic"}, "token_budget='dynamic' needs slo_tbt_s"),
    ({"token_budget": "auto", "slo_tbt_s": -0.1}, "slo_tbt_s must be a finite number of seconds > 0"),
    ({"token_budget": "auto", "slo_tbt_s": 0}, "slo_tbt_s must be a finite number of seconds > 0"),
    ({"slo_tbt_s": float("nan")}, "slo_tbt_s must be a finite number"),
    ({"token_budget": "auto", "slo_tbt_s": 0.1, "slo_margin": 0}, "slo_margin must be in (0, 1]"),
    ({"token_budget": "dynamic", "slo_tbt_s": 0.1, "slo_margin": 1.5}, "slo_margin must be in (0, 1]"),
    ({"token_budget": "fastest"}, "token_budget must be a positive integer, 'auto' or 'dynamic'"),
    ({"token_budget": "dynamic", "slo_tbt_s": 0.1, "scheduler": "simple_chunking"}, "sarathi policy's"),
    ({"token_budget": "auto", "slo_tbt_s": 0.1, "scheduler": "vllm"}, "batches by a token budget"),
    ({"token_budget": "auto", "slo_tbt_s": 0.1, "max_token_budget": 100}, "max_token_budget must be a positive "
                                                                          "multiple of 16"),
])
def test_bad_budget_settings_are_refused(kwargs, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        EngineConfig(**kwargs)


def test_a_bad_cost_profile_is_refused_naming_it(tmp_path):
    bad = tmp_path / "profile.json"
    bad.write_text("{}")
    config = EngineConfig(token_budget="auto", slo_tbt_s=0.1, cost_profile=str(bad))
    with pytest.raises(ValueError, match="cost_profile .*profile.json: KeyError"):
        token_budget.saved_cost_model(config, None)


# ----------------------------------------------------------------------------------------------- "dynamic"


@dataclass(frozen=True)
class DReq:
    arrival_step: int
    prompt_len: int
    max_tokens: int
    slo_tbt_s: float | None


class CheckedBudget(SloTokenBudget):
    """The dynamic budget, recording each limit with the decodes it was asked for."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[int, int, float | None]] = []

    def token_limit(self, running, decodes, prefills) -> int:
        limit = super().token_limit(running, decodes, prefills)
        self.calls.append((limit, len(decodes), self.last[1]))
        return limit


@st.composite
def dynamic_scenarios(draw):
    max_num_seqs = draw(st.integers(1, 40))
    max_budget = draw(st.sampled_from([32, 64, 128, 256]))
    max_budget = max(max_budget, -(-max_num_seqs // TILE) * TILE)
    overhead, per_token, per_key = draw(st.floats(1e-3, 2e-2)), draw(st.floats(1e-5, 5e-4)), draw(st.floats(0, 1e-6))
    ladder = draw(st.sampled_from([None, "cpu", "gpu"]))
    if ladder is None:
        model = Linear(overhead, per_token, per_key)
    else:  # an engine's cost model: a batch costs its padded bucket of the fine ladder compiled for max_budget
        buckets = platform_buckets(max_budget, ladder, "fine")
        measured = [b for b in buckets if b in (16, 64, 256) or b == buckets[-1]]
        model = BucketCostModel({b: overhead + per_token * b for b in measured}, per_key, per_key, buckets=buckets)
    default = draw(st.sampled_from([None, 0.01, 0.03, 0.1]))
    arrivals = sorted(draw(st.lists(st.integers(0, 10), min_size=1, max_size=40)))
    reqs = [DReq(a, draw(st.integers(1, 120)), draw(st.integers(1, 30)),
                 draw(st.sampled_from([None, 0.005, 0.02, 0.05, 1.0]))) for a in arrivals]
    return max_num_seqs, max_budget, model, default, reqs


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dynamic_scenarios())
def test_dynamic_budget_stays_in_bounds_and_never_displaces_a_decode(scenario):
    """Each iteration: the limit is a multiple of TILE in [the ready decodes rounded up to TILE, max_budget];
    above that floor, its predicted time is within margin x the tightest target among running requests past
    their first token; the batch holds at most the limit; every ready running decode is in the batch (memory is
    ample: nothing is preempted); and every request finishes. With an engine's cost model (the fine ladder), the
    prediction is of the batch padded to its compiled bucket, and no batch needs a bucket past the ladder."""
    max_num_seqs, max_budget, model, default, reqs = scenario
    cfg = SchedulerConfig(policy="sarathi", token_budget=max_budget, max_num_seqs=max_num_seqs,
                          max_model_len=MAX_MODEL_LEN, watermark=0.0)
    num_blocks = max_num_seqs * MAX_MODEL_LEN // 16 + 16
    bm = BlockManager(num_blocks, 16)
    sched = SCHEDULERS["sarathi"](cfg, bm)
    policy = CheckedBudget(model, max_budget=max_budget, default_slo_tbt_s=default)
    sched.budget_policy = policy
    seqs = [Sequence(f"s{i}", list(range(1, r.prompt_len + 1)), SamplingParams(max_tokens=r.max_tokens),
                     float(r.arrival_step), slo_tbt_s=r.slo_tbt_s) for i, r in enumerate(reqs)]
    nxt = step = 0
    while nxt < len(seqs) or sched.has_unfinished():
        assert step < 5_000
        while nxt < len(seqs) and reqs[nxt].arrival_step <= step:
            sched.add_sequence(seqs[nxt])
            nxt += 1
        ready = [s for s in sched.running if s.is_decode and s.num_tokens < s.max_total_tokens]
        targets = [s.metrics.slo_tbt_s if s.metrics.slo_tbt_s is not None else default
                   for s in sched.running if s.num_generated_tokens]
        tightest = min((t for t in targets if t is not None), default=None)
        positions = [s.num_computed_tokens for s in ready]
        prefill_start = next((s.num_computed_tokens for s in sched.running if not s.is_decode), 0)
        out = sched.schedule(now=float(step))
        limit, num_decodes, target = policy.calls[-1]
        floor = max(TILE, -(-len(ready) // TILE) * TILE)
        assert num_decodes == len(ready) and (target is None) == (tightest is None)
        assert tightest is None or target == pytest.approx(0.9 * tightest)  # no TTFT targets: margin x TBT
        assert limit % TILE == 0 and floor <= limit <= max_budget
        if tightest is None:
            assert limit == max_budget
        elif limit > floor:
            assert model.mixed_batch_time(positions, prefill_start, limit - len(ready)) <= 0.9 * tightest
        if tightest is not None and limit < max_budget:  # the next candidate would not have fit
            assert model.mixed_batch_time(positions, prefill_start, limit + TILE - len(ready)) > 0.9 * tightest
        assert sum(c.num_new_tokens for c in out.chunks) <= limit and not out.preempted
        if isinstance(model, BucketCostModel):  # limit and batch within the compiled ladder
            assert bucket_for(model.buckets, limit) in model.buckets and model.buckets[-1] == max_budget
        scheduled = {c.seq.seq_id for c in out.chunks if c.is_decode}
        assert all(s.seq_id in scheduled for s in ready)
        complete(sched, out)
        step += 1
    assert all(s.num_output_tokens == r.max_tokens for s, r in zip(seqs, reqs))
    assert bm.num_free_blocks == num_blocks


def test_dynamic_budget_shrinks_while_an_interactive_request_decodes():
    """A long prompt behind one decode: with a relaxed target it gets the whole budget; while a request with a
    tight target decodes, chunks shrink to what that target allows."""
    model = Linear(0.01, 1e-4)
    budgets = {}
    for name, slo in (("relaxed", 1.0), ("interactive", 0.02)):
        bm = BlockManager(256, 16)
        sched = SCHEDULERS["sarathi"](SchedulerConfig(token_budget=256, max_num_seqs=8, max_model_len=1024), bm)
        sched.budget_policy = SloTokenBudget(model, max_budget=256, default_slo_tbt_s=1.0)
        first = Sequence("a", [1, 2, 3], SamplingParams(max_tokens=50), 0.0, slo_tbt_s=slo)
        sched.add_sequence(first)
        complete(sched, sched.schedule())  # a's prefill: a decodes from now on
        sched.add_sequence(Sequence("b", list(range(1, 900)), SamplingParams(max_tokens=1), 1.0))
        out = sched.schedule()
        budgets[name] = sum(c.num_new_tokens for c in out.chunks)
    # 0.01 + 1e-4 x B <= 0.9 x 0.02 = 0.018  <=>  B <= 80
    assert budgets == {"relaxed": 256, "interactive": 80}


def test_dynamic_budget_never_drops_a_decode_even_when_no_budget_meets_the_target():
    """20 decodes whose target no batch can meet: the budget is the decodes rounded up to a tile, and all run."""
    bm = BlockManager(512, 16)
    sched = SCHEDULERS["sarathi"](SchedulerConfig(token_budget=128, max_num_seqs=32, max_model_len=256), bm)
    sched.budget_policy = SloTokenBudget(Linear(0.01, 1e-4), max_budget=128, default_slo_tbt_s=1e-4)
    for i in range(20):
        sched.add_sequence(Sequence(f"d{i}", [1, 2, 3], SamplingParams(max_tokens=5), 0.0))
    complete(sched, sched.schedule())  # the 20 prefills (no decode yet: no target, the whole budget)
    sched.add_sequence(Sequence("p", list(range(1, 200)), SamplingParams(max_tokens=1), 1.0))
    out = sched.schedule()
    assert sum(c.is_decode for c in out.chunks) == 20 and sum(c.num_new_tokens for c in out.chunks) == 32
    assert sched.budget_policy.last == (32, pytest.approx(0.9e-4))


@pytest.mark.parametrize("ladder, chunk_budget", [("coarse", 64), ("fine", 80)])
def test_dynamic_budget_runs_in_the_largest_compiled_bucket_its_target_allows(ladder, chunk_budget):
    """10 ms + 0.1 ms per token of the padded bucket <= 0.9 x 20 ms: a bucket of at most 80 tokens. On powers of
    two (16, 32, 64, 128, 256) a batch of 65 to 80 tokens pads to 128, so the budget is 64; the fine ladder,
    "dynamic"'s default, compiles 80. The resolved config pins the ladder the predictor padded to."""
    model = BucketCostModel({16: 0.0116, 256: 0.0356}, 0.0, 0.0)
    config = EngineConfig(token_budget="dynamic", slo_tbt_s=0.02, max_token_budget=256, max_num_seqs=8,
                          bucket_ladder=None if ladder == "fine" else ladder)
    buckets = platform_buckets(256, "gpu", bucket_ladder(config))
    resolved, setup = token_budget.resolve(config, model, "test", buckets, max_model_len=1024)
    assert resolved.bucket_ladder == ladder and resolved.token_budget == 256
    assert setup.policy is not None and setup.policy.predictor.buckets == buckets
    bm = BlockManager(256, 16)
    sched = SCHEDULERS["sarathi"](SchedulerConfig(token_budget=256, max_num_seqs=8, max_model_len=1024), bm)
    token_budget.install(setup, sched, [])  # no iteration recorded: the prior alone
    sched.add_sequence(Sequence("a", [1, 2, 3], SamplingParams(max_tokens=50), 0.0))
    complete(sched, sched.schedule())  # a's prefill: a decodes from now on
    sched.add_sequence(Sequence("b", list(range(1, 900)), SamplingParams(max_tokens=1), 1.0))
    out = sched.schedule()
    assert sum(c.num_new_tokens for c in out.chunks) == chunk_budget
    assert bucket_for(buckets, chunk_budget) == chunk_budget


@dataclass
class Record:
    """The fields of an `IterationRecord` the feedback reads."""

    start_time: float
    duration: float
    num_decode_tokens: int
    num_padded_tokens: int
    predicted_s: float | None
    slack_s: float | None = 0.0


def test_feedback_slack_is_the_quantile_of_each_buckets_residuals():
    log: list[Record] = []
    fb = IterationFeedback(log, window=8, quantile=0.5, min_samples=3)
    t = 0.0

    def step(bucket: int, predicted: float, took: float, *, decodes: int = 1, slack: float = 0.0,
             gap: float = 0.0) -> None:
        nonlocal t
        log.append(Record(t + gap - 0.001, took + 0.001, decodes, bucket, predicted + slack, slack))
        t += gap + took
        fb.observe()

    step(16, 0.010, 0.012)  # the first record: no previous end to measure from
    step(16, 0.010, 0.012)
    step(16, 0.010, 0.014)
    assert fb.slack_s(16) == 0.0 and fb.slack_s(64) == 0.0  # fewer than min_samples anywhere: the prior alone
    step(16, 0.010, 0.020, decodes=0)  # no decode: no time between tokens
    step(16, 0.010, 0.015, gap=5.0)  # after an idle gap: its own duration, 0.016
    assert list(fb.by_bucket[16]) == pytest.approx([0.002, 0.004, 0.006])
    step(64, 0.030, 0.025, slack=0.5)  # the prior over-predicts (the slack it carried is not the prior's)
    assert fb.slack_s(16) == pytest.approx(0.004)  # its own median
    assert fb.slack_s(32) == pytest.approx(0.004)  # too few of its own: the pooled -0.005, 0.002, 0.004, 0.006
    for _ in range(2):
        step(64, 0.030, 0.026)
    assert fb.slack_s(64) == pytest.approx(-0.004)  # negative: the budget may use the room the prior leaves
    log.clear()  # the engine's owner cleared its log: read again from the start
    step(16, 0.010, 0.012)
    assert len(fb.by_bucket[16]) == 3


def run_steps(sched, log: list, buckets, factor: float, n: int) -> list[int]:
    """`n` iterations on a synchronous loop where each takes `factor` x the test model's time of its bucket,
    recorded as the engine core records them. Returns each batch's tokens."""
    totals, t = [], 0.0
    for _ in range(n):
        out = sched.schedule()
        total = sum(c.num_new_tokens for c in out.chunks)
        totals.append(total)
        took = factor * (0.01 + 0.0001 * bucket_for(buckets, total))
        log.append(Record(t, took, out.num_decode_tokens, bucket_for(buckets, total), out.predicted_s, out.slack_s))
        t += took
        complete(sched, out)
    return totals


def test_dynamic_budget_shrinks_when_iterations_take_longer_than_predicted():
    """The test above's cost model and target (bucket 80 predicted at 18 ms = 0.9 x 20 ms), on a machine where
    every iteration takes 1.5x its prediction: once bucket 80 has its samples, its slack (9 ms) puts it over
    the limit, and so does the pooled slack every other bucket takes until it has its own; the 16-token
    bucket then measures 5.8 ms of slack (17.4 ms in all) and stays: the chunk shrinks to what the decode
    leaves of it."""
    model = BucketCostModel({16: 0.0116, 256: 0.0356}, 0.0, 0.0)
    config = EngineConfig(token_budget="dynamic", slo_tbt_s=0.02, max_token_budget=256, max_num_seqs=8)
    buckets = platform_buckets(256, "gpu", bucket_ladder(config))
    _, setup = token_budget.resolve(config, model, "test", buckets, max_model_len=4096)
    bm = BlockManager(512, 16)
    sched = SCHEDULERS["sarathi"](SchedulerConfig(token_budget=256, max_num_seqs=8, max_model_len=4096), bm)
    log: list[Record] = []
    token_budget.install(setup, sched, log)
    sched.add_sequence(Sequence("a", [1, 2, 3], SamplingParams(max_tokens=1000), 0.0))
    complete(sched, sched.schedule())
    sched.add_sequence(Sequence("b", list(range(1, 3000)), SamplingParams(max_tokens=1), 1.0))
    totals = run_steps(sched, log, buckets, 1.5, 40)  # the model's time, 1.5x
    assert totals[:9] == [80] * 9  # the first record has no previous end  # until the feedback has min_samples residuals: the prediction alone
    assert setup.policy.feedback.slack_s(80) == pytest.approx(0.5 * 0.018)
    assert set(totals[9:]) == {16}


def test_dynamic_budget_grows_when_iterations_take_less_than_predicted():
    """The same engine where every iteration takes 0.5x its prediction: the negative slack lets the chunk grow
    past the prior's 80 tokens to the largest bucket whose measured time fits."""
    model = BucketCostModel({16: 0.0116, 256: 0.0356}, 0.0, 0.0)
    config = EngineConfig(token_budget="dynamic", slo_tbt_s=0.02, max_token_budget=256, max_num_seqs=8)
    buckets = platform_buckets(256, "gpu", bucket_ladder(config))
    _, setup = token_budget.resolve(config, model, "test", buckets, max_model_len=4096)
    sched = SCHEDULERS["sarathi"](SchedulerConfig(token_budget=256, max_num_seqs=8, max_model_len=4096),
                                  BlockManager(512, 16))
    log: list[Record] = []
    token_budget.install(setup, sched, log)
    sched.add_sequence(Sequence("a", [1, 2, 3], SamplingParams(max_tokens=1000), 0.0))
    complete(sched, sched.schedule())
    sched.add_sequence(Sequence("b", list(range(1, 3000)), SamplingParams(max_tokens=1), 1.0))
    totals = run_steps(sched, log, buckets, 0.5, 30)
    assert totals[:9] == [80] * 9
    assert max(totals[9:]) > 80
    for total in totals[9:]:  # each one measured within the limit: half its prediction <= 18 ms
        assert 0.5 * (0.01 + 0.0001 * bucket_for(buckets, total)) <= 0.018


def test_dynamic_budget_leaves_room_for_arrivals_with_a_tight_ttft():
    """Only a batch request decodes (a loose TBT target): the budget is the compiled maximum until a request with
    a 50 ms TTFT target is admitted; from then on no iteration is predicted over 0.2 x 50 ms = 10 ms, also after
    it finished, while it is among the recent arrivals."""
    model = Linear(0.002, 1e-4)
    sched = SCHEDULERS["sarathi"](SchedulerConfig(token_budget=256, max_num_seqs=8, max_model_len=4096),
                                  BlockManager(512, 16))
    sched.budget_policy = SloTokenBudget(model, max_budget=256, default_slo_tbt_s=1.0)
    batch_request = Sequence("batch", [1, 2, 3], SamplingParams(max_tokens=1000), 0.0, slo_ttft_s=30.0)
    sched.add_sequence(batch_request)
    complete(sched, sched.schedule())
    sched.add_sequence(Sequence("long", list(range(1, 300)), SamplingParams(max_tokens=1), 0.0, slo_ttft_s=30.0))
    out = sched.schedule()
    assert sum(c.num_new_tokens for c in out.chunks) == 256  # 0.2 x 30 s allows every bucket
    complete(sched, out)
    complete(sched, sched.schedule())  # the rest of "long"
    interactive = Sequence("chat", [1, 2, 3, 4], SamplingParams(max_tokens=1), 0.0, slo_ttft_s=0.05)
    sched.add_sequence(interactive)
    complete(sched, sched.schedule())  # admitted (and finished: one token)
    assert interactive.num_output_tokens == 1
    sched.add_sequence(Sequence("next", list(range(1, 3000)), SamplingParams(max_tokens=1), 0.0, slo_ttft_s=30.0))
    for _ in range(3):
        out = sched.schedule()
        # 0.002 + 1e-4 x B <= 0.01  <=>  B <= 80
        assert sum(c.num_new_tokens for c in out.chunks) == 80
        assert sched.budget_policy.last == (80, pytest.approx(0.01))
        complete(sched, out)
