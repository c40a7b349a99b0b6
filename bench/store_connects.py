"""How long members take to connect to the rendezvous store: torch's own listener against the
IPv4 listener `ckpt_engine.store.serve_store` gives an IPv4 host, each in a fresh process,
alternately, in one run.

Why: torch's store server looks up a name for every peer that connects, on its one loop thread.
On torch's dual-stack listener an IPv4 peer is a v4-mapped address, which only DNS answers; where
DNS drops queries each such connection holds the store for the resolver's timeout.

    python bench/store_connects.py [--runs 3] [--threads 8] [--rounds 5]
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import threading
import time

import torch

from ckpt_engine.store import serve_store

LISTENERS = ("torch", "ipv4")


def connect_times(port: int, threads: int, rounds: int) -> list[float]:
    """`rounds` times, `threads` members connect at once and set a key; each one's seconds."""
    timeout = datetime.timedelta(seconds=60)
    times: list[float] = []

    def one() -> None:
        t = time.perf_counter()
        torch.distributed.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout).set("k", "v")
        times.append(time.perf_counter() - t)

    for _ in range(rounds):
        members = [threading.Thread(target=one) for _ in range(threads)]
        for m in members:
            m.start()
        for m in members:
            m.join()
    return times


def one_listener(listener: str, threads: int, rounds: int) -> list[float]:
    if listener == "torch":
        store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60))
    else:
        store = serve_store("127.0.0.1", 60)
    return connect_times(store.port, threads, rounds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3, help="fresh processes per listener")
    ap.add_argument("--threads", type=int, default=8, help="members connecting at once")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--listener", choices=LISTENERS, help="(internal) measure one listener in this process")
    args = ap.parse_args()
    if args.listener:
        print(json.dumps(one_listener(args.listener, args.threads, args.rounds)))
        return
    times: dict[str, list[float]] = {name: [] for name in LISTENERS}
    for _ in range(args.runs):
        for name in LISTENERS:
            cmd = [sys.executable, __file__, "--listener", name, "--threads", str(args.threads), "--rounds", str(args.rounds)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600).stdout
            times[name] += json.loads(out.splitlines()[-1])
    for name, ts in times.items():
        ts.sort()
        print(f"{name:5s} listener: {len(ts)} connects, median {1e3 * ts[len(ts) // 2]:.1f} ms, max {ts[-1]:.2f} s, over 1 s: {sum(t > 1.0 for t in ts)}")


if __name__ == "__main__":
    main()
