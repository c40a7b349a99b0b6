"""Where one traced sync's time goes, from the Chrome traces `ckpt-engine bench --profile DIR` writes:
per rank, the wall span of the trace, the busy time and the top kernels of each GPU stream, and the
top host ranges (`record_function` names and torch ops) by total time; or, with `--windows PREFIX`,
one JSON row per marked window of one trace (`windows`: `bench/vllm_colocated_bench.py --trace`);
or, with `--calls PREFIX` on a trace recorded with Python stacks (`--trace-stack`), the library's and
vLLM's Python calls on each thread before the window's first device work and after its last (`calls`).

    python bench/trace_summary.py DIR [--top 12]
    python bench/trace_summary.py TRACE.json --windows sync
    python bench/trace_summary.py TRACE.json --calls sync [--min-us 60]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any


def _merged_busy(spans: list[tuple[float, float]]) -> float:
    """Microseconds covered by the union of `spans`."""
    busy, end = 0.0, float("-inf")
    for s, e in sorted(spans):
        if e <= end:
            continue
        busy += e - max(s, end)
        end = e
    return busy


_DEVICE = {"kernel", "gpu_memcpy", "gpu_memset"}
_WAITS = ("Synchronize", "cudaMemcpy ")  # a host call that blocks until the device catches up


def windows(trace: dict[str, Any], prefix: str = "sync", gaps: int = 5) -> list[dict[str, Any]]:
    """Per marked window (a `record_function` label starting with `prefix`, e.g. one sync; in trace
    order): when the first device work starts and the last ends (ms from the window's start), how busy
    the device is between them, the largest idle gaps, the kernels by name, and the host's first
    launch and its waits on the device. Why: a colocated sync into vLLM is held against one device
    copy of its bytes, and host timings cannot say whether the copies wait for the host."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    windows = sorted((e for e in events if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith(prefix)), key=lambda e: e["ts"])
    device = sorted((e for e in events if e.get("cat") in _DEVICE), key=lambda e: e["ts"])
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
                       device_busy_ms=round(_merged_busy(spans) / 1e3, 3), tail_ms=round((end - last) / 1e3, 3))
            ordered = sorted(spans)
            holes, reach = [], ordered[0][1]
            for s, e in ordered[1:]:
                if s > reach:
                    holes.append((round((s - reach) / 1e3, 3), round((reach - start) / 1e3, 3)))
                reach = max(reach, e)
            row["largest_gaps_ms_at"] = sorted(holes, reverse=True)[:gaps]
        by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
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
                             for e in calls if any(x in str(e["name"]) for x in _WAITS) and float(e["dur"]) > 20.0]
        rows.append(row)
    return rows


def calls(trace: dict[str, Any], prefix: str = "sync", min_us: float = 60.0, where: tuple[str, ...] = ("ckpt_engine/", "vllm/")) -> list[str]:
    """Per marked window, the Python calls (`python_function` events of files under `where`, at least
    `min_us` long) that overlap its head (the window's start to the device's first work) or its tail
    (the device's last work to the window's end): one line each, `thread start_ms dur_ms name`, nested
    calls indented under their caller on that thread. Why: with the copies back to back, what a
    colocated sync into vLLM has left above one device copy is host work before the first copy and
    after the last, and which thread holds it (the interpreter lock) decides what can overlap."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    marks = sorted((e for e in events if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith(prefix)), key=lambda e: e["ts"])
    device = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events if e.get("cat") in _DEVICE]
    py = sorted((e for e in events if e.get("cat") == "python_function" and any(w in str(e.get("name", "")) for w in where)),
                key=lambda e: (e["ts"], -e["dur"]))
    threads: dict[Any, str] = {}
    lines: list[str] = []
    for w in marks:
        start, end = float(w["ts"]), float(w["ts"]) + float(w["dur"])
        inside = [(s, e) for s, e in device if start <= s < end]
        first = min((s for s, _ in inside), default=end)
        last = max((e for _, e in inside), default=end)
        for part, lo, hi in (("head", start, first), ("tail", last, end)):
            lines.append(f"== {w['name']} {part}: {(lo - start) / 1e3:.3f}-{(hi - start) / 1e3:.3f} ms")
            open_calls: dict[Any, list[float]] = defaultdict(list)  # per thread: the ends of the calls it is inside
            for e in py:
                s, d = float(e["ts"]), float(e["dur"])
                tid = e.get("tid")
                stack = open_calls[tid]
                while stack and stack[-1] <= s:
                    stack.pop()
                depth = len(stack)
                stack.append(s + d)
                if d < min_us or s >= hi or s + d <= lo:
                    continue
                name = threads.setdefault(tid, f"t{len(threads)}")
                lines.append(f"{name:>4} {(s - start) / 1e3:8.3f} {d / 1e3:7.3f} {'  ' * min(depth, 30)}{str(e['name'])[:110]}")
    return lines


def summarize(path: Path, top: int) -> None:
    events = [e for e in json.loads(path.read_text()).get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    if not events:
        print(f"{path.name}: no events")
        return
    t0 = min(e["ts"] for e in events)
    t1 = max(e["ts"] + e["dur"] for e in events)
    print(f"== {path.name}: span {(t1 - t0) / 1e3:.2f} ms, {len(events)} events")
    gpu: dict[object, list[dict]] = defaultdict(list)
    host: dict[str, list[float]] = defaultdict(list)
    for e in events:
        cat = str(e.get("cat", ""))
        if cat in _DEVICE:
            gpu[e.get("tid")].append(e)
        elif cat in ("user_annotation", "cpu_op", "python_function"):
            host[e["name"]].append(e["dur"])
    for tid, evs in sorted(gpu.items(), key=lambda kv: str(kv[0])):
        spans = [(e["ts"], e["ts"] + e["dur"]) for e in evs]
        first, last = min(s for s, _ in spans), max(e for _, e in spans)
        print(f"  gpu stream {tid}: busy {_merged_busy(spans) / 1e3:.2f} ms of {(last - first) / 1e3:.2f} ms "
              f"(starts at +{(first - t0) / 1e3:.2f} ms), {len(evs)} ops")
        per: dict[str, list[float]] = defaultdict(list)
        for e in evs:
            per[e["name"][:70]].append(e["dur"])
        for name, durs in sorted(per.items(), key=lambda kv: -sum(kv[1]))[:top]:
            print(f"    {sum(durs) / 1e3:8.2f} ms  x{len(durs):<6} {name}")
    print("  host (total ms, calls):")
    for name, durs in sorted(host.items(), key=lambda kv: -sum(kv[1]))[:top]:
        print(f"    {sum(durs) / 1e3:8.2f} ms  x{len(durs):<6} {name[:90]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", help="a folder of rank*.json traces, or with --windows one trace")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--windows", default=None, metavar="PREFIX", help="one row per record_function window whose label starts with PREFIX")
    ap.add_argument("--calls", default=None, metavar="PREFIX", help="the Python calls around the device work of each window whose label starts with PREFIX")
    ap.add_argument("--min-us", type=float, default=60.0)
    args = ap.parse_args()
    if args.calls is not None:
        print("\n".join(calls(json.loads(Path(args.dir).read_text()), args.calls, args.min_us)))
        return
    if args.windows is not None:
        for row in windows(json.loads(Path(args.dir).read_text()), args.windows):
            print(json.dumps(row))
        return
    for path in sorted(Path(args.dir).glob("rank*.json")):
        summarize(path, args.top)


if __name__ == "__main__":
    main()
