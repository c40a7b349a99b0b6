"""End-to-end sync benchmark: an FSDP2 trainer on 2 GPUs streaming into rollout receivers.

Topology (one process per box): trainer ranks 0 and 1 on GPU0 and GPU1 (their own NCCL group),
receiver i on GPU 2+i. On a 4-GPU machine the receivers sit on GPU2 and GPU3; on a
2-GPU machine the one receiver shares GPU1 with trainer rank 1 (a different communicator: one NCCL
communicator never holds two ranks of one GPU). The weight-sync group is trainer rank 0 + receivers.

Measured in one run, median of --repeats:
  raw     : NCCL broadcast of the same bytes from GPU0 to every receiver (4 GiB messages)
  export  : both trainer ranks walk FSDP2TrainEngine.iter_weights() (unit all-gathers), no send
  sync    : export + pipelined transfer + every receiver copying each tensor into its destination
Reports GB/s per receiver, sync/raw, the stage split and extra memory per GPU; checks that every
receiver's weights equal what the trainer exported (checksums).

    python bench/fsdp2_sync_bench.py --preset qwen2.5-7b --receivers 1 --json out.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from typing import Any

import msgpack
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ckpt_engine.benchmark.processes import run_processes

RAW_MESSAGE_BYTES = 4 << 30


def _checksum_update(total: torch.Tensor, i: int, t: torch.Tensor) -> torch.Tensor:
    from ckpt_engine.checksum import bucket_checksum

    raw = t.reshape(-1).view(torch.uint8)
    # Always a private copy: the CPU checksum exposes memory to numpy, which pins the storage's
    # size, and the trainer's gathered parameters must stay resizable (FSDP frees them).
    raw = torch.cat([raw, raw.new_zeros((-raw.numel()) % 8)])
    return total * 31 + bucket_checksum(raw).cpu() + i


def _raw_broadcast(group: Any, buf: torch.Tensor, total: int) -> None:
    """`total` bytes from rank 0 in messages of `buf`'s size (sender and receivers call it alike)."""
    left = total
    while left > 0:
        n = min(left, buf.numel())
        group.broadcast(buf[:n], 0).wait()
        left -= n


