"""Workload generation: length specs, arrival processes, trace sampling, scaling and clipping."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sarathi_jax.bench.workload import (
    Workload,
    arrival_times,
    parse_length_spec,
    synthetic_workload,
    trace_workload,
)


def rng(seed=0):
    return np.random.default_rng(seed)


def test_length_specs(tmp_path):
    assert parse_length_spec("128").sample(3, rng()).tolist() == [128, 128, 128]
    u = parse_length_spec("uniform:5:9").sample(2000, rng())
    assert u.min() == 5 and u.max() == 9
    z = parse_length_spec("zipf:1.5:1:1000").sample(5000, rng())
    assert z.min() >= 1 and z.max() <= 1000 and np.median(z) <= 3  # heavy head
    p = tmp_path / "t.csv"
    p.write_text("num_prefill_tokens,num_decode_tokens\n11,2\n13,4\n")
    assert set(parse_length_spec(f"trace:{p}").sample(50, rng()).tolist()) == {11, 13}
    assert set(parse_length_spec(f"trace:{p}", column="num_decode_tokens").sample(50, rng()).tolist()) == {2, 4}
    for bad in ["0", "abc", "uniform:9:5", "uniform:1", "zipf:0:1:5", "zipf:x:1:5", "normal:1:2"]:
        with pytest.raises(ValueError, match="bad length spec"):
            parse_length_spec(bad)


def test_arrival_processes():
    a = arrival_times("poisson", 20001, 5.0, rng())
    assert a[0] == 0 and np.all(np.diff(a) >= 0)
    gaps = np.diff(a)
    assert abs(gaps.mean() - 0.2) < 0.2 * 0.03
    assert abs(gaps.std() / gaps.mean() - 1.0) < 0.05
    g = np.diff(arrival_times("gamma", 20001, 5.0, rng(), cv=3.0))
    assert abs(g.mean() - 0.2) < 0.2 * 0.08
    assert abs(g.std() / g.mean() - 3.0) < 0.3
    np.testing.assert_allclose(arrival_times("constant", 4, 2.0, rng()), [0, 0.5, 1.0, 1.5])
    assert arrival_times("offline", 3, 0, rng()).tolist() == [0, 0, 0]
    with pytest.raises(ValueError, match="qps"):
        arrival_times("poisson", 3, 0.0, rng())
    with pytest.raises(ValueError, match="unknown arrival"):
        arrival_times("bursty", 3, 1.0, rng())


def test_synthetic_is_seeded():
    a = synthetic_workload(50, qps=3.0, prompt_len="uniform:1:100", output_len="zipf:1.1:1:50", seed=7)
    b = synthetic_workload(50, qps=3.0, prompt_len="uniform:1:100", output_len="zipf:1.1:1:50", seed=7)
    c = synthetic_workload(50, qps=3.0, prompt_len="uniform:1:100", output_len="zipf:1.1:1:50", seed=8)
    for x in ("arrivals", "prompt_lens", "output_lens"):
        np.testing.assert_array_equal(getattr(a, x), getattr(b, x))
    assert not np.array_equal(a.prompt_lens, c.prompt_lens)
    assert a.prompts(1000, 3) == b.prompts(1000, 3)
    ps = a.prompts(1000, 3)
    assert [len(p) for p in ps] == a.prompt_lens.tolist()
    assert all(0 <= t < 1000 for p in ps for t in p)
    off = synthetic_workload(5, qps=None)
    assert off.arrivals.tolist() == [0] * 5 and math.isinf(off.mean_rate)


def make_trace(tmp_path, arrivals=True, n=100):
    p = tmp_path / "t.csv"
    rows = ["arrived_at,num_prefill_tokens,num_decode_tokens" if arrivals else "num_prefill_tokens,num_decode_tokens"]
    for i in range(n):
        rows.append(f"{i * 0.5},{100 + i},{i + 1}" if arrivals else f"{100 + i},{i + 1}")
    p.write_text("\n".join(rows) + "\n")
    return str(p)


def test_trace_sampling_keeps_arrival_window(tmp_path):
    wl = trace_workload(make_trace(tmp_path), sample=10, seed=3)
    assert len(wl) == 10 and wl.info["arrival"] == "trace"
    np.testing.assert_allclose(wl.arrivals, np.arange(10) * 0.5)  # contiguous window, rebased to 0
    first = wl.prompt_lens[0] - 100
    np.testing.assert_array_equal(wl.prompt_lens, 100 + first + np.arange(10))
    np.testing.assert_array_equal(wl.output_lens, first + 1 + np.arange(10))  # rows stay paired
    assert wl.mean_rate == pytest.approx(2.0)
    assert trace_workload(make_trace(tmp_path), sample=10, seed=3).prompt_lens.tolist() == wl.prompt_lens.tolist()
    syn = trace_workload(make_trace(tmp_path), sample=10, qps=4.0, seed=3)
    assert syn.info["arrival"] == "poisson"
    with pytest.raises(ValueError, match="cannot sample 101 rows"):
        trace_workload(make_trace(tmp_path), sample=101)


def test_trace_without_arrivals(tmp_path):
    path = make_trace(tmp_path, arrivals=False)
    wl = trace_workload(path, sample=20, qps=2.0, seed=1)
    assert len(set(wl.prompt_lens.tolist())) == 20  # distinct rows
    np.testing.assert_array_equal(wl.output_lens, wl.prompt_lens - 99)
    with pytest.raises(ValueError, match="--qps"):
        trace_workload(path)
    with pytest.raises(ValueError, match="arrived_at"):
        trace_workload(path, arrival="trace")
    assert trace_workload(path, arrival="offline").arrivals.tolist() == [0.0] * 100


def test_scaling_and_rates():
    wl = Workload([0.0, 1.0, 2.0], [10, 3, 1], [5, 1, 2])
    s = wl.scale_lengths(0.25)
    assert s.prompt_lens.tolist() == [2, 1, 1]  # round(2.5)=2 (banker's), 0.75->1, 0.25->0 clamped to 1
    assert s.output_lens.tolist() == [1, 1, 1]
    assert wl.scale_rate(2.0).arrivals.tolist() == [0.0, 0.5, 1.0]
    assert wl.at_rate(4.0).arrivals.tolist() == [0.0, 0.25, 0.5]
    with pytest.raises(ValueError, match="offline"):
        wl.offline().at_rate(1.0)


def test_fit_clips_proportionally():
    wl = Workload(np.zeros(4), [100, 1, 30, 10], [1, 100, 30, 10])
    f = wl.fit(50)
    assert f.prompt_lens.tolist() == [49, 1, 25, 10]
    assert f.output_lens.tolist() == [1, 49, 25, 10]
    assert np.all(f.prompt_lens + f.output_lens <= 50)
    assert f.info["num_clipped"] == 3
    assert any("3 of 4" in n for n in f.notes)
    with pytest.raises(ValueError):
        wl.fit(1)


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 10_000)), min_size=1, max_size=20),
       st.integers(2, 5000))
def test_fit_always_fits(lengths, max_len):
    p, o = zip(*lengths)
    f = Workload(np.zeros(len(p)), p, o).fit(max_len)
    assert np.all(f.prompt_lens >= 1) and np.all(f.output_lens >= 1)
    assert np.all(f.prompt_lens + f.output_lens <= max_len)
    for (p0, o0), p1, o1 in zip(lengths, f.prompt_lens, f.output_lens):
        if max(p0, 1) + max(o0, 1) <= max_len:  # requests that fit are only raised to >= 1
            assert (p1, o1) == (max(p0, 1), max(o0, 1))
        else:
            assert p1 <= max(p0, 1) and o1 <= max(o0, 1)


def test_shared_prefix_and_multi_turn_prompts():
    from sarathi_jax.bench.workload import as_conversations, with_shared_prefix

    base = synthetic_workload(6, qps=2.0, prompt_len="uniform:3:9", output_len="uniform:2:5", seed=1)
    wl = with_shared_prefix(as_conversations(base, 3), 7)
    assert wl.info["multi_turn"] == 3 and wl.info["shared_prefix_len"] == 7 and "3-turn" in wl.describe()
    np.testing.assert_array_equal(wl.arrivals, base.arrivals)
    np.testing.assert_array_equal(wl.output_lens, base.output_lens)
    ps = wl.prompts(1000, 0)
    assert [len(p) for p in ps] == wl.prompt_lens.tolist()
    assert len({tuple(p[:7]) for p in ps}) == 1  # one system prompt
    # 2 conversations: requests 0, 2, 4 and 1, 3, 5. Turn i re-sends turn i-1's prompt and a reply as long as
    # its output, then its own prompt (as long as the base request's).
    own = [int(n) for n in base.prompt_lens]
    for j in (2, 3, 4, 5):
        prev = ps[j - 2]
        assert ps[j][: len(prev)] == prev
        assert len(ps[j]) == len(prev) + int(base.output_lens[j - 2]) + own[j]
    assert ps[0][7:] != ps[1][7:]
    # clipping keeps the prefixes shared
    clipped = wl.fit(12).prompts(1000, 0)
    assert all(c == p[: len(c)] for c, p in zip(clipped, ps))
    assert with_shared_prefix(as_conversations(base, 1), 0) is base
