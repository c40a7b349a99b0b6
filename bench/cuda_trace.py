"""Where the device's time goes inside each marked window of a torch.profiler trace (a chrome trace).

Why: a colocated sync into vLLM is held against one device copy of its bytes (issue 39: >= 0.8 x),
and wall-clock breakdowns on the host cannot say whether the device copies run at a flat copy's
speed or wait for the host. This reads the device's own timeline: per window (a `record_function`
label, e.g. one sync), when the first device work starts and the last ends (ms from the window's
start), how busy the device is between them, the largest idle gaps, the kernels by name, and the
host's first launch and its waits on the device (`cudaStreamSynchronize`, `cudaEventSynchronize`, ...).

    python bench/cuda_trace.py TRACE.json [--prefix sync]
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path
from typing import Any

DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
WAITS = ("Synchronize", "cudaMemcpy ")  # a host call that blocks until the device catches up


def _union_us(spans: list[tuple[float, float]]) -> float:
    busy, end = 0.0, float("-inf")
    for s, e in sorted(spans):
        if e <= end:
            continue
        busy += e - max(s, end)
        end = e
    return busy


def summarize(trace: dict[str, Any], prefix: str = "sync", gaps: int = 5) -> list[dict[str, Any]]:
    """One row per window whose label starts with `prefix`, in trace order."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    windows = sorted((e for e in events if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith(prefix)), key=lambda e: e["ts"])
    device = sorted((e for e in events if e.get("cat") in DEVICE_CATS), key=lambda e: e["ts"])
    runtime = [e for e in events if e.get("cat") == "cuda_runtime"]
    rows = []
    for w in windows:
        start, end = float(w["ts"]), float(w["ts"]) + float(w["dur"])
        inside = [e for e in device if start <= float(e["ts"]) < end]
        spans = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in inside]
        row: dict[str, Any] = {"window": w["name"], "wall_ms": round((end - start) / 1e3, 3), "device_events": len(inside)}
        if spans:
            first, last = min(s for s, _ in spans), max(e for _, e in spans)
            row.update(first_device_ms=round((first - start) / 1e3, 3), last_device_end_ms=round((last - start) / 1e3, 3),
                       device_busy_ms=round(_union_us(spans) / 1e3, 3), tail_ms=round((end - last) / 1e3, 3))
            ordered = sorted(spans)
            holes, reach = [], ordered[0][1]
            for s, e in ordered[1:]:
                if s > reach:
                    holes.append((round((s - reach) / 1e3, 3), round((reach - start) / 1e3, 3)))
                reach = max(reach, e)
            row["largest_gaps_ms_at"] = sorted(holes, reverse=True)[:gaps]
        by_name: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
        for e in inside:
            kept = by_name[str(e["name"])[:60]]
            kept[0] += 1
            kept[1] += float(e["dur"]) / 1e3
        row["device_by_name"] = {n: [int(c), round(ms, 3)] for n, (c, ms) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:8]}
        calls = [e for e in runtime if start <= float(e["ts"]) < end]
        launches = [float(e["ts"]) for e in calls if "Launch" in str(e["name"])]
        if launches:
            row["first_launch_ms"], row["last_launch_ms"], row["launches"] = (
                round((min(launches) - start) / 1e3, 3), round((max(launches) - start) / 1e3, 3), len(launches))
        row["host_waits"] = [[str(e["name"]), round((float(e["ts"]) - start) / 1e3, 3), round(float(e["dur"]) / 1e3, 3)]
                             for e in calls if any(x in str(e["name"]) for x in WAITS) and float(e["dur"]) > 20.0]
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--prefix", default="sync")
    args = ap.parse_args()
    for row in summarize(json.loads(Path(args.trace).read_text()), args.prefix):
        print(json.dumps(row))


if __name__ == "__main__":
    main()
