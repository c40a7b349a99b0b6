"""One rank of `ckpt-engine bench --delta` / `--senders N`: real consecutive versions, many senders.

Senders send versions of the preset's tensors as an RL trainer's bf16 export would: fp32 masters
stepped by torch's AdamW (noisy gradients, the learning rate given), cast to the wire dtype per
version. Every version is generated before the first sync, chunk by chunk (`versions.py`: bounded
fp32 state, so 1-layer 7B shapes fit a small CPU host), and loaded into the sender's tensors
between syncs, outside the timed part; with `--senders N` each sends its dim-0 row block
(replicated tensors are split by the planner). Receivers copy every tensor into their own destinations, as a loader would.
Measured over the same groups in one run: raw broadcast of all bytes from one sender, the same
bytes split over the senders at once (the multi-sender bound), the dense sync, and (with
`--delta`) a seed plus patch syncs with their wire bytes, changed fraction and encode / apply
seconds. Results (JSON) go to the rendezvous store for the driver.

With `--wire-dtype fp8` the senders' versions go through the library's FP8 wire
(`sources/fp8.py`, quantized inside every timed sync, as a trainer's are) and the receivers hold
the block-FP8 checkpoint layout (`fp8_specs`); the bit-exactness check is against the reference
quantization of the senders' version, and sender 0 also counts, outside the timed part, how many
FP8 codes, scales and unquantized bf16 words each version changed.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from typing import Any

import torch

from ckpt_engine.sources.wire import torch_dtype
from ckpt_engine.benchmark.presets import checkpoint_specs, load_preset_config
from ckpt_engine.benchmark.raw_link import broadcast_bytes, raw_message_bytes
from ckpt_engine.benchmark.tracing import traced
from ckpt_engine.benchmark.versions import AdamWChain, FileVersions, MemoryVersions, host_available_bytes
from ckpt_engine.benchmark.worker import pipelined, weights_checksum
from ckpt_engine.copies import batched_copy_
from ckpt_engine.delta.request import DeltaRequest
from ckpt_engine.engine import Rendezvous
from ckpt_engine.fp8 import fp8_specs, quantizes
from ckpt_engine.registry import CheckpointEngineRegistry
from ckpt_engine.sources.base import StateDictSource
from ckpt_engine.sources.fp8 import Fp8WireSource, ShardedFp8WireSource, fp8_wire
from ckpt_engine.benchmark.sharded_source import ShardedStateDictSource
from ckpt_engine.sources.sharded import ShardedWeightSource, iter_pieces

logger = logging.getLogger(__name__)


class ChainRank:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rank, self.world = args.rank, args.world_size
        self.senders = args.senders
        self.is_sender = self.rank < self.senders
        if args.device == "cuda":
            self.device = torch.device("cuda", self.rank % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        self.specs = checkpoint_specs(load_preset_config(args.preset), dtype=args.dtype, num_layers=args.layers)
        self.fp8 = args.wire_dtype == "fp8"
        # What travels and what receivers hold: the trainer's layout, or the block-FP8 checkpoint's
        self.wire_specs = fp8_specs(self.specs) if self.fp8 else self.specs
        self.rdzv = Rendezvous(args.host, args.port, args.token, self.world, args.backend, args.timeout_s, self.senders)
        self.store = self.rdzv.connect_store()
        self._barriers = 0
        self.engine = pipelined(CheckpointEngineRegistry.new(
            args.backend, bucket_size_bytes=int(args.bucket_mb * (1 << 20)) // 4096 * 4096, num_buffers=args.buffers,
            timeout_s=args.timeout_s, device=self.device, **json.loads(args.engine_kwargs),
        ))
        held = self.specs if self.is_sender else self.wire_specs  # senders hold the trainer's versions
        self.names = [s.name for s in held]
        self.tensors = [torch.empty(s.shape, dtype=torch_dtype(s.dtype), device=self.device) for s in held]
        self.version_bytes = sum(s.nbytes for s in self.specs)
        self.total_bytes = sum(s.nbytes for s in self.wire_specs)
        self.versions: MemoryVersions | FileVersions | None = None
        self.generate_s = 0.0
        self.fp8_prev: dict[str, torch.Tensor] | None = None
        if self.is_sender:
            self._generate_versions()
            source = ShardedStateDictSource(dict(zip(self.names, self.tensors)), self.rank, self.senders)
            wired = fp8_wire(source, "fp8" if self.fp8 else None)
            assert isinstance(wired, ShardedWeightSource)
            self.source = wired
            self.store.set(f"versions_ready/{self.rank}", "1")
        else:
            for t in self.tensors:
                t.zero_()
        self._wait_for_versions()
        self._sync()
        self.engine.init_process_group(self.rdzv, self.rank)
        # Every rank plans with the same pure function of the specs and the ownership.
        self.manifest = self.engine.plan(self.wire_specs, num_senders=self.senders, owners=self._owners())

    def _generate_versions(self) -> None:
        """Every version this run sends (1 without --delta), generated chunk by chunk before any
        sync; kept in memory when they fit beside the sync's copies, else in temporary files."""
        args = self.args
        count = 1 + args.versions if args.delta else 1
        chain = AdamWChain(
            lr=args.lr, grad_scale=args.grad_scale, warmup_steps=args.warmup_steps if args.delta else 0,
            chunk_bytes=int(args.chunk_mb * (1 << 20)),
        )
        need = count * self.version_bytes
        room = self._room_for_versions()
        t0 = time.perf_counter()
        if count == 1:
            self.versions = MemoryVersions(self.specs, 1, self.device, targets=[self.tensors])
        elif room is not None and need <= room:
            self.versions = MemoryVersions(self.specs, count, self.device)
        else:
            self.versions = FileVersions(self.specs, chain)
        chain.generate(self.specs, count, self.device, self.versions.sink)
        self.versions.load(1, self.tensors)
        self._sync()
        self.generate_s = time.perf_counter() - t0
        logger.info(
            "rank %s: %s versions (%.2f GB) generated in %.1fs, kept %s", self.rank, count, need / 1e9, self.generate_s,
            "in memory" if isinstance(self.versions, MemoryVersions) else "in files",
        )

    def _room_for_versions(self) -> int | None:
        """Bytes the versions may take on this rank's device: what is free now, less what the
        sync will still allocate (base copies, buffers; on a host every rank's) and one chunk."""
        args = self.args
        per_rank = max(self.total_bytes, self.version_bytes) * (2 if args.delta else 1) + args.buffers * int(args.bucket_mb * (1 << 20))
        slack = int(args.chunk_mb * (1 << 20)) + (2 << 30)
        if self.device.type == "cuda":
            return torch.cuda.mem_get_info(self.device)[0] - per_rank - slack
        free = host_available_bytes()
        # Other senders on this host keep their own versions; receivers still allocate theirs.
        return None if free is None else (free - self.world * (per_rank + self.version_bytes) - slack) // self.senders

    def _wait_for_versions(self) -> None:
        """Every rank waits until every sender has its versions (generation can take minutes on a
        CPU); bounded by --timeout-s per version."""
        deadline = time.monotonic() + self.args.timeout_s * (2 + self.args.versions)
        for r in range(self.senders):
            while not self.store.check([f"versions_ready/{r}"]):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank {self.rank}: sender {r} did not generate its versions in time")
                time.sleep(0.05)

    def _owners(self) -> Any:
        """Every sender's dim-0 row block of every matrix, in the wire's layout (with FP8, the
        shards of the FP8 bytes and of their scales, as the FP8 wire source declares them)."""
        shapes = ShardedStateDictSource({s.name: torch.empty(s.shape, dtype=torch_dtype(s.dtype), device="meta") for s in self.specs}, 0, self.senders)
        return (ShardedFp8WireSource(shapes) if self.fp8 else shapes).owners()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _barrier(self) -> None:
        """Every rank of every group, through the store (no single group holds all senders). Polled
        every 50 us, as the dense bench's store barrier is: a timed sync starts and ends at barriers,
        and a 1 ms poll could add up to ~1 ms at each end to a rank's time (raw's and the syncs'
        alike, a larger share of a short patch sync)."""
        self._sync()
        self._barriers += 1
        key = f"barrier/{self._barriers}"
        self.store.add(key, 1)
        deadline = time.monotonic() + self.args.timeout_s
        while self.store.add(key, 0) < self.world:
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {self.rank}: barrier {self._barriers} timed out")
            time.sleep(5e-5)

    def _timed(self, fn: Any) -> float:
        self._barrier()
        t0 = time.perf_counter()
        fn()
        self._sync()
        self._barrier()
        return time.perf_counter() - t0

    def raw(self) -> list[float]:
        """All bytes from sender 0 (other senders wait), as `ckpt-engine bench`'s raw: broadcasts
        of at most 1 GiB from two rotating buffers, never one model-sized buffer."""
        group = self.engine.transport.groups.get(0)
        message = raw_message_bytes(self.total_bytes, self.engine.bucket_size_bytes)
        run = broadcast_bytes(group, self.total_bytes, message, self.device, self.args.timeout_s) if group is not None else (lambda: None)
        return [self._timed(run) for _ in range(self.args.iters)]

    def raw_split(self) -> list[float]:
        """The same bytes split evenly over the senders, every sender broadcasting at once (each
        share in raw's messages)."""
        share = -(-self.total_bytes // self.senders)
        gids = [self.rank] if self.is_sender else list(range(self.senders))
        message = raw_message_bytes(share, self.engine.bucket_size_bytes)
        run = broadcast_bytes([self.engine.transport.groups[gid] for gid in gids], share, message, self.device, self.args.timeout_s)
        return [self._timed(run) for _ in range(self.args.iters)]

    def sync_once(self, delta: DeltaRequest | None) -> None:
        if self.is_sender:
            walk = iter_pieces(self.source, self.manifest)
            self.last_stats = self.engine.send_weights(self.manifest, walk, stable=self.source.stable_pieces, delta=delta)
        else:
            dst = dict(zip(self.names, self.tensors))
            for bucket in self.engine.receive_buckets(self.manifest, dst if self.args.in_place else None, delta=delta):
                # In place the engine yields the destinations themselves: skip them by identity
                # (batched_copy_'s per-pair checks cost ~8 ms a sync at 3,900 tensors)
                pairs = [(dst[n], t) for n, t in bucket if t is not dst[n]]
                if pairs:
                    batched_copy_([d for d, _ in pairs], [t for _, t in pairs])

    def _quantized(self) -> dict[str, torch.Tensor]:
        """This sender's version as receivers must hold it: the reference quantization of every
        weight the FP8 wire quantizes (the whole tensors, not the shards), the rest as it is."""
        return dict(Fp8WireSource(StateDictSource(dict(zip(self.names, self.tensors)))).iter_weights())

    def _expected(self) -> list[torch.Tensor]:
        if not self.fp8:
            return self.tensors
        q = self._quantized()
        return [q[s.name] for s in self.wire_specs]

    def _fp8_changes(self) -> dict[str, float] | None:
        """Of the version just loaded against the one before (untimed, sender 0): the fraction of
        FP8 codes and of scales (one per 128 x 128 block) that changed, compared as bits. Only the
        quantized tensors are kept between versions (the unquantized ones change as on a bf16
        wire). None for the first version (the seed's), which only records it."""
        quantized = {s.name for s in self.specs if quantizes(s)}
        cur = {n: t for n, t in self._quantized().items() if n in quantized or n.removesuffix("_scale_inv") in quantized}
        prev, self.fp8_prev = self.fp8_prev, cur
        if prev is None:
            return None
        counts = {"codes": [0, 0], "scales": [0, 0]}
        for name, b in cur.items():
            word = torch.uint8 if name in quantized else torch.int32
            counts["codes" if name in quantized else "scales"][0] += int(prev[name].view(word).ne(b.view(word)).sum())
            counts["codes" if name in quantized else "scales"][1] += b.numel()
        return {k: c / n if n else 0.0 for k, (c, n) in counts.items()}

    def run(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rank": self.rank, "device": str(self.device), "bytes": self.total_bytes, "senders": self.senders}
        out["raw_s"] = self.raw()
        if self.senders > 1:
            out["raw_split_s"] = self.raw_split()
        out["dense_s"] = [self._timed(lambda: self.sync_once(None)) for _ in range(self.args.iters)]
        if self.args.delta:
            if self.fp8 and self.rank == 0:
                self._fp8_changes()  # version 1, the seed's: the base of the first count
            seed = DeltaRequest(False, None, 1)
            out["seed_s"] = self._timed(lambda: self.sync_once(seed))
            base, versions = 1, []
            for v in range(2, 2 + self.args.versions):
                if self.versions is not None:
                    self.versions.load(v, self.tensors)
                    self._sync()
                fp8_changes = self._fp8_changes() if self.fp8 and self.rank == 0 else None
                request = DeltaRequest(True, base, v)
                if self.args.profile and v == 1 + self.args.versions:  # the last patch sync, traced
                    seconds = traced(lambda: self._timed(lambda: self.sync_once(request)), self.device, self.args.profile, self.rank)
                else:
                    seconds = self._timed(lambda: self.sync_once(request))
                stats: dict[str, Any] = dict(self.last_stats.extra) if self.is_sender else dict(self.engine.last_delta_stats)
                stats["seconds"] = seconds
                if fp8_changes is not None:
                    stats["fp8_changes"] = fp8_changes
                versions.append(stats)
                base = v
            out["delta"] = versions
            out["base_bytes"] = self.engine.delta_base_bytes
        out["checksum"] = weights_checksum(self._expected() if self.is_sender else self.tensors)
        out["generate_s"] = self.generate_s
        if self.versions is not None:
            out["versions_kept"] = "memory" if isinstance(self.versions, MemoryVersions) else "files"
            self.versions.close()
        self.engine.finalize()
        return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="one rank of ckpt-engine bench --delta/--senders (started by the driver)")
    for flag, typ in (("--rank", int), ("--world-size", int), ("--port", int), ("--senders", int)):
        p.add_argument(flag, type=typ, required=True)
    for flag in ("--host", "--token", "--backend", "--preset"):
        p.add_argument(flag, required=True)
    p.add_argument("--device", choices=("cpu", "cuda"), required=True)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--wire-dtype", choices=("fp8",), default=None, help="versions sent through the block-FP8 wire; receivers hold its layout")
    p.add_argument("--bucket-mb", type=float, required=True)
    p.add_argument("--buffers", type=int, default=2)
    p.add_argument("--engine-kwargs", default="{}")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--delta", action="store_true")
    p.add_argument("--in-place", action="store_true", help="receivers offer their tensors: patches land there (no base copy)")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--grad-scale", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--versions", type=int, default=3)
    p.add_argument("--chunk-mb", type=float, default=1024.0, help="fp32 state (master, grad, moments) alive at once while generating")
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--profile", default=None, help="trace the last patch sync with torch.profiler into this directory")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    rank = ChainRank(args)
    result = rank.run()
    rank.store.set(f"result/{args.rank}", json.dumps(result))


if __name__ == "__main__":
    main()
