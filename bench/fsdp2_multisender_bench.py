"""FSDP2 sync with one sender (rank 0 gathers) versus every trainer rank sending its own shards.

Topology (one process per rank): FSDP2 trainer ranks 0..N-1 on GPU0..GPU(N-1) (their own
group), receiver i on GPU N+i when the machine has them, else beside trainer ranks 1.. (as in
fsdp2_sync_bench.py), or where --receiver-gpus says; `--device cpu` runs the same on gloo CPU
processes. A receiver beside a trainer rank (the "shrunk" topology, e.g. 2 GPUs, one receiver on
GPU1) needs `--backend nccl_handoff` for multi mode: that rank hands its shard over through CUDA
IPC while the others broadcast over NCCL (raw_multi is skipped: NCCL cannot join two ranks of one
GPU); the summary's "shrunk" block then sets the sync against raw_single, the NCCL broadcast of
the same bytes from GPU0 measured in the same run. On CPU the same placement is emulated with
logical GPU numbers (the engine's `local_senders` override). One run measures, median of
--repeats after a warm-up:
  raw_single : broadcast of the model's bytes from trainer rank 0 to every receiver
  raw_multi  : every trainer rank broadcasts its share of those bytes at once, each on its own group
  single     : rank 0 sends `iter_weights()` (unit all-gathers; the other ranks walk it too)
  multi      : every rank sends `iter_pieces(engine.source, manifest)` (its local shards, no gather)
Both syncs move the same bytes and end when every receiver has copied every tensor into its own
destination. With --delta, every timed sync is a patch against the previous one, after each
trainer rank changed --delta-change of its elements (untimed). Reports sync/raw ratios, the bytes
each sender sends, extra memory (CUDA peak; on CPU the engine's buffers and delta bases), the
all-gathers one extra untimed multi sync issues (must be 0), and whether every receiver's weights
equal what the trainer exported (checksums).

    python bench/fsdp2_multisender_bench.py --preset qwen2.5-7b --trainers 2 --receivers 1 --json out.json
    python bench/fsdp2_multisender_bench.py --device cpu --preset tiny --repeats 2      # smoke test
    python bench/fsdp2_multisender_bench.py --trainers 2 --receivers 1 --receiver-gpus 1 --backend nccl_handoff
    ... --profile DIR    # also one more untimed multi sync per rank under cProfile: DIR/<role>.prof
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ckpt_engine.benchmark.processes import run_processes
from fsdp2_sync_bench import RAW_MESSAGE_BYTES, _checksum_update

MODES = ("single", "multi")
SHRUNK_TARGET = 1.05


def _cuda_sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device: torch.device) -> int:
    """Allocated bytes now, with the peak counter reset to it (0 on CPU)."""
    if device.type != "cuda":
        return 0
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def _peak(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


class _Ranks:
    """Who is where: trainers are global ranks [0, N), receivers [N, N + R); one gloo group over
    all of them for barriers, the trainers' FSDP group, and one raw-broadcast group per trainer."""

    def __init__(self, rank: int, args: argparse.Namespace, ports: dict[str, int]) -> None:
        self.rank, self.n, self.r = rank, args.trainers, args.receivers
        self.device = _device_of(rank, args)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        timeout = datetime.timedelta(seconds=args.timeout_s)
        store = dist.TCPStore("127.0.0.1", ports["world"], is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=self.n + self.r, timeout=timeout)
        receivers = list(range(self.n, self.n + self.r))
        self.trainer_group = dist.new_group(list(range(self.n)), backend=args.dist_backend, timeout=timeout)
        # NCCL cannot hold two ranks of one GPU in a communicator: a trainer on a receiver's GPU gets no raw group.
        shared = {_device_of(q, args) for q in receivers}
        self.raw_ok = [args.dist_backend != "nccl" or _device_of(s, args) not in shared for s in range(self.n)]
        self.raw = [
            dist.new_group([s, *receivers], backend=args.dist_backend, timeout=timeout) if ok else None for s, ok in enumerate(self.raw_ok)
        ]
        self._raw_bufs: dict[tuple[int, int], torch.Tensor] = {}

    @property
    def is_trainer(self) -> bool:
        return self.rank < self.n

    def barrier(self) -> None:
        _cuda_sync(self.device)
        dist.barrier()

    def raw_buffers(self, shares: list[int]) -> None:
        """Allocate (outside the timed region) one message buffer per sender this rank hears."""
        for s, nbytes in enumerate(shares):
            if nbytes and (self.rank == s or not self.is_trainer):
                self._raw_bufs.setdefault((s, nbytes), torch.empty(min(nbytes, RAW_MESSAGE_BYTES), dtype=torch.uint8, device=self.device))

    def free_raw_buffers(self) -> None:
        self._raw_bufs.clear()

    def raw_broadcast(self, shares: list[int]) -> None:
        """Sender s broadcasts shares[s] bytes on its own group, all senders at once."""
        works = []
        for s, nbytes in enumerate(shares):
            if nbytes == 0 or not (self.rank == s or not self.is_trainer):
                continue
            buf = self._raw_bufs[(s, nbytes)]
            left = nbytes
            while left > 0:
                n = min(left, buf.numel())
                works.append(dist.broadcast(buf[:n], src=s, group=self.raw[s], async_op=True))
                left -= n
        for w in works:
            w.wait()


