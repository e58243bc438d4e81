"""`sarathi_jax.parallel.pipeline.PipelineTimeline`: busy time, bubble fraction and overlap from hand-made
dispatch/ready timestamps, the tightening of ready times by later stages and retirement, and the helper threads
timing real (tiny) device arrays."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from sarathi_jax.parallel.pipeline import (
    MicrobatchRecord,
    PipelineTimeline,
    _effective_ready,
    _max_overlap,
)


def _record(i: int, dispatch: list[float], ready: list[float | None], retired: float | None = None):
    return MicrobatchRecord(i, 16, dispatch=list(dispatch), ready=list(ready), retired=retired)


def test_effective_ready_is_bounded_by_later_stages_and_retirement():
    r = _record(0, [0.0, 0.0], [5.0, 4.0], retired=3.0)
    assert _effective_ready(r) == [3.0, 3.0]
    r = _record(0, [0.0, 0.0], [5.0, 8.0])
    assert _effective_ready(r) == [5.0, 8.0]
    r = _record(0, [0.0, 0.0], [6.0, 4.0])
    assert _effective_ready(r) == [4.0, 4.0]


def test_max_overlap_counts_micro_batches_in_flight_at_once():
    records = [_record(0, [0.0], [2.0]), _record(1, [1.0], [3.0]), _record(2, [2.5], [4.0])]
    assert _max_overlap(records, [r.ready for r in records]) == 2
    assert _max_overlap([], []) == 0


def test_stats_of_a_two_stage_pipeline():
    tl = PipelineTimeline(2)
    # mb0: stage 0 [0, 1), stage 1 [1, 2); mb1 dispatched at 0.5: stage 0 [1, 2), stage 1 [2, 3)
    tl.records = [
        _record(0, [0.0, 0.0], [1.0, 2.0]),
        _record(1, [0.5, 0.5], [2.0, 3.0]),
        _record(2, [0.6], [None, None]),  # never finished: left out
    ]
    s = tl.stats()
    assert s["num_stages"] == 2 and s["num_microbatches"] == 2
    assert s["stage_busy_s"] == pytest.approx([2.0, 2.0])
    assert s["wall_s"] == pytest.approx(3.0)
    assert s["bubble_fraction"] == pytest.approx(1 - 4.0 / 6.0)
    assert s["max_overlap"] == 2


def test_an_empty_timeline_has_no_bubble():
    s = PipelineTimeline(3).stats()
    assert s["num_microbatches"] == 0 and s["wall_s"] == 0.0 and s["bubble_fraction"] == 0.0
    assert s["stage_busy_s"] == [0.0, 0.0, 0.0]


def test_helper_threads_time_dispatched_outputs_and_count_in_flight():
    tl = PipelineTimeline(2)
    records = []
    for n in (8, 16):
        r = tl.begin(n)
        for stage in range(2):
            tl.dispatched(r, stage, jnp.arange(n) * (stage + 1))
        records.append(r)
    assert tl.in_flight == 2 and tl.max_in_flight == 2
    for r in records:
        tl.retired(r)
    assert tl.in_flight == 0
    s = tl.stats()  # waits for the helpers
    assert all(None not in r.ready and len(r.dispatch) == 2 for r in records)
    assert all(r.ready[s_] >= r.dispatch[s_] for r in records for s_ in range(2))
    assert [r.num_tokens for r in tl.records] == [8, 16] and [r.index for r in tl.records] == [0, 1]
    assert s["num_microbatches"] == 2 and s["max_in_flight"] == 2
    assert 0.0 <= s["bubble_fraction"] <= 1.0 and s["wall_s"] > 0
    tl.reset()
    assert tl.records == [] and tl.max_in_flight == 0
    assert tl.stats()["num_microbatches"] == 0
