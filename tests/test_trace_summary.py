"""`bench/trace_summary.py --windows`: the device timeline of a marked window, read from a chrome trace."""

from __future__ import annotations

import pytest

from bench.trace_summary import calls, windows

pytestmark = pytest.mark.fast


def _x(cat: str, name: str, ts: float, dur: float) -> dict[str, object]:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_a_windows_device_span_busy_time_gaps_and_waits() -> None:
    trace = {"traceEvents": [
        _x("user_annotation", "sync 0", 1000.0, 10_000.0),
        _x("cuda_runtime", "cudaLaunchKernel", 2000.0, 5.0),
        _x("kernel", "copy", 2500.0, 3000.0),  # 1.5-4.5 ms
        _x("kernel", "copy", 4000.0, 1000.0),  # overlaps the first: busy counts it once
        _x("cuda_runtime", "cudaLaunchKernel", 5000.0, 5.0),
        _x("kernel", "fold", 6000.0, 2000.0),  # after a 0.5 ms gap: 5.0-7.0 ms
        _x("cuda_runtime", "cudaStreamSynchronize", 6100.0, 1900.0),
        _x("cuda_runtime", "cudaStreamSynchronize", 8100.0, 10.0),  # too short to be a wait
        _x("kernel", "outside", 20_000.0, 100.0),  # after the window
        _x("user_annotation", "other", 1000.0, 10_000.0),  # not a sync
    ]}
    (row,) = windows(trace)
    assert row["window"] == "sync 0" and row["wall_ms"] == 10.0 and row["device_events"] == 3
    assert row["first_device_ms"] == 1.5 and row["last_device_end_ms"] == 7.0 and row["tail_ms"] == 3.0
    assert row["device_busy_ms"] == 5.0 and row["largest_gaps_ms_at"] == [(0.5, 4.5)]
    assert row["device_by_name"] == {"copy": [2, 4.0], "fold": [1, 2.0]}
    assert (row["first_launch_ms"], row["last_launch_ms"], row["launches"]) == (1.0, 4.0, 2)
    assert row["host_waits"] == [["cudaStreamSynchronize", 5.1, 1.9]]


def test_calls_lists_each_threads_python_calls_in_the_head_and_tail_nested_under_their_callers() -> None:
    py = "python_function"
    trace = {"traceEvents": [
        _x("user_annotation", "sync 0", 0.0, 10_000.0),
        _x("kernel", "copy", 2000.0, 6000.0),  # head 0-2 ms, tail 8-10 ms
        {**_x(py, "ckpt_engine/sync/session.py(1): _sync", 0.0, 9000.0), "tid": 1},
        {**_x(py, "ckpt_engine/sync/session.py(2): _validate", 100.0, 500.0), "tid": 1},
        {**_x(py, "ckpt_engine/x.py(3): tiny", 150.0, 10.0), "tid": 1},  # under min_us
        {**_x(py, "numpy/core.py(4): other", 200.0, 300.0), "tid": 1},  # not the library's or vLLM's
        {**_x(py, "vllm/v1/core.py(5): receive", 1500.0, 300.0), "tid": 2},  # another thread, in the head
        {**_x(py, "ckpt_engine/y.py(6): during", 3000.0, 1000.0), "tid": 2},  # beside the copies: neither
        {**_x(py, "ckpt_engine/z.py(7): reset", 8500.0, 200.0), "tid": 2},  # in the tail
    ]}
    lines = calls(trace, min_us=60.0)
    assert lines[0] == "== sync 0 head: 0.000-2.000 ms" and lines[4] == "== sync 0 tail: 8.000-10.000 ms"
    assert [line.split()[:3] for line in lines[1:4]] == [["t0", "0.000", "9.000"], ["t0", "0.100", "0.500"], ["t1", "1.500", "0.300"]]
    assert lines[2].endswith("  ckpt_engine/sync/session.py(2): _validate") and not lines[1].split("9.000")[1].startswith("   ")
    assert [line.split()[:3] for line in lines[5:]] == [["t0", "0.000", "9.000"], ["t1", "8.500", "0.200"]]
