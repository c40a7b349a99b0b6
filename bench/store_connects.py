"""How long members take to connect to the rendezvous store: torch's own listener against the
IPv4 listener `ckpt_engine.store.serve_store` gives an IPv4 host, in one run.

Why: torch's store server looks up a name for every peer that connects, on its one loop thread.
On torch's dual-stack listener an IPv4 peer is a v4-mapped address, which only DNS answers; where
DNS drops queries each such connection holds the store for the resolver's timeout.

    python bench/store_connects.py [--threads 8] [--rounds 5]
"""

from __future__ import annotations

import argparse
import datetime
import threading
import time

import torch

from ckpt_engine.store import serve_store


def connect_times(port: int, threads: int, rounds: int) -> list[float]:
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=8, help="members connecting at once")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch_own = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60))
    ours = serve_store("127.0.0.1", 60)
    for name, store in (("torch's listener", torch_own), ("IPv4 listener", ours)):
        times = sorted(connect_times(store.port, args.threads, args.rounds))
        slow = sum(t > 1.0 for t in times)
        print(f"{name:17s} {len(times)} connects: median {1e3 * times[len(times) // 2]:.1f} ms, max {times[-1]:.2f} s, over 1 s: {slow}")


if __name__ == "__main__":
    main()
