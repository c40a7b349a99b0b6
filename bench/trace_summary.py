"""Where one traced sync's time goes, from the Chrome traces `ckpt-engine bench --profile DIR` writes:
per rank, the wall span of the trace, the busy time and the top kernels of each GPU stream, and the
top host ranges (`record_function` names and torch ops) by total time.

    python bench/trace_summary.py DIR [--top 12]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def _merged_busy(spans: list[tuple[float, float]]) -> float:
    """Microseconds covered by the union of `spans`."""
    busy, end = 0.0, float("-inf")
    for s, e in sorted(spans):
        if e <= end:
            continue
        busy += e - max(s, end)
        end = e
    return busy


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
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
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
    ap.add_argument("dir")
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    for path in sorted(Path(args.dir).glob("rank*.json")):
        summarize(path, args.top)


if __name__ == "__main__":
    main()
