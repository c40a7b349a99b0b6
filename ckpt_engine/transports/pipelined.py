"""The pipelined, bucketed broadcast core shared by gloo, nccl and hccl.

Sender: bucket k is packed into rotating buffer k % num_buffers while earlier buckets are in
flight. Receiver: bucket k+num_buffers is posted as soon as the loader has consumed bucket k, so
the network and the loader's copies overlap. On accelerators ordering is kept with streams and
events (never a device-wide synchronize); on CPU with asynchronous gloo work handles. A backend
subclass only says how its device, streams and process group are made.

Several senders: ranks [0, S) each own a process group with every receiver (per lane), stream
their own buckets through their own buffers concurrently, and receivers hold `num_buffers`
buffers per sender. The send loop lives in `pipelined_send.py`, the receive loop in
`pipelined_receive.py`, delta framing in `pipelined_delta.py`; this file holds the lifecycle and
what they share.
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from typing import Any

import torch

from ckpt_engine.transports.pipelined_delta import DeltaTransferMixin
from ckpt_engine.transports.piece_reader import Known
from ckpt_engine.transports.pipelined_delta_receive import DeltaReceiveMixin
from ckpt_engine.transports.pipelined_receive import ReceiveLoopMixin
from ckpt_engine.transports.pipelined_send import SendLoopMixin
from ckpt_engine.transports.schedule import Schedule
from ckpt_engine.transports.wire_views import SLACK, align8, torch_dtype
from ckpt_engine.checksum import CHECKSUM_BYTES
from ckpt_engine.transports.base import CheckpointEngine, Rendezvous, TransferError
from ckpt_engine.manifest import Bucket, BucketManifest, TensorMeta

__all__ = ["PipelinedBroadcastEngine", "torch_dtype"]

logger = logging.getLogger(__name__)

_SLACK = SLACK  # kept for backends that size shared buffers alike (colocated)


class PipelinedBroadcastEngine(SendLoopMixin, ReceiveLoopMixin, DeltaTransferMixin, DeltaReceiveMixin, CheckpointEngine):
    """Senders broadcast their buckets to every receiver over one process group each."""

    supports_many_senders = True
    supports_delta = True
    device_type = "cpu"
    default_solo_bytes = 0
    """Tensors of at least this size get a bucket of their own (0: never); see `plan_buckets`."""
    default_group_max_tensors = 0
    """A bucket of at most this many tensors travels as one coalesced group of per-tensor
    broadcasts (0: never): no packing on a stable sender, no unpacking on a receiver that offers
    destinations. Both sides derive the choice from the manifest, so they must agree on it."""
    default_num_lanes = 1
    """Buckets alternate over this many process groups (each with its own stream), so one bucket's
    collective starts while the previous one drains; both sides must use the same number."""

    def __init__(
        self,
        *,
        bucket_size_bytes: int,
        num_buffers: int = 2,
        timeout_s: float = 300.0,
        verify: bool = False,
        device: str | int | torch.device | None = None,
        num_lanes: int | None = None,
        solo_bytes: int | None = None,
        group_max_tensors: int | None = None,
        delta_base: str = "device",
        delta_scatter_below: float | None = None,
    ) -> None:
        super().__init__(bucket_size_bytes=bucket_size_bytes, num_buffers=num_buffers, timeout_s=timeout_s, verify=verify)
        solo = solo_bytes if solo_bytes is not None else self.default_solo_bytes
        if not isinstance(solo, int) or isinstance(solo, bool) or solo < 0:
            raise ValueError(f"solo_bytes must be an int >= 0 (0: never), got {solo_bytes!r}")
        self.solo_bytes = solo or None
        group = group_max_tensors if group_max_tensors is not None else self.default_group_max_tensors
        if not isinstance(group, int) or isinstance(group, bool) or group < 0:
            raise ValueError(f"group_max_tensors must be an int >= 0 (0: never), got {group_max_tensors!r}")
        self.group_max_tensors = group
        self.device = self._resolve_device(device)
        lanes = num_lanes if num_lanes is not None else self.default_num_lanes
        if not isinstance(lanes, int) or lanes < 1:
            raise ValueError(f"num_lanes must be an int >= 1, got {num_lanes!r}")
        self.num_lanes = lanes
        self.num_senders = 1
        self._buffers: list[torch.Tensor] = []
        self._group: Any = None  # lane 0's group of this rank's first sender
        self._groups: dict[int, Any] = {}  # gid = sender * num_lanes + lane
        self._streams: dict[int, Any] = {}
        self._comm_stream: Any = None
        self._ready: list[Any] = []
        self._free: list[Any] = []
        self._views: dict[str, list[list[torch.Tensor]]] = {}
        self._schedules: dict[str, Schedule] = {}
        self._assembly: dict[str, torch.Tensor] = {}  # reassembly tensors of chunked tensors
        self._assembly_digest: str | None = None
        self._broken = False
        self._known: tuple[str, Known] | None = None  # (plan digest, what its sources yielded last)
        self._init_delta(delta_base, delta_scatter_below)

    # --- what a backend file provides -------------------------------------------------------
    def _resolve_device(self, device: str | int | torch.device | None) -> torch.device:
        return torch.device("cpu")

    def _make_group(self, store: torch.distributed.Store, rank: int, world_size: int) -> Any:
        raise NotImplementedError

    def _new_stream(self) -> Any:
        return None

    def _new_event(self) -> Any:
        return None

    def _current_stream(self) -> Any:
        return None

    def _stream_ctx(self, stream: Any) -> Any:
        return nullcontext()

    # --- lifecycle ---------------------------------------------------------------------------
    def prepare(self) -> dict[str, Any]:
        if not self._buffers:
            self._alloc_buffers(self.num_buffers)
        return {
            "device": str(self.device),
            "buffer_bytes": sum(b.numel() for b in self._buffers),
            "num_buffers": len(self._buffers),
        }

    def _alloc_buffers(self, count: int) -> None:
        while len(self._buffers) < count:
            self._buffers.append(torch.empty(self.bucket_size_bytes + SLACK, dtype=torch.uint8, device=self.device))
            self._ready.append(self._new_event())
            self._free.append(self._new_event())

    @property
    def is_sender(self) -> bool:
        return self.rank is not None and self.rank < self.num_senders

    def init_process_group(self, rendezvous: Rendezvous, rank: int) -> None:
        """Join the weight-sync group. Sender s builds its own groups (one per lane) with every
        receiver; receivers build every sender's groups, in sender order, so nobody waits on a
        group whose members are still busy building another."""
        if self._group is not None:
            raise RuntimeError("init_process_group() was already called; call finalize() first to rejoin")
        senders = rendezvous.num_senders
        if not 1 <= senders < rendezvous.world_size:
            raise ValueError(f"num_senders must be in [1, world_size), got {senders}")
        self.num_senders = senders
        self.rank, self.world_size = rank, rendezvous.world_size
        self.prepare()
        if not self.is_sender:
            self._alloc_buffers(self.num_buffers * senders)  # one set of rotating buffers per sender
        store = rendezvous.connect_store(is_master=False)
        self._join_groups(store, [rank] if self.is_sender else list(range(senders)))
        logger.info("rank %d/%d joined weight-sync group %s (%d senders)", rank, rendezvous.world_size, rendezvous.token, senders)

    def _join_groups(self, store: torch.distributed.Store, own: list[int]) -> None:
        """Build the process groups (one per lane) of senders `own` with every receiver, and
        their streams; `_group` / `_comm_stream` are the first of them (None without any). A tiny
        broadcast creates each communicator now, so join errors surface at join time."""
        senders = self.num_senders
        assert self.rank is not None and self.world_size is not None
        group_rank = 0 if self.is_sender else self.rank - senders + 1
        self._groups, self._streams = {}, {}
        for sender in own:
            for lane in range(self.num_lanes):
                prefix = f"lane{lane}/" if sender == 0 else f"sender{sender}/lane{lane}/"
                gid = sender * self.num_lanes + lane
                self._groups[gid] = self._make_group(torch.distributed.PrefixStore(prefix, store), group_rank, self.world_size - senders + 1)
                self._streams[gid] = self._new_stream()
        self._group = self._groups[min(self._groups)] if self._groups else None
        self._comm_stream = self._streams[min(self._streams)] if self._streams else None
        self._broken = False
        for gid, group in sorted(self._groups.items()):
            probe = torch.zeros(1, dtype=torch.int64, device=self.device)
            self._wait_work(group.broadcast(probe, 0), f"warm-up of group {gid}")

    def _device_sync_point(self) -> None:
        """The host waits until this rank's work so far on the current stream is done (one event;
        a no-op on a CPU device): before handing a buffer over to, or back from, another process."""
        if self.device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            self._wait_event(ev, "local copies")

    def finalize(self) -> None:
        groups, self._groups, self._group = self._groups, {}, None
        for group in groups.values():
            try:
                if self._broken and hasattr(group, "abort"):
                    group.abort()
                elif hasattr(group, "shutdown"):
                    group.shutdown()
            except Exception as exc:  # tearing down a broken group may itself fail
                logger.warning("process group teardown: %s", exc)
        self._buffers, self._ready, self._free = [], [], []
        self._views, self._schedules, self._assembly, self._assembly_digest = {}, {}, {}, None
        self._send_plan = self._recv_plan = self._cast_walk = None  # they hold buffer views and the trainer's tensors
        self._reset_delta()

    def abort(self) -> None:
        """Break the group so peers blocked in a collective fail fast instead of timing out."""
        self._broken = True
        self._invalidate_delta()
        for group in self._groups.values():
            if hasattr(group, "abort"):
                try:
                    group.abort()
                except Exception as exc:
                    logger.warning("process group abort: %s", exc)

    @property
    def group(self) -> Any:
        """The underlying process group (for benchmarks measuring the raw link on the same group)."""
        self._require_group()
        return self._group

    # --- shared helpers ----------------------------------------------------------------------
    def _require_group(self) -> None:
        if self._group is None:
            raise RuntimeError("call init_process_group() before sending or receiving")
        if self._broken:
            raise RuntimeError("the weight-sync group is broken by an earlier failure; finalize() and rejoin")

    def _schedule(self, manifest: BucketManifest) -> Schedule:
        sched = self._schedules.get(manifest.digest)
        if sched is None:
            if manifest.num_senders != self.num_senders:
                raise ValueError(
                    f"the manifest plans {manifest.num_senders} senders but this group has {self.num_senders}"
                )
            sched = Schedule(manifest, self.num_buffers, self.num_lanes)
            self._schedules = {manifest.digest: sched}
        return sched

    def _bucket_views(self, manifest: BucketManifest) -> list[list[torch.Tensor]]:
        """Views of the rotating buffers, one per chunk; cached per manifest digest."""
        views = self._views.get(manifest.digest)
        if views is None:
            if manifest.bucket_size_bytes > self.bucket_size_bytes:
                raise ValueError(
                    f"manifest buckets are {manifest.bucket_size_bytes} bytes, larger than this engine's "
                    f"{self.bucket_size_bytes}-byte buffers"
                )
            sched = self._schedule(manifest)
            views = []
            for step in sched.steps:
                slot = step.sender_slot if self.is_sender else step.slot
                buf = self._buffers[slot] if slot < len(self._buffers) else None
                views.append([self._entry_view(buf, e) for e in step.bucket.entries] if buf is not None else [])
            self._views = {manifest.digest: views}  # keep one plan's views: a new plan drops the old
        return views

    @staticmethod
    def _entry_view(buf: torch.Tensor, e: TensorMeta) -> torch.Tensor:
        raw = buf[e.bucket_offset : e.bucket_offset + e.chunk_size]
        if e.is_whole:
            return raw.view(torch_dtype(e.dtype)).view(e.shape)
        return raw

    def _message(self, slot: int, nbytes: int) -> torch.Tensor:
        """What travels for a bucket: its bytes, plus (with verify) padding and the checksum."""
        return self._buffers[slot][: align8(nbytes) + CHECKSUM_BYTES if self.verify else nbytes]

    def _fresh(self, gid: int, size: int, dtype: torch.dtype = torch.uint8, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """A receive buffer from group `gid`'s stream's memory pool (its earlier users were on that
        stream, so it may be written there at once), also recorded for the compute stream, which
        reads it after it lands (the allocator then waits for those reads before reusing it)."""
        if self._comm_stream is None:
            return torch.empty(shape if shape is not None else (size,), dtype=dtype, device=self.device)
        compute = self._current_stream()
        with self._stream_ctx(self._streams[gid]):
            t = torch.empty(shape if shape is not None else (size,), dtype=dtype, device=self.device)
        t.record_stream(compute)
        return t

    def _wait_work(self, work: Any, what: str) -> None:
        try:
            if self.device.type == "cpu":
                work.wait(_timedelta(self.timeout_s))
            else:
                work.wait()
        except Exception as exc:
            self._broken = True
            raise TransferError(f"rank {self.rank}: {what} failed: {exc}") from exc

    def _wait_event(self, event: Any, what: str) -> None:
        """Host wait on one event with a deadline (accelerators only; no device-wide sync)."""
        deadline = time.monotonic() + self.timeout_s
        while not event.query():
            if time.monotonic() > deadline:
                self._broken = True
                raise TransferError(f"rank {self.rank}: {what} did not finish within {self.timeout_s}s")
            time.sleep(2e-5)  # the sync's end is detected within ~0.1 ms; the thread stays idle

    def _is_direct(self, bucket: Bucket) -> bool:
        """A bucket holding one chunk of a tensor larger than a bucket lands straight in the
        receiver's reassembly tensor (no copy out of a buffer); a sender with stable sources also
        sends it from the tensor's own memory. Either side may pack instead: the bytes match."""
        return len(bucket.entries) == 1 and not bucket.entries[0].is_whole and not self.verify

    def _is_direct_whole(self, bucket: Bucket) -> bool:
        """A bucket holding one whole tensor may land straight in the loader's destination."""
        return len(bucket.entries) == 1 and bucket.entries[0].is_whole and bucket.nbytes > 0 and not self.verify

    def _is_grouped(self, bucket: Bucket) -> bool:
        """Whether a bucket travels as a coalesced group of per-tensor messages (a pure function of
        the manifest and the shared engine options, so every rank decides alike)."""
        n = len(bucket.entries)
        return 1 < n <= self.group_max_tensors and bucket.nbytes > 0 and not self.verify

    def _known_sources(self, manifest: BucketManifest, stable: bool) -> Known | None:
        """What this sender's source yielded at its last sync of this plan (PieceReader skips
        re-checking the same tensors); None for a source whose tensors do not stay valid."""
        if not stable:
            return None
        if self._known is None or self._known[0] != manifest.digest:
            self._known = (manifest.digest, {})
        return self._known[1]

    def _broadcast_on(self, gid: int, slot: int | None, msg: torch.Tensor, *, after_producer: bool = True) -> Any:
        """One broadcast from the group's sender (group rank 0), ordered after the current stream's
        work and, on receivers, after the slot's previous loader copies. `after_producer=False`:
        a receiver's message allocated on the group's own stream (`_fresh`), which no other
        stream has touched, lands without waiting for the compute stream (the patches being
        applied there)."""
        group = self._groups[gid]
        if self._comm_stream is None:
            return group.broadcast(msg, 0)
        stream = self._streams[gid]
        producer = self._current_stream()  # read before the context makes `stream` the current one
        if slot is not None and self.is_sender:
            self._ready[slot].record(producer)
        with self._stream_ctx(stream):
            if slot is not None:
                stream.wait_event(self._ready[slot] if self.is_sender else self._free[slot])
            elif after_producer:
                stream.wait_stream(producer)
            work = group.broadcast(msg, 0)
            work.wait()
            if slot is not None:
                (self._free[slot] if self.is_sender else self._ready[slot]).record(stream)
        return work


def _timedelta(seconds: float) -> Any:
    import datetime

    return datetime.timedelta(seconds=seconds)
