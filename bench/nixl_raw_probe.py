"""The link's own one-sided pull speed: a receiver READs a sender's registered buffer with NIXL, in
messages of `--message-mb`, through the same agents the nixl transport makes (`NixlAgent`: UCX, no
progress thread, the sender progressing its worker while it waits), with no packing, no loading and
no store flag per message. The nixl transport's sync is compared with this the way the other
transports' syncs are compared with a raw broadcast (bench/RESULTS.md).

    python bench/nixl_raw_probe.py --mb 2646 --message-mb 1024 [--reps 3] [--device cpu|cuda]

Two processes on this host (on a GPU box: --device cuda puts sender and receiver on GPUs 0 and 1);
metadata and flags travel as msgpack through a TCPStore on a free port. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import statistics
import time

import torch

from ckpt_engine.transports.nixl_agent import NixlAgent, SlotOffer, load_nixl


def _rank(rank: int, port: int, args: argparse.Namespace, out: mp.Queue) -> None:
    api = load_nixl()
    store = torch.distributed.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=120))
    nbytes, msg = int(args.mb * 2**20), int(args.message_mb * 2**20)
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    buf = (torch.full((nbytes,), 7, dtype=torch.uint8) if rank == 0 else torch.zeros(nbytes, dtype=torch.uint8)).to(device)
    agent = NixlAgent(api, f"probe{rank}", [buf])
    if rank == 0:
        store.set("offer", agent.offer().encode())
        while not store.check(["done"]):  # serve the reads (UCX over TCP needs the target to progress)
            agent.progress()
            time.sleep(1e-4)
        agent.close()
        return
    store.wait(["offer"])
    agent.add_peer(0, SlotOffer.decode(store.get("offer"), sender=0, num_slots=1, slot_bytes=nbytes))
    views = [buf[o : o + msg] for o in range(0, nbytes, msg)]
    times = []
    for _ in range(args.reps):
        buf.zero_()
        t0 = time.perf_counter()
        reqs = [agent.read(0, 0, v.data_ptr() - buf.data_ptr(), v) for v in views]  # all in flight at once
        for req in reqs:
            while (state := agent.state(req)) == "PROC":
                pass
            if state != "DONE":
                raise RuntimeError(f"a read failed: {state}")
        times.append(time.perf_counter() - t0)
        if not bool((buf == 7).all()):
            raise RuntimeError("the bytes read differ from the sender's")
    store.set("done", b"1")
    agent.close()
    out.put({"bytes": nbytes, "message_bytes": msg, "messages": len(views), "best_s": min(times), "median_s": statistics.median(times),
             "best_gbps": nbytes / min(times) / 1e9, "device": str(device), "all_s": times})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=2646.0, help="bytes to read, MiB (default: qwen2.5-7b --layers 1)")
    p.add_argument("--message-mb", type=float, default=64.0, help="one READ's size, MiB")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = p.parse_args()
    master = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, master.port, args, out)) for r in (0, 1)]
    for proc in procs:
        proc.start()
    result = out.get(timeout=600)
    for proc in procs:
        proc.join(60)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
