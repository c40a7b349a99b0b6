"""One rank of `ckpt-engine bench`: rank 0 sends, the others receive into destination tensors.

Each rank measures, over the same process group and the same bytes: (a) `raw`, the link's own
speed: the bytes as back-to-back broadcasts of at most 1 GiB from two rotating buffers (never one
model-sized buffer: `raw_link.py`), or on the colocated transport one device-to-device copy of the
same bytes; (b) on request the same bytes in bucket-sized messages; (c) a naive broadcast per
tensor straight into its destination; (d) ckpt-engine's pipelined sync with the receiver copying
every tensor into its destination, as an engine's loader would. Every mode also reports the extra
memory it took on this rank (`memory.py`). Results (JSON) go to the rendezvous store for the driver.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from typing import Any

import torch

from ckpt_engine.sources.wire import torch_dtype
from ckpt_engine.benchmark.memory import PeakMeter, resident_bytes
from ckpt_engine.benchmark.presets import checkpoint_specs, load_preset_config
from ckpt_engine.benchmark.raw_link import broadcast_bytes, copy_bytes, raw_message_bytes
from ckpt_engine.benchmark.tracing import traced
from ckpt_engine.checksum import bucket_checksum
from ckpt_engine.copies import batched_copy_
from ckpt_engine.engine import CheckpointEngine, Rendezvous
from ckpt_engine.pipeline.engine import PipelinedEngine
from ckpt_engine.registry import CheckpointEngineRegistry

logger = logging.getLogger(__name__)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fill(t: torch.Tensor, seed: int) -> None:
    """Cheap deterministic content that differs per tensor (not all zeros)."""
    if t.numel() == 0:
        return
    if t.is_floating_point():
        t.copy_(torch.linspace(-1.0, 1.0, t.numel(), device=t.device).view(t.shape) * (1 + seed % 7))
    else:
        t.copy_(torch.arange(t.numel(), device=t.device).view(t.shape) % 251 + seed % 3)


def weights_checksum(tensors: list[torch.Tensor]) -> list[int]:
    """Order-sensitive checksum of many tensors, computed where they live."""
    total = torch.zeros(2, dtype=torch.int64)
    for i, t in enumerate(tensors):
        raw = t.reshape(-1).view(torch.uint8)
        pad = (-raw.numel()) % 8
        if pad:
            raw = torch.cat([raw, raw.new_zeros(pad)])
        c = bucket_checksum(raw).cpu()
        total = total * 31 + c + i
    return total.tolist()


def pipelined(engine: CheckpointEngine) -> PipelinedEngine:
    """`engine` as a transport backend's: the raw modes measure its transport's own groups."""
    if not isinstance(engine, PipelinedEngine):
        raise TypeError(f"the bench needs a transport backend (a PipelinedEngine), got {type(engine).__name__}")
    return engine


class BenchRank:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rank = args.rank
        if args.device == "cuda":
            ngpu = 1 if args.backend == "colocated" else torch.cuda.device_count()  # colocated: one GPU shared
            self.device = torch.device("cuda", self.rank % ngpu)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        config = load_preset_config(args.preset)
        self.specs = checkpoint_specs(config, dtype=args.dtype, num_layers=args.layers)
        self.rdzv = Rendezvous(args.host, args.port, args.token, args.world_size, args.backend, args.timeout_s)
        self.store = self.rdzv.connect_store()
        self.engine = pipelined(CheckpointEngineRegistry.new(
            args.backend,
            bucket_size_bytes=int(args.bucket_mb * (1 << 20)) // 4096 * 4096,
            num_buffers=args.buffers,
            timeout_s=args.timeout_s,
            device=self.device,
            solo_bytes=None if args.solo_mb is None else int(args.solo_mb * (1 << 20)),
            **json.loads(args.engine_kwargs),
        ))
        self.tensors = [torch.empty(s.shape, dtype=torch_dtype(s.dtype), device=self.device) for s in self.specs]
        for i, t in enumerate(self.tensors):
            if self.rank == 0:
                _fill(t, i)
            else:
                t.zero_()
        _sync(self.device)
        self.mem_state = self._mem()  # the weights are in place; the engine's buffers come with the group
        self.engine.init_process_group(self.rdzv, self.rank)
        self.group = self.engine.group
        self._barriers = 0
        self.manifest = self.engine.plan(self.specs)
        self.total_bytes = sum(s.nbytes for s in self.specs)

    def _mem(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        return resident_bytes() or 0

    def _barrier(self) -> None:
        """Every rank reaches this point: an all-reduce on the engine's process group, or, where the
        transport has none (colocated: its link is the rendezvous store), a counter in the store."""
        if not isinstance(self.group, torch.distributed.Store):
            flag = torch.ones(1, device=self.device)
            self.group.allreduce([flag]).wait()
            _sync(self.device)
            return
        _sync(self.device)
        self._barriers += 1
        key = f"bench/barrier/{self._barriers}"
        self.store.add(key, 1)
        deadline = time.monotonic() + self.args.timeout_s
        while self.store.add(key, 0) < self.args.world_size:
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {self.rank}: bench barrier {self._barriers} not reached by every rank within {self.args.timeout_s}s")
            time.sleep(5e-5)

    def _timed(self, fn: Any) -> float:
        self._barrier()
        t0 = time.perf_counter()
        fn()
        _sync(self.device)
        self._barrier()
        return time.perf_counter() - t0

    def _progress(self) -> None:
        if self.rank == 0:
            self.store.add("progress", 1)

    @property
    def colocated(self) -> bool:
        """The transport has no process group (its link is the rendezvous store): no broadcast."""
        return isinstance(self.group, torch.distributed.Store)

    def _repeat(self, fn: Any) -> list[float]:
        times = []
        for _ in range(self.args.iters):
            times.append(self._timed(fn))
            self._progress()
        return times

    def raw(self) -> list[float]:
        """The same bytes at the link's own speed (`raw_link.py`); colocated: rank 0 copies them
        device to device while the receiver waits (one copy, as one process on one device)."""
        message = raw_message_bytes(self.total_bytes, self.engine.bucket_size_bytes)
        if self.colocated:
            fn = copy_bytes(self.total_bytes, message, self.device) if self.rank == 0 else (lambda: None)
        else:
            fn = broadcast_bytes(self.group, self.total_bytes, message, self.device, self.args.timeout_s)
        return self._repeat(fn)

    def bucketed(self) -> list[float]:
        """The raw broadcast cut into bucket-sized messages, back to back: the best any bucketed
        transfer over this link can do, before packing and loading."""
        return self._repeat(broadcast_bytes(self.group, self.total_bytes, self.engine.bucket_size_bytes, self.device, self.args.timeout_s))

    def naive(self) -> list[float]:
        def run() -> None:
            work = None
            for t in self.tensors:
                work = self.group.broadcast(t, 0)
                if self.device.type == "cpu":
                    work.wait()
            if work is not None:
                work.wait()

        times = []
        for _ in range(self.args.iters):
            self._zero_receivers()
            times.append(self._timed(run))
            self._progress()
        return times

    def _zero_receivers(self) -> None:
        if self.rank != 0:
            for t in self.tensors:
                t.zero_()

    def ours(self) -> list[float]:
        names = [s.name for s in self.specs]
        dst = dict(zip(names, self.tensors))

        def send() -> None:
            self.engine.send_weights(self.manifest, zip(names, self.tensors), stable=True)

        def receive() -> None:
            for bucket in self.engine.receive_buckets(self.manifest, dst if self.args.in_place else None):
                if bucket:
                    batched_copy_([dst[n] for n, _ in bucket], [t for _, t in bucket])

        times = []
        for _ in range(self.args.iters):
            self._zero_receivers()
            times.append(self._timed(send if self.rank == 0 else receive))
            self._progress()
        if self.args.profile:
            self._profile(send if self.rank == 0 else receive)
        return times

    def _profile(self, fn: Any) -> None:
        """One more sync under torch.profiler: a Chrome trace per rank shows where the link idles."""
        self._zero_receivers()
        traced(lambda: self._timed(fn), self.device, self.args.profile, self.rank)

    def run(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rank": self.rank, "device": str(self.device), "bytes": self.total_bytes, "tensors": len(self.specs)}
        modes = self.args.modes.split(",")
        runs = {"raw": self.raw, "bucketed": self.bucketed, "naive": self.naive, "ours": self.ours}
        meter = PeakMeter(self.device)
        out["held_mem"] = self._mem() - self.mem_state  # what joining the group allocated (the engine's buffers)
        out["extra_mem"] = {}
        for mode in (m for m in runs if m in modes):
            meter.begin()
            out[f"{mode}_s"] = runs[mode]()
            out["extra_mem"][mode] = meter.extra()
            if mode in ("naive", "ours"):
                out[f"{mode}_checksum"] = weights_checksum(self.tensors)
        if "ours_s" in out:
            ours = out["extra_mem"]["ours"]
            out["ours_extra_mem"] = None if ours is None else out["held_mem"] + ours  # buffers included, as before
            out["buffer_bytes"] = self.engine.num_buffers * self.engine.bucket_size_bytes
            out["buckets"] = self.manifest.num_buckets
            out["solo_bytes"] = self.engine.solo_bytes
        out["expected_checksum"] = weights_checksum(self.tensors) if self.rank == 0 else None
        self.engine.finalize()
        return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="one rank of ckpt-engine bench (started by the driver)")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--token", required=True)
    p.add_argument("--backend", required=True)
    p.add_argument("--device", choices=("cpu", "cuda"), required=True)
    p.add_argument("--preset", required=True)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--bucket-mb", type=float, required=True)
    p.add_argument("--buffers", type=int, default=2)
    p.add_argument("--in-place", action="store_true")
    p.add_argument("--solo-mb", type=float, default=None)
    p.add_argument("--engine-kwargs", default="{}")
    p.add_argument("--profile", default=None)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--modes", default="raw,naive,ours")
    p.add_argument("--timeout-s", type=float, default=600.0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    rank = BenchRank(args)
    result = rank.run()
    rank.store.set(f"result/{args.rank}", json.dumps(result))


if __name__ == "__main__":
    main()
