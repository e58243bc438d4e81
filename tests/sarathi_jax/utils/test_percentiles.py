"""`sarathi_jax.utils.percentiles` against hand-computed ranks."""

from __future__ import annotations

import math

import pytest

from sarathi_jax.utils.percentiles import percentile, percentiles


def test_percentiles_linear():
    p = percentiles([0.1, 0.1, 0.1, 0.2, 1.0])
    # sorted ranks 0..4; p90 at rank 3.6 = .2 + .6 * .8; p99 at rank 3.96 = .2 + .96 * .8
    assert p["p50"] == pytest.approx(0.1)
    assert p["p90"] == pytest.approx(0.68)
    assert p["p99"] == pytest.approx(0.968)
    assert p["max"] == 1.0 and p["count"] == 5 and p["mean"] == pytest.approx(0.3)
    assert percentiles([])["p50"] is None and percentiles([None, 2.0])["p50"] == 2.0


def test_percentile_of_nothing_is_nan():
    assert math.isnan(percentile([], 50))
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0 and percentile([0.0, 1.0], 25) == pytest.approx(0.25)
