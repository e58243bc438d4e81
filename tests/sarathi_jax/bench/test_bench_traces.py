"""Trace CSV parsing: good files, the traces shipped in the package (by name), and bad files with clear errors."""

from __future__ import annotations

import numpy as np
import pytest

from sarathi_jax.bench.traces import SHIPPED_TRACES, TRACE_DATA_DIR, TraceError, load_trace, trace_file


def write(tmp_path, text, name="t.csv"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_parses_lengths_and_sorts_by_arrival(tmp_path):
    path = write(tmp_path, "arrived_at,num_prefill_tokens,num_decode_tokens,extra\n"
                           "1.5,10,3,x\n0.0,20,4.0,y\n\n0.5,30,5,z\n")
    tr = load_trace(path)
    assert len(tr) == 3
    np.testing.assert_array_equal(tr.arrivals, [0.0, 0.5, 1.5])
    np.testing.assert_array_equal(tr.prompt_lens, [20, 30, 10])
    np.testing.assert_array_equal(tr.output_lens, [4, 5, 3])


def test_no_arrival_column(tmp_path):
    tr = load_trace(write(tmp_path, "num_prefill_tokens,num_decode_tokens\n7,1\n8,0\n"))
    assert tr.arrivals is None
    np.testing.assert_array_equal(tr.output_lens, [1, 0])


@pytest.mark.parametrize(
    "text, needles",
    [
        ("num_prefill_tokens,foo\n1,2\n", ["missing column", "'num_decode_tokens'", "found 'num_prefill_tokens', 'foo'"]),
        ("num_prefill_tokens,num_decode_tokens\n1,2\n-3,4\n", ["row 3", "'num_prefill_tokens'", ">= 0", "-3"]),
        ("num_prefill_tokens,num_decode_tokens\n1,abc\n", ["row 2", "'num_decode_tokens'", "expected a number", "'abc'"]),
        ("num_prefill_tokens,num_decode_tokens\n1,\n", ["row 2", "expected a number"]),
        ("num_prefill_tokens,num_decode_tokens\n1.5,2\n", ["row 2", "integer", "'1.5'"]),
        ("num_prefill_tokens,num_decode_tokens\nnan,2\n", ["row 2", "finite"]),
        ("arrived_at,num_prefill_tokens,num_decode_tokens\n-1,1,2\n", ["row 2", "'arrived_at'", ">= 0"]),
        ("num_prefill_tokens,num_decode_tokens\n1,2,3\n", ["row 2", "expected 2 fields, got 3"]),
        ("", ["empty file"]),
        ("num_prefill_tokens,num_decode_tokens\n", ["no data rows"]),
    ],
)
def test_bad_files_have_clear_errors(tmp_path, text, needles):
    path = write(tmp_path, text)
    with pytest.raises(TraceError) as e:
        load_trace(path)
    msg = str(e.value)
    assert msg.startswith(path)
    for n in needles:
        assert n in msg, msg


def test_missing_file(tmp_path):
    with pytest.raises(TraceError, match="not found"):
        load_trace(tmp_path / "nope.csv")
    with pytest.raises(ValueError, match="directory"):  # TraceError is a ValueError
        load_trace(tmp_path)


def test_shipped_traces_load_by_name():
    arxiv = load_trace("arxiv")
    assert len(arxiv) == 28257 and arxiv.arrivals is None
    assert int(np.median(arxiv.prompt_lens)) == 2730
    conv = load_trace("conversation")
    assert len(conv) == 19366 and conv.arrivals is not None
    assert conv.arrivals[0] == 0.0 and np.all(np.diff(conv.arrivals) >= 0)
    # Shipped with their license, inside the package.
    assert (TRACE_DATA_DIR / "LICENSE-vidur-data.txt").read_text().strip().startswith("MIT License")
    assert all((TRACE_DATA_DIR / f).is_file() for f in SHIPPED_TRACES.values())


def test_relative_path_is_the_current_directory_and_dot_slash_beats_a_name(tmp_path, monkeypatch):
    write(tmp_path, "num_prefill_tokens,num_decode_tokens\n7,1\n", name="arxiv")
    monkeypatch.chdir(tmp_path)
    assert trace_file("./arxiv") == str(tmp_path / "arxiv")
    assert len(load_trace("./arxiv")) == 1  # the file here, not the shipped trace
    assert len(load_trace("arxiv")) == 28257
    with pytest.raises(TraceError, match="arxiv, conversation"):
        load_trace("arxvi")  # a misspelt name: the message lists the names


def test_pyproject_ships_the_traces_as_package_data():
    """The files a wheel gets come from pyproject's package-data patterns: each shipped file must match one."""
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    package_dir = root / "sarathi_jax" / "bench"
    matched = {p for pattern in patterns["sarathi_jax.bench"] for p in package_dir.glob(pattern)}
    wanted = {TRACE_DATA_DIR / f for f in [*SHIPPED_TRACES.values(), "LICENSE-vidur-data.txt"]}
    assert wanted <= matched, wanted - matched
