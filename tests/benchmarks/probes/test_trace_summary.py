"""`benchmarks.probes.trace_summary`: device busy time, kernels and host events per step of a small synthetic
Chrome/Perfetto trace, the memcpy filter, the Python-tracer fallback for the step name, and the CLI."""

from __future__ import annotations

import gzip
import json

import pytest

from benchmarks.probes.trace_summary import _load, _union, format_summary, main, summarize


def _meta(kind: str, pid: int, name: str, tid: int | None = None) -> dict:
    e = {"ph": "M", "name": kind, "pid": pid, "args": {"name": name}}
    if tid is not None:
        e["tid"] = tid
    return e


def _span(name: str, pid: int, tid: int, ts: float, dur: float) -> dict:
    return {"ph": "X", "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur}


def _trace(step_name: str = "step") -> list[dict]:
    host, dev = 1, 2
    return [
        _meta("process_name", host, "/host:CPU"),
        _meta("process_name", dev, "/device:GPU:0"),
        _meta("thread_name", dev, "Compute", tid=7),
        _meta("thread_name", dev, "MemcpyH2D", tid=8),
        # two steps on host thread 5: [0, 100) and [100, 200); wall 200
        _span(step_name, host, 5, 0, 100),
        _span(step_name, host, 5, 100, 100),
        _span("dispatch", host, 5, 10, 30),
        _span("dispatch", host, 5, 110, 30),
        _span("sync", host, 5, 150, 20),
        _span("other-thread", host, 6, 10, 50),  # not the stepping thread: not a host event of the step
        # kernels: matmul [20, 60) and [120, 160), softmax [50, 70) overlaps the first matmul -> union 40 + 10 + 40
        _span("matmul", dev, 7, 20, 40),
        _span("softmax", dev, 7, 50, 20),
        _span("matmul", dev, 7, 120, 40),
        _span("copy", dev, 8, 170, 10),  # memcpy stream: +10 busy unless --no-memcpy
        _span("late-kernel", dev, 7, 195, 10),  # ends after the window: not counted
    ]


def test_union_merges_overlapping_and_nested_intervals():
    assert _union([]) == 0.0
    assert _union([(0, 10), (5, 15), (20, 30), (22, 25)]) == 25.0
    assert _union([(5, 6), (0, 10)]) == 10.0


def test_summarize_per_step_figures():
    s = summarize(_trace())
    assert s["steps"] == 2
    assert s["wall_us_per_step"] == 100.0
    assert s["device_busy_us_per_step"] == pytest.approx((40 + 10 + 40 + 10) / 2)
    assert s["device_busy_fraction"] == pytest.approx(100 / 200)
    assert s["kernels_per_step"] == 2.0  # 4 kernels in the window over 2 steps
    assert s["top_kernels"][0] == ("matmul", 40.0, 1.0)
    assert {name for name, _, _ in s["top_kernels"]} == {"matmul", "softmax", "copy"}
    assert s["top_host_events"] == [("dispatch", 30.0), ("sync", 10.0)]


def test_no_memcpy_leaves_copy_streams_out_and_top_limits_the_lists():
    s = summarize(_trace(), memcpy=False, top=1)
    assert s["device_busy_us_per_step"] == pytest.approx(90 / 2)
    assert s["kernels_per_step"] == 1.5
    assert s["top_kernels"] == [("matmul", 40.0, 1.0)]
    assert s["top_host_events"] == [("dispatch", 30.0)]


def test_python_tracer_names_match_by_suffix_and_a_missing_step_is_an_error():
    s = summarize(_trace("$engine.py:164 step"))
    assert s["steps"] == 2 and s["wall_us_per_step"] == 100.0
    with pytest.raises(ValueError, match="no host event named"):
        summarize(_trace(), step_name="decode")


def test_format_summary_reports_milliseconds_and_percent():
    text = format_summary(summarize(_trace()))
    lines = text.splitlines()
    assert lines[0] == "2 steps: 0.10 ms wall per step, device busy 0.05 ms (50%), 2 kernels per step"
    assert "matmul" in lines[2] and "x1" in lines[2]
    assert any("dispatch" in line for line in lines)


def test_main_reads_gzipped_and_plain_traces(tmp_path, capsys):
    gz = tmp_path / "t.trace.json.gz"
    with gzip.open(gz, "wt") as f:
        json.dump({"traceEvents": _trace()}, f)
    plain = tmp_path / "t.json"
    plain.write_text(json.dumps(_trace()))  # a bare event list is accepted too
    assert _load(gz) == _load(plain) == json.loads(json.dumps(_trace()))
    assert main([str(gz), "--json", "--no-memcpy"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["steps"] == 2 and out["device_busy_us_per_step"] == pytest.approx(45.0)
    assert main([str(plain), "--top", "1"]) == 0
    assert capsys.readouterr().out.startswith("2 steps: 0.10 ms wall per step")


def _thunk(module: str, op: str, tid: int, ts: float, dur: float) -> dict:
    return {**_span(op, 1, tid, ts, dur), "args": {"hlo_module": module, "hlo_op": op}}


def test_cpu_thunks_are_summed_by_executable_and_kind_of_op():
    events = [_meta("process_name", 1, "/host:CPU"), _span("step", 1, 5, 0, 100), _span("step", 1, 5, 100, 100),
              _span("ThunkExecutor::Execute", 1, 9, 0, 90),  # no hlo_op: a wrapper, not an op
              _thunk("jit_step_impl", "ynn_fusion.3", 9, 10, 30), _thunk("jit_step_impl", "ynn_fusion", 10, 20, 20),
              _thunk("jit_step_impl", "ffi_call.1", 9, 110, 40), _thunk("jit_sample", "ynn_fusion.1", 9, 160, 10),
              _thunk("jit_step_impl", "ynn_fusion.7", 9, 190, 20)]  # ends after the last step: outside
    s = summarize(events)
    assert s["top_cpu_ops"] == [("jit_step_impl", "ynn_fusion", 25.0, 1.0), ("jit_step_impl", "ffi_call", 20.0, 0.5),
                                ("jit_sample", "ynn_fusion", 5.0, 0.5)]
    assert summarize(events, top=1)["top_cpu_ops"] == [("jit_step_impl", "ynn_fusion", 25.0, 1.0)]
    text = format_summary(s)
    assert "busiest XLA:CPU ops" in text and "x1.0   jit_step_impl ynn_fusion" in text
    assert "XLA:CPU" not in format_summary(summarize(_trace()))  # a GPU trace: no such section
