"""Two processes, one GPU each (default cuda:1 -> cuda:0): one NCCL broadcast of 1 GiB and its
check, through torch.distributed; says whether the host's NCCL link works at all before any
engine is involved."""

from __future__ import annotations

import argparse
import datetime
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ckpt_engine.trainer.ports import free_port


def rank_main(rank: int, devices: list[int], port: int) -> None:
    torch.cuda.set_device(devices[rank])
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60), device_id=torch.device("cuda", devices[rank]))
    x = torch.full((1 << 30,), 7 if rank == 0 else 0, dtype=torch.uint8, device="cuda")
    for _ in range(3):
        torch.cuda.synchronize()
        t = time.perf_counter()
        dist.broadcast(x, src=0)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
    ok = bool((x == 7).all())
    print(f"rank {rank} on cuda:{devices[rank]}: ok={ok} 1 GiB in {dt * 1e3:.1f} ms ({(1 << 30) / dt / 1e9:.0f} GB/s)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("devices", type=int, nargs="*", default=[1, 0], help="the two GPUs, sender first (default: 1 0)")
    args = ap.parse_args()
    if len(args.devices) != 2:
        raise SystemExit(f"two GPU indices, sender first; got {args.devices}")
    mp.spawn(rank_main, args=(args.devices, free_port()), nprocs=2, join=True)