def _device_of(rank: int, args: argparse.Namespace) -> torch.device:
    if args.device == "cpu":
        return torch.device("cpu")
    if rank < args.trainers:
        return torch.device("cuda", args.trainer_gpus[rank])
    return torch.device("cuda", args.receiver_gpus[(rank - args.trainers) % len(args.receiver_gpus)])


@contextlib.contextmanager
def _profiled(args: argparse.Namespace, role: str) -> Iterator[None]:
    """cProfile of the block into `<--profile>/<role>.prof` when --profile is set (one more untimed
    multi sync, outside CommDebugMode, whose dispatch hook would inflate every tensor op): where
    each rank's host time goes."""
    if not args.profile:
        yield
        return
    prof = cProfile.Profile()
    prof.enable()
    try:
        yield
    finally:
        prof.disable()
        os.makedirs(args.profile, exist_ok=True)
        prof.dump_stats(os.path.join(args.profile, f"{role}.prof"))


def _timed(ranks: _Ranks, repeats: int, step: Any, before: Any = None) -> list[float]:
    """`step(i)` on every rank between two barriers, repeats + 1 times; the first is a warm-up."""
    times = []
    for i in range(repeats + 1):
        if before is not None:
            before(i)
        ranks.barrier()
        t0 = time.perf_counter()
        step(i)
        ranks.barrier()
        times.append(time.perf_counter() - t0)
    return times[1:]


def _raw(ranks: _Ranks, args: argparse.Namespace, total: int, shares: list[int]) -> dict[str, list[float]]:
    """Raw broadcast times of the model's bytes: from rank 0 alone, and split over every trainer."""
    single = [total] + [0] * (args.trainers - 1)
    layouts = {"raw_single_s": single, **({"raw_multi_s": shares} if all(ranks.raw_ok) else {})}
    out = {}
    for key, layout in layouts.items():
        ranks.raw_buffers(layout)
        out[key] = _timed(ranks, args.repeats, lambda i, layout=layout: ranks.raw_broadcast(layout))
        ranks.free_raw_buffers()
    return out


def _memory(engine: Any, joined: bool, device: torch.device, state: int) -> dict[str, int]:
    """Extra memory of one mode: the CUDA peak over `state`, or on CPU what the engine holds
    (rotating buffers and delta bases); plus the engine's buffer bytes for comparison."""
    if not joined:
        return {"extra_mem": _peak(device) - state if device.type == "cuda" else 0, "buffer_bytes": 0, "base_bytes": 0}
    buffers = int(engine.prepare()["buffer_bytes"])
    extra = _peak(device) - state if device.type == "cuda" else buffers + engine.delta_base_bytes
    return {"extra_mem": extra, "buffer_bytes": buffers, "base_bytes": engine.delta_base_bytes}


def _sync_engine(args: argparse.Namespace, device: torch.device, mode: str) -> Any:
    from ckpt_engine.registry import CheckpointEngineRegistry

    kwargs: dict[str, Any] = {}
    if args.backend == "nccl_handoff" and args.device == "cpu":
        # CPU processes all share the host: emulate the GPU placement (trainers beside a receiver
        # hand over in memory, the others use gloo). On CUDA the engine finds them by device UUID.
        senders = range(args.trainers if mode == "multi" else 1)
        kwargs["local_senders"] = [s for s in senders if args.trainer_gpus[s] in args.receiver_gpus]
    return CheckpointEngineRegistry.new(args.backend, bucket_size_bytes=args.bucket_mb << 20, timeout_s=args.timeout_s, device=device, **kwargs)


