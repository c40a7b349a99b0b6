"""Probe: can grouped (coalesced) per-tensor NCCL broadcasts, straight from the sender's tensors into
the receiver's, match one raw broadcast? Two processes, GPU0 -> GPU1, preset shapes, no packing.

    python bench/nccl_coalesced_probe.py --preset qwen2.5-7b --group-mb 1024
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ckpt_engine.benchmark.presets import checkpoint_specs, load_preset_config


def _groups(sizes: list[int], limit: int) -> list[list[int]]:
    groups: list[list[int]] = [[]]
    total = 0
    for i, n in enumerate(sizes):
        if groups[-1] and total + n > limit:
            groups.append([])
            total = 0
        groups[-1].append(i)
        total += n
    return groups


def _rank(rank: int, port: int, args: argparse.Namespace, out: str) -> None:
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=120))
    opts = dist.ProcessGroupNCCL.Options()
    pg = dist.ProcessGroupNCCL(store, rank, 2, opts)
    specs = checkpoint_specs(load_preset_config(args.preset), dtype="bfloat16")
    tensors = [torch.full(s.shape, float(rank + 1), dtype=torch.bfloat16, device=dev) for s in specs]
    sizes = [t.numel() * 2 for t in tensors]
    raw = torch.empty(sum(sizes), dtype=torch.uint8, device=dev)

    def barrier() -> None:
        pg.allreduce([torch.ones(1, device=dev)]).wait()
        torch.cuda.synchronize()

    def timed(fn, iters: int) -> list[float]:
        times = []
        for _ in range(iters):
            barrier()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            barrier()
            times.append(time.perf_counter() - t0)
        return times

    def grouped(limit: int):
        groups = _groups(sizes, limit)

        def run() -> None:
            for g in groups:
                pg._start_coalescing()
                for i in g:
                    pg.broadcast(tensors[i], 0)
                pg._end_coalescing()

        return run, len(groups)

    res: dict[str, object] = {"raw": timed(lambda: pg.broadcast(raw, 0).wait(), args.iters)}
    for mb in args.group_mb:
        fn, n = grouped(int(mb * (1 << 20)))
        res[f"grouped_{mb}MiB_{n}groups"] = timed(fn, args.iters)
    ok = all(bool((t == 1).all()) for t in tensors) if rank == 1 else True
    res["correct"] = ok
    if rank == 1:
        with open(out, "w") as f:
            json.dump(res, f)
    pg.shutdown() if hasattr(pg, "shutdown") else None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="qwen2.5-7b")
    p.add_argument("--group-mb", type=float, nargs="+", default=[256, 1024, 4096])
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--json", default="coalesced_probe.json")
    args = p.parse_args()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(port, args, os.path.abspath(args.json)), nprocs=2)
    res = json.load(open(args.json))
    raw = min(res["raw"])
    for k, v in res.items():
        if isinstance(v, list):
            print(f"{k:32s} best {min(v) * 1e3:8.2f} ms   vs raw {raw / min(v):.3f}")
    print("correct:", res["correct"])


if __name__ == "__main__":
    main()
