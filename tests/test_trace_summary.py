"""`bench/trace_summary.py --windows`: the device timeline of a marked window, read from a chrome trace."""

from __future__ import annotations

import pytest

from bench.trace_summary import windows

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