def _delta(args: argparse.Namespace, mode: str, i: int) -> Any:
    from ckpt_engine.delta.request import DeltaRequest

    if not args.delta:
        return None
    base = 1000 * (MODES.index(mode) + 1)
    return DeltaRequest(i > 0, base + i - 1 if i > 0 else None, base + i)


def _perturb(engine: Any, fraction: float, i: int) -> None:
    """Scale every k-th element of every local shard by ~1% (a bf16-visible change), a new offset
    each time: what a training step does to about `fraction` of the wire elements, without one."""
    stride = max(1, round(1 / fraction))
    with torch.no_grad():
        for p in engine.model.parameters():
            local = p.to_local() if isinstance(p, torch.distributed.tensor.DTensor) else p
            if local.numel():
                local.view(-1)[i % stride :: stride].mul_(1.01)


def _trainer_main(rank: int, args: argparse.Namespace, ports: dict[str, int], out_dir: str) -> None:
    import msgpack
    from transformers import AutoConfig

    from ckpt_engine.engine import Rendezvous
    from ckpt_engine.manifest import encode_manifest
    from ckpt_engine.sources.sharded import iter_pieces
    from ckpt_engine.trainer.engines.common import hf_model_from_config
    from ckpt_engine.trainer.engines.fsdp2 import FSDP2Config, FSDP2TrainEngine
    from torch.distributed.tensor.debug import CommDebugMode

    ranks = _Ranks(rank, args, ports)
    device = ranks.device
    with torch.device("meta"):
        model = hf_model_from_config(AutoConfig.from_pretrained(args.preset_dir), getattr(torch, args.dtype))
    engine = FSDP2TrainEngine(model, config=FSDP2Config(wire_dtype=args.dtype), process_group=ranks.trainer_group, device=device)
    engine.materialize()
    specs = engine.source.metadata()
    sync = {m: _sync_engine(args, device, m) for m in MODES}
    manifests = {
        "single": sync["single"].plan(specs),
        "multi": sync["multi"].plan(specs, num_senders=args.trainers, owners=engine.source.owners()),
    }
    rdzv = {m: Rendezvous.from_dict(ports[f"rdzv_{m}"]) for m in MODES}
    store = rdzv["multi"].connect_store()
    if rank == 0:
        store.set("specs", msgpack.packb([[s.name, s.dtype, list(s.shape)] for s in specs]))
        for m in MODES:
            store.set(f"manifest/{m}", encode_manifest(manifests[m]))
    store.set(f"digest/{rank}", manifests["multi"].digest)
    if rank == 0:
        sync["single"].init_process_group(rdzv["single"], 0)
    sync["multi"].init_process_group(rdzv["multi"], rank)
    state = _reset_peak(device)
    result: dict[str, Any] = {"role": f"trainer{rank}", "device": str(device), "state_bytes": state, "stable_pieces": engine.source.stable_pieces}
    total = manifests["single"].total_bytes
    shares = manifests["multi"].bytes_per_sender()
    result.update(_raw(ranks, args, total, shares))

    def send(mode: str, i: int) -> None:
        m = manifests[mode]
        if mode == "multi":
            sync["multi"].send_weights(m, iter_pieces(engine.source, m), stable=engine.source.stable_pieces, delta=_delta(args, mode, i))
        elif rank == 0:
            sync["single"].send_weights(m, engine.source.iter_weights(), delta=_delta(args, mode, i))
        else:
            for _ in engine.source.iter_weights():  # a collective walk on every trainer rank
                pass

    before = (lambda i: _perturb(engine, args.delta_change, i) if i > 0 else None) if args.delta else None
    for mode in args.modes:
        state = _reset_peak(device)
        result[f"{mode}_s"] = _timed(ranks, args.repeats, lambda i, mode=mode: send(mode, i), before)
        for key, value in _memory(sync[mode], mode == "multi" or rank == 0, device, state).items():
            result[f"{mode}_{key}"] = value
        checksum = torch.zeros(2, dtype=torch.int64)
        for k, (_, t) in enumerate(engine.source.iter_weights()):
            if rank == 0:
                checksum = _checksum_update(checksum, k, t.to(getattr(torch, specs[k].dtype)))
        result[f"{mode}_checksum"] = checksum.tolist()
    if "multi" in args.modes:  # one more sync, untimed, counting every all-gather this rank issues
        ranks.barrier()
        with CommDebugMode() as comm:
            send("multi", args.repeats + 1)
        result["multi_all_gathers"] = sum(n for op, n in comm.get_comm_counts().items() if "gather" in str(op))
        ranks.barrier()
        if args.profile:
            with _profiled(args, f"trainer{rank}"):
                send("multi", args.repeats + 2)
            ranks.barrier()
    if rank == 0:
        result.update(bytes=total, tensors=manifests["single"].num_tensors, bytes_per_sender=shares,
                      local_senders=list(getattr(sync["multi"], "local_senders", [])),
                      gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                      digests_agree=all(store.get(f"digest/{r}").decode() == manifests["multi"].digest for r in range(args.trainers)))
    result["plan_builds"] = sync["multi"].send_plan_builds  # copy plans recorded over every multi sync (1: replayed after the first)
    for engine_ in sync.values():
        engine_.finalize()
    with open(os.path.join(out_dir, f"trainer{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def _receiver_main(rank: int, args: argparse.Namespace, ports: dict[str, int], out_dir: str) -> None:
    import msgpack

    from ckpt_engine.copies import batched_copy_
    from ckpt_engine.engine import Rendezvous
    from ckpt_engine.manifest import TensorSpec, decode_manifest

    ranks = _Ranks(rank, args, ports)
    device, index = ranks.device, rank - args.trainers
    rdzv = {m: Rendezvous.from_dict(ports[f"rdzv_{m}"]) for m in MODES}
    store = rdzv["multi"].connect_store()
    store.wait(["specs", "manifest/single", "manifest/multi"], datetime.timedelta(seconds=args.timeout_s))
    specs = [TensorSpec(n, d, tuple(s)) for n, d, s in msgpack.unpackb(store.get("specs"), raw=False)]
    manifests = {m: decode_manifest(store.get(f"manifest/{m}")) for m in MODES}
    dst = {s.name: torch.zeros(s.shape, dtype=getattr(torch, s.dtype), device=device) for s in specs}
    sync = {m: _sync_engine(args, device, m) for m in MODES}
    sync["single"].init_process_group(rdzv["single"], 1 + index)
    sync["multi"].init_process_group(rdzv["multi"], args.trainers + index)
    result: dict[str, Any] = {"role": f"receiver{index}", "device": str(device)}
    _raw(ranks, args, manifests["single"].total_bytes, manifests["multi"].bytes_per_sender())

    def receive(mode: str, i: int) -> None:
        for bucket in sync[mode].receive_buckets(manifests[mode], delta=_delta(args, mode, i)):
            batched_copy_([dst[n] for n, _ in bucket], [t for _, t in bucket])

    for mode in args.modes:
        state = _reset_peak(device)
        _timed(ranks, args.repeats, lambda i, mode=mode: receive(mode, i))
        for key, value in _memory(sync[mode], True, device, state).items():
            result[f"{mode}_{key}"] = value
        checksum = torch.zeros(2, dtype=torch.int64)
        for k, s in enumerate(specs):
            checksum = _checksum_update(checksum, k, dst[s.name])
        result[f"{mode}_checksum"] = checksum.tolist()
        for t in dst.values():
            t.zero_()
    if "multi" in args.modes:
        ranks.barrier()
        receive("multi", args.repeats + 1)
        ranks.barrier()
        if args.profile:
            with _profiled(args, f"receiver{index}"):
                receive("multi", args.repeats + 2)
            ranks.barrier()
    result["plan_builds"] = sync["multi"].receive_plan_builds
    for engine in sync.values():
        engine.finalize()
    with open(os.path.join(out_dir, f"receiver{index}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def _entry(rank: int, args: argparse.Namespace, ports: dict[str, Any], out_dir: str) -> None:
    torch.set_num_threads(args.threads)
    (_trainer_main if rank < args.trainers else _receiver_main)(rank, args, ports, out_dir)


def _summary(args: argparse.Namespace, parts: dict[str, dict[str, Any]]) -> dict[str, Any]:
    t0, med = parts["trainer0"], statistics.median
    out: dict[str, Any] = {
        "preset": args.preset, "backend": args.backend, "device": t0["gpu"], "trainers": args.trainers, "receivers": args.receivers,
        "local_senders": t0["local_senders"],
        "delta": args.delta, "delta_change": args.delta_change if args.delta else None, "bytes": t0["bytes"],
        "tensors": t0["tensors"], "bytes_per_sender": t0["bytes_per_sender"], "bucket_mb": args.bucket_mb,
        "raw_single_s": med(t0["raw_single_s"]), "raw_multi_s": med(t0["raw_multi_s"]) if "raw_multi_s" in t0 else None,
        "devices": {k: v["device"] for k, v in parts.items()}, "stable_pieces": t0["stable_pieces"], "manifests_agree": t0["digests_agree"],
    }
    receivers = [v for k, v in parts.items() if k.startswith("receiver")]
    for mode in args.modes:
        s = med(t0[f"{mode}_s"])
        out[f"{mode}_s"] = s
        out[f"{mode}_over_raw_single"] = s / out["raw_single_s"]
        if out["raw_multi_s"]:
            out[f"{mode}_over_raw_multi"] = s / out["raw_multi_s"]
        out[f"{mode}_gbps_per_receiver"] = out["bytes"] / s / 1e9
        out[f"{mode}_extra_mem_bytes"] = {k: v[f"{mode}_extra_mem"] for k, v in parts.items()}
        out[f"{mode}_buffer_bytes"] = {k: v[f"{mode}_buffer_bytes"] for k, v in parts.items()}
        if args.delta:
            out[f"{mode}_delta_base_bytes"] = {k: v[f"{mode}_base_bytes"] for k, v in parts.items()}
        out[f"{mode}_correct"] = all(r[f"{mode}_checksum"] == t0[f"{mode}_checksum"] for r in receivers)
    if "single" in args.modes and "multi" in args.modes:
        out["single_over_multi"] = out["single_s"] / out["multi_s"]
    if "multi" in args.modes:
        out["multi_all_gathers"] = {k: v["multi_all_gathers"] for k, v in parts.items() if k.startswith("trainer")}
        out["multi_plan_builds"] = {k: v["plan_builds"] for k, v in parts.items()}
    if "multi" in args.modes and out["local_senders"]:
        # The shrunk topology's goal: every rank sends its own shard (some through the hand-off),
        # within 1.05x of one NCCL broadcast of all the bytes from trainer rank 0, same run.
        ratio = out["multi_over_raw_single"]
        out["shrunk"] = {"local_senders": out["local_senders"], "raw_broadcast_from_rank0_s": out["raw_single_s"],
                         "sync_s": out["multi_s"], "ratio": ratio, "target": SHRUNK_TARGET, "met": ratio <= SHRUNK_TARGET}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen2.5-7b", help="qwen2.5-7b, qwen3-30b-a3b, tiny, or a path to an HF config.json")
    p.add_argument("--trainers", type=int, default=2, help="FSDP2 ranks, each one sender in multi mode")
    p.add_argument("--receivers", type=int, default=1)
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto", help="cpu: gloo processes (smoke test)")
    p.add_argument("--backend", default=None, help="weight-sync backend: nccl (gloo on cpu, the default) or nccl_handoff")
    p.add_argument("--trainer-gpus", default=None, help="comma list, default 0..N-1")
    p.add_argument("--receiver-gpus", default=None, help="comma list, default N..N+R-1 (wrapping onto the trainers' GPUs when short)")
    p.add_argument("--modes", default="single,multi", help="comma list of single, multi")
    p.add_argument("--delta", action="store_true", help="timed syncs are patches against the previous one")
    p.add_argument("--delta-change", type=float, default=0.1, help="fraction of elements each trainer rank changes between delta syncs")
    p.add_argument("--bucket-mb", type=int, default=1024)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--json", default=None)
    p.add_argument("--profile", default=None, help="folder: cProfile of one more untimed multi sync per rank (<role>.prof)")
    args = p.parse_args(argv)
    gpus = torch.cuda.device_count()
    if args.device == "auto":
        args.device = "cuda" if gpus >= 2 else "cpu"
    args.dist_backend = "nccl" if args.device == "cuda" else "gloo"
    args.backend = args.backend if args.backend is not None else args.dist_backend
    if args.backend not in (args.dist_backend, "nccl_handoff"):
        p.error(f"--backend must be {args.dist_backend} or nccl_handoff on {args.device}, got {args.backend!r}")
    args.modes = tuple(m for m in args.modes.split(",") if m)
    if not args.modes or any(m not in MODES for m in args.modes):
        p.error(f"--modes must list some of {', '.join(MODES)}, got {','.join(args.modes)!r}")
    if args.trainers < 1 or args.receivers < 1 or not 0 < args.delta_change <= 1:
        p.error("--trainers and --receivers must be >= 1 and --delta-change in (0, 1]")
    # GPU numbers; on CPU they are logical (they say which trainers sit beside a receiver).
    gpus_here = gpus if args.device == "cuda" else args.trainers + args.receivers
    if args.device == "cuda" and gpus < 2:
        p.error(f"--device cuda needs at least 2 GPUs, found {gpus}")
    args.trainer_gpus = [int(g) for g in args.trainer_gpus.split(",")] if args.trainer_gpus else list(range(args.trainers))
    # Receivers on GPUs of their own when there are enough; else beside trainer ranks 1.. (never
    # beside rank 0, the single-mode sender: one NCCL communicator never holds two ranks of a GPU).
    fits = gpus_here >= args.trainers + args.receivers
    default = [args.trainers + i if fits else 1 + i % (gpus_here - 1) for i in range(args.receivers)]
    args.receiver_gpus = [int(g) for g in args.receiver_gpus.split(",")] if args.receiver_gpus else default
    if len(args.trainer_gpus) != args.trainers or (args.device == "cuda" and max(args.trainer_gpus + args.receiver_gpus) >= gpus):
        p.error(f"need {args.trainers} trainer GPUs and receiver GPUs below {gpus}")
    if args.trainer_gpus[0] in args.receiver_gpus:
        p.error(f"a receiver on GPU {args.trainer_gpus[0]} would share it with trainer rank 0, the single-mode sender")
    beside = sorted({s for s, g in enumerate(args.trainer_gpus) if g in args.receiver_gpus})
    if beside and "multi" in args.modes:
        if args.backend != "nccl_handoff" and args.device == "cuda":
            p.error(f"trainer ranks {beside} share a GPU with a receiver: multi mode needs --backend nccl_handoff")
        if args.backend == "nccl_handoff" and args.delta:
            p.error("nccl_handoff does not do delta syncs while a trainer rank hands over in memory; drop --delta")
        if args.backend == "nccl_handoff" and args.receivers != 1:
            p.error(f"nccl_handoff hands the shards of trainer ranks {beside} to exactly one receiver; got --receivers {args.receivers}")
    from ckpt_engine.benchmark.presets import load_preset_config

    config = load_preset_config(args.preset)
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f)
        args.preset_dir = tmp
        timeout = datetime.timedelta(seconds=args.timeout_s)
        world_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout)
        sync_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout)
        ports: dict[str, Any] = {"world": world_store.port}
        for m in MODES:
            senders = args.trainers if m == "multi" else 1
            ports[f"rdzv_{m}"] = {"host": "127.0.0.1", "port": sync_store.port, "token": uuid.uuid4().hex,
                                  "world_size": senders + args.receivers, "backend": args.backend, "timeout_s": args.timeout_s,
                                  **({"num_senders": senders} if senders > 1 else {})}
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_entry, args=(r, args, ports, tmp)) for r in range(args.trainers + args.receivers)]
        run_processes(procs, args.timeout_s)
        if any(proc.exitcode != 0 for proc in procs):
            print(f"ranks failed: exit codes {[proc.exitcode for proc in procs]}", file=sys.stderr)
            return 1
        parts = {}
        for name in os.listdir(tmp):
            if name.endswith(".json") and name != "config.json":
                with open(os.path.join(tmp, name)) as f:
                    parts[name[:-5]] = json.load(f)
    summary = _summary(args, parts)
    print(json.dumps(summary, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "parts": parts}, f, indent=2)
    ok = all(summary[f"{m}_correct"] for m in args.modes) and not any(summary.get("multi_all_gathers", {}).values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
