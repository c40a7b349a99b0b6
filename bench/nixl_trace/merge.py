"""Merge the nixl trace files of one bench run (see sitecustomize.py here) into one timeline per
sync, in ms from the sender's first announcement, and a per-bucket summary: how long each READ was
in flight, how long the link (as this receiver sees it) idled between two READs, and the loader's
time.

    python bench/nixl_trace/merge.py DIR [SYNC]   # SYNC: 0-based, default the last one
"""

from __future__ import annotations

import glob
import os
import sys


def events(folder: str) -> list[tuple[float, str]]:
    out: list[tuple[float, str]] = []
    for path in glob.glob(os.path.join(folder, "*.log")):
        with open(path) as f:
            for line in f:
                p = line.split()
                if len(p) > 3 and p[:2] == ["nixl", "trace"]:
                    out.append((float(p[2]), " ".join(p[3:])))
    return sorted(out)


def main() -> None:
    ev = events(sys.argv[1])
    starts = [i for i, (_, w) in enumerate(ev) if w.startswith("rank 0 packed+announced bucket 0")]
    if not starts:
        sys.exit("no sync in these traces (was CKPT_NIXL_TRACE_DIR set for the bench?)")
    which = int(sys.argv[2]) if len(sys.argv) > 2 else len(starts) - 1
    lo, hi = starts[which], starts[which + 1] if which + 1 < len(starts) else len(ev)
    t0 = ev[lo][0]
    posted: dict[str, float] = {}
    last_done: dict[str, float] = {}
    for t, w in ev[lo:hi]:
        print(f"{(t - t0) * 1e3:10.3f} ms  {w}")
        p = w.split()
        rank = p[1]
        if "read posted" in w:
            posted[rank + p[5]] = t
        elif "read done seen" in w:
            k = rank + p[6]
            gap = (posted[k] - last_done[rank]) * 1e3 if rank in last_done and posted.get(k, 0) > last_done[rank] else 0.0
            print(f"{'':14}rank {rank} bucket {p[6]}: posted..seen {(t - posted.get(k, t)) * 1e3:.3f} ms, link idle before it {gap:.3f} ms")
            last_done[rank] = t
    print(f"sync {which} of {len(starts)}: {(ev[hi - 1][0] - t0) * 1e3:.3f} ms from the first announcement to the last event")


if __name__ == "__main__":
    main()