def _mem(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def _allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def _cuda_sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _sync_group_barrier(group: Any, device: torch.device) -> None:
    flag = torch.ones(1, device=device)
    group.allreduce([flag]).wait()
    _cuda_sync(device)


def _trainer_main(rank: int, args: argparse.Namespace, ports: dict[str, int], token: str, out_dir: str) -> None:
    from transformers import AutoConfig

    from ckpt_engine.engine import Rendezvous
    from ckpt_engine.planning.buckets import plan_buckets
    from ckpt_engine.registry import CheckpointEngineRegistry
    from ckpt_engine.trainer.engines.common import hf_model_from_config
    from ckpt_engine.trainer.engines.fsdp2 import FSDP2Config, FSDP2TrainEngine

    gpu = args.backend == "nccl"
    device = torch.device("cuda", rank) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=args.timeout_s)
    store = dist.TCPStore("127.0.0.1", ports["trainer"], is_master=False, timeout=timeout)
    dist.init_process_group(args.backend, store=store, rank=rank, world_size=2, timeout=timeout, device_id=device if gpu else None)
    hf_config = AutoConfig.from_pretrained(args.preset_dir)
    with torch.device("meta"):
        model = hf_model_from_config(hf_config, getattr(torch, args.dtype))
    engine = FSDP2TrainEngine(model, config=FSDP2Config(wire_dtype=args.dtype), process_group=dist.group.WORLD, device=device)
    engine.materialize()
    specs = engine.source.metadata()
    rdzv = Rendezvous("127.0.0.1", ports["sync"], token, 1 + args.receivers, args.backend, args.timeout_s)
    if rank == 0:  # receivers size their destinations from the trainer's own metadata
        rdzv.connect_store().set("specs", msgpack.packb([[s.name, s.dtype, list(s.shape)] for s in specs]))
    _cuda_sync(device)
    mem_state = _allocated(device)
    _reset_peak(device)

    def barrier() -> None:
        dist.barrier()
        _cuda_sync(device)

    def export() -> None:
        for _ in engine.source.iter_weights():
            pass

    export_times = []
    export()
    for _ in range(args.repeats):
        barrier()
        t0 = time.perf_counter()
        export()
        _cuda_sync(device)
        barrier()
        export_times.append(time.perf_counter() - t0)
    export_peak = _mem(device) - mem_state

    sender = None
    if rank == 0:
        sender = CheckpointEngineRegistry.new(args.backend, bucket_size_bytes=args.bucket_mb << 20, timeout_s=args.timeout_s, device=device)
        sender.init_process_group(rdzv, 0)
        manifest = plan_buckets(specs, sender.bucket_size_bytes)
        total = manifest.total_bytes
        buf = torch.empty(min(total, RAW_MESSAGE_BYTES), dtype=torch.uint8, device=device)
        raw_times = []
        for _ in range(args.repeats + 1):
            _sync_group_barrier(sender.group, device)
            t0 = time.perf_counter()
            _raw_broadcast(sender.group, buf, total)
            _cuda_sync(device)
            _sync_group_barrier(sender.group, device)
            raw_times.append(time.perf_counter() - t0)
        del buf
        raw_times = raw_times[1:]
    _reset_peak(device)
    sync_times, stats = [], []
    for _ in range(args.repeats + 1):
        barrier()
        if sender is not None:
            _sync_group_barrier(sender.group, device)
        t0 = time.perf_counter()
        if sender is not None:
            stats.append(sender.send_weights(manifest, engine.source.iter_weights()))
            _sync_group_barrier(sender.group, device)  # every receiver has loaded
        else:
            export()
        _cuda_sync(device)
        sync_times.append(time.perf_counter() - t0)
        barrier()
    sync_times, stats = sync_times[1:], stats[1:]
    sync_peak = _mem(device) - mem_state
    checksum = torch.zeros(2, dtype=torch.int64)
    for i, (_, t) in enumerate(engine.source.iter_weights()):
        if rank == 0:
            checksum = _checksum_update(checksum, i, t.to(getattr(torch, specs[i].dtype)))
    result = {
        "role": f"trainer{rank}", "device": str(device), "export_s": export_times, "sync_s": sync_times,
        "extra_mem_export": export_peak, "extra_mem_sync": sync_peak, "state_bytes": mem_state,
    }
    if rank == 0:
        assert sender is not None
        result.update(
            raw_s=raw_times, bytes=manifest.total_bytes, tensors=manifest.num_tensors, buckets=manifest.num_buckets,
            checksum=checksum.tolist(), gpu=torch.cuda.get_device_name(device) if gpu else "cpu",
            send_export_s=[s.export_s for s in stats], send_pack_s=[s.pack_s for s in stats],
        )
        sender.finalize()
    with open(os.path.join(out_dir, f"trainer{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def _receiver_main(index: int, args: argparse.Namespace, ports: dict[str, int], token: str, out_dir: str) -> None:
    from ckpt_engine.planning.buckets import plan_buckets
    from ckpt_engine.copies import batched_copy_
    from ckpt_engine.engine import Rendezvous
    from ckpt_engine.manifest import TensorSpec
    from ckpt_engine.registry import CheckpointEngineRegistry

    if args.backend == "nccl":
        count = torch.cuda.device_count()
        # GPU2, GPU3, ... when there are enough; otherwise share the GPUs after the sender's
        # (on 2 GPUs: GPU1, beside trainer rank 1, in a different communicator).
        gpu = 2 + index if count >= 2 + args.receivers else 1 + index % (count - 1)
        device = torch.device("cuda", gpu)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    rdzv = Rendezvous("127.0.0.1", ports["sync"], token, 1 + args.receivers, args.backend, args.timeout_s)
    store = rdzv.connect_store()
    store.wait(["specs"], datetime.timedelta(seconds=args.timeout_s))
    specs = [TensorSpec(n, d, tuple(s)) for n, d, s in msgpack.unpackb(store.get("specs"), raw=False)]
    dst = {s.name: torch.zeros(s.shape, dtype=getattr(torch, s.dtype), device=device) for s in specs}
    _cuda_sync(device)
    base = _allocated(device)
    engine = CheckpointEngineRegistry.new(args.backend, bucket_size_bytes=args.bucket_mb << 20, timeout_s=args.timeout_s, device=device)
    engine.init_process_group(rdzv, 1 + index)
    manifest = plan_buckets(specs, engine.bucket_size_bytes)
    total = manifest.total_bytes
    buf = torch.empty(min(total, RAW_MESSAGE_BYTES), dtype=torch.uint8, device=device)
    for _ in range(args.repeats + 1):
        _sync_group_barrier(engine.group, device)
        _raw_broadcast(engine.group, buf, total)
        _cuda_sync(device)
        _sync_group_barrier(engine.group, device)
    del buf
    _reset_peak(device)
    load_times = []
    for _ in range(args.repeats + 1):
        for t in dst.values():
            t.zero_()
        _sync_group_barrier(engine.group, device)
        load = 0.0
        for bucket in engine.receive_buckets(manifest):
            t0 = time.perf_counter()
            batched_copy_([dst[n] for n, _ in bucket], [t for _, t in bucket])
            load += time.perf_counter() - t0
        _cuda_sync(device)
        _sync_group_barrier(engine.group, device)
        load_times.append(load)
    extra_mem = _mem(device) - base  # before the checksums, whose private copies are the bench's own
    checksum = torch.zeros(2, dtype=torch.int64)
    for i, s in enumerate(specs):
        checksum = _checksum_update(checksum, i, dst[s.name])
    result = {
        "role": f"receiver{index}", "device": str(device), "load_host_s": load_times[1:], "checksum": checksum.tolist(),
        "extra_mem_sync": extra_mem, "dst_bytes": base,
    }
    engine.finalize()
    with open(os.path.join(out_dir, f"receiver{index}.json"), "w") as f:
        json.dump(result, f)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen2.5-7b", help="qwen2.5-7b, qwen3-30b-a3b, tiny, or a path to an HF config.json")
    p.add_argument("--receivers", type=int, default=1)
    p.add_argument("--bucket-mb", type=int, default=1024)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--json", default=None)
    p.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto", help="gloo runs the same topology on CPU (smoke test)")
    args = p.parse_args(argv)
    if args.backend == "auto":
        args.backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    if args.backend == "nccl" and torch.cuda.device_count() < 2:
        print("the nccl run needs at least 2 CUDA GPUs", file=sys.stderr)
        return 2
    from ckpt_engine.benchmark.presets import load_preset_config

    config = load_preset_config(args.preset)
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f)
        args.preset_dir = tmp
        timeout = datetime.timedelta(seconds=args.timeout_s)
        trainer_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout)
        sync_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout)
        ports = {"trainer": trainer_store.port, "sync": sync_store.port}
        token = uuid.uuid4().hex
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_trainer_main, args=(r, args, ports, token, tmp)) for r in range(2)]
        procs += [ctx.Process(target=_receiver_main, args=(i, args, ports, token, tmp)) for i in range(args.receivers)]
        run_processes(procs, args.timeout_s)
        if any(proc.exitcode != 0 for proc in procs):
            print(f"ranks failed: exit codes {[proc.exitcode for proc in procs]}", file=sys.stderr)
            return 1
        parts = {}
        for name in os.listdir(tmp):
            if name.endswith(".json") and name != "config.json":
                with open(os.path.join(tmp, name)) as f:
                    parts[name[:-5]] = json.load(f)
    t0 = parts["trainer0"]
    med = statistics.median
    nbytes = t0["bytes"]
    summary = {
        "preset": args.preset, "backend": args.backend, "gpu": t0["gpu"], "gpus": torch.cuda.device_count(), "receivers": args.receivers,
        "bytes": nbytes, "tensors": t0["tensors"], "buckets": t0["buckets"], "bucket_mb": args.bucket_mb,
        "raw_s": med(t0["raw_s"]), "export_s": med(t0["export_s"]), "sync_s": med(t0["sync_s"]),
        "sender_export_in_sync_s": med(t0["send_export_s"]), "sender_pack_host_s": med(t0["send_pack_s"]),
        "load_host_s": {k: med(v["load_host_s"]) for k, v in parts.items() if k.startswith("receiver")},
        "extra_mem_bytes": {k: v["extra_mem_sync"] for k, v in parts.items()},
        "correct": all(v["checksum"] == t0["checksum"] for k, v in parts.items() if k.startswith("receiver")),
        "devices": {k: v["device"] for k, v in parts.items()},
    }
    summary["sync_over_raw"] = summary["sync_s"] / summary["raw_s"]
    summary["export_over_raw"] = summary["export_s"] / summary["raw_s"]
    summary["gbps_per_receiver"] = nbytes / summary["sync_s"] / 1e9
    print(json.dumps(summary, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "parts": parts}, f, indent=2)
    return 0 if summary["correct"] else 1


if __name__ == "__main__":
    sys.exit(main())
