"""The pipelined, bucketed broadcast core shared by gloo, nccl and hccl.

Sender: bucket k is packed into rotating buffer k % num_buffers while earlier buckets are in
flight. Receiver: bucket k+num_buffers is posted as soon as the loader has consumed bucket k, so
the network and the loader's copies overlap. On accelerators ordering is kept with streams and
events (never a device-wide synchronize); on CPU with asynchronous gloo work handles. A backend
subclass only says how its device, streams and process group are made.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import nullcontext
from typing import Any

import torch

from ckpt_engine.checksum import CHECKSUM_BYTES, bucket_checksum
from ckpt_engine.copies import batched_copy_
from ckpt_engine.engine import CheckpointEngine, Rendezvous, SendStats, TransferError
from ckpt_engine.manifest import Bucket, BucketManifest, TensorMeta

__all__ = ["PipelinedBroadcastEngine", "torch_dtype"]

logger = logging.getLogger(__name__)

_SLACK = 64  # room after a bucket's data for the 8-byte-aligned checksum


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"this torch build has no dtype {name!r}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _align8(n: int) -> int:
    return (n + 7) // 8 * 8


class PipelinedBroadcastEngine(CheckpointEngine):
    """Rank 0 broadcasts every bucket to all other ranks of one process group."""

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
        self._buffers: list[torch.Tensor] = []
        self._group: Any = None  # lane 0's group
        self._lane_groups: list[Any] = []
        self._lane_streams: list[Any] = []
        self._views: dict[str, list[list[torch.Tensor]]] = {}
        self._assembly: dict[str, torch.Tensor] = {}  # reassembly tensors of chunked tensors
        self._assembly_digest: str | None = None
        self._broken = False

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
            self._buffers = [
                torch.empty(self.bucket_size_bytes + _SLACK, dtype=torch.uint8, device=self.device)
                for _ in range(self.num_buffers)
            ]
            self._lane_streams = [self._new_stream() for _ in range(self.num_lanes)]
            self._comm_stream = self._lane_streams[0]
            self._ready = [self._new_event() for _ in range(self.num_buffers)]
            self._free = [self._new_event() for _ in range(self.num_buffers)]
        return {
            "device": str(self.device),
            "buffer_bytes": sum(b.numel() for b in self._buffers),
            "num_buffers": self.num_buffers,
        }

    def init_process_group(self, rendezvous: Rendezvous, rank: int) -> None:
        if self._group is not None:
            raise RuntimeError("init_process_group() was already called; call finalize() first to rejoin")
        self.prepare()
        store = rendezvous.connect_store(is_master=False)
        self.rank, self.world_size = rank, rendezvous.world_size
        self._lane_groups = [
            self._make_group(torch.distributed.PrefixStore(f"lane{i}/", store), rank, rendezvous.world_size)
            for i in range(self.num_lanes)
        ]
        self._group = self._lane_groups[0]
        self._broken = False
        # A tiny broadcast creates each communicator now, so join errors surface at join time.
        for i, group in enumerate(self._lane_groups):
            probe = torch.zeros(1, dtype=torch.int64, device=self.device)
            self._wait_work(group.broadcast(probe, 0), f"warm-up of lane {i}")
        logger.info("rank %d/%d joined weight-sync group %s", rank, rendezvous.world_size, rendezvous.token)

    def finalize(self) -> None:
        groups, self._lane_groups, self._group = self._lane_groups, [], None
        for group in groups:
            try:
                if self._broken and hasattr(group, "abort"):
                    group.abort()
                elif hasattr(group, "shutdown"):
                    group.shutdown()
            except Exception as exc:  # tearing down a broken group may itself fail
                logger.warning("process group teardown: %s", exc)
        self._buffers, self._views, self._assembly, self._assembly_digest = [], {}, {}, None

    def abort(self) -> None:
        """Break the group so peers blocked in a collective fail fast instead of timing out."""
        self._broken = True
        for group in self._lane_groups:
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

    def _bucket_views(self, manifest: BucketManifest) -> list[list[torch.Tensor]]:
        """Views of the rotating buffers, one per chunk; cached per manifest digest."""
        views = self._views.get(manifest.digest)
        if views is None:
            if manifest.bucket_size_bytes > self.bucket_size_bytes:
                raise ValueError(
                    f"manifest buckets are {manifest.bucket_size_bytes} bytes, larger than this engine's "
                    f"{self.bucket_size_bytes}-byte buffers"
                )
            views = []
            for bucket in manifest.buckets:
                buf = self._buffers[bucket.index % self.num_buffers]
                views.append([self._entry_view(buf, e) for e in bucket.entries])
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
        return self._buffers[slot][: _align8(nbytes) + CHECKSUM_BYTES if self.verify else nbytes]

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

    # --- sender ------------------------------------------------------------------------------
    def send_weights(
        self, manifest: BucketManifest, weights: Iterable[tuple[str, torch.Tensor]], *, stable: bool = False
    ) -> SendStats:
        """See CheckpointEngine.send_weights. With `stable`, a bucket holding a single tensor (or a
        single chunk of one) travels straight from the tensor's memory instead of being packed."""
        self._require_group()
        if self.rank != 0:
            raise RuntimeError(f"send_weights() runs on rank 0 only, this is rank {self.rank}")
        t_start = time.perf_counter()
        stats = SendStats(bytes=manifest.total_bytes, tensors=manifest.num_tensors, buckets=manifest.num_buckets)
        views = self._bucket_views(manifest)
        it = iter(weights)
        works: list[Any] = [None] * self.num_buffers
        current: torch.Tensor | None = None
        flat: torch.Tensor | None = None
        flat_is_source = False  # `flat` aliases the caller's tensor (no conversion temporary)
        try:
            for bucket, dsts in zip(manifest.buckets, views):
                slot = bucket.index % self.num_buffers
                self._sender_slot_free(slot, works)
                srcs: list[torch.Tensor] = []
                borrowed: list[bool] = []  # src is the caller's memory in the wire layout
                copied = False  # without `stable`, each tensor is packed before the next is requested
                for e, dst in zip(bucket.entries, dsts):
                    if e.chunk_offset == 0:
                        t0 = time.perf_counter()
                        current = _next_weight(it, e)
                        stats.export_s += time.perf_counter() - t0
                        flat = None
                    assert current is not None
                    if e.is_whole:
                        src = current
                        borrowed.append(stable and _has_wire_layout(src, e, self.device))
                    else:
                        if flat is None:
                            converted = current.to(device=self.device, dtype=torch_dtype(e.dtype)).contiguous()
                            flat_is_source = converted.data_ptr() == current.data_ptr()
                            flat = _flat_bytes(converted)
                        src = flat[e.chunk_offset : e.chunk_offset + e.chunk_size]
                        # Never a conversion temporary: on CUDA the allocator could hand its memory
                        # to the next allocation while the collective still reads it.
                        borrowed.append(stable and flat_is_source)
                    if stable:
                        srcs.append(src)
                    else:
                        t0 = time.perf_counter()
                        dst.copy_(src)
                        stats.pack_s += time.perf_counter() - t0
                        copied = True
                t0 = time.perf_counter()
                lane = bucket.index % self.num_lanes
                if self._is_grouped(bucket):
                    # One message per tensor, coalesced: borrowed tensors travel from the caller's
                    # memory, the others are copied into their place in the buffer first.
                    msgs: list[torch.Tensor] = []
                    pend_d: list[torch.Tensor] = []
                    pend_s: list[torch.Tensor] = []
                    for i, (e, dst) in enumerate(zip(bucket.entries, dsts)):
                        if e.chunk_size == 0:
                            continue
                        if stable and borrowed[i]:
                            msgs.append(_flat_bytes(srcs[i]))
                            continue
                        if stable:
                            pend_d.append(dst)
                            pend_s.append(srcs[i])
                        msgs.append(_flat_bytes(dst))
                    if pend_d:
                        batched_copy_(pend_d, pend_s)
                    stats.pack_s += time.perf_counter() - t0
                    works[slot] = self._sender_broadcast_group(slot, msgs, lane)
                    continue
                if stable and borrowed[0] and self._is_direct(bucket):
                    msg = srcs[0]  # a lone chunk of a large tensor travels from the caller's memory
                elif stable and self._sendable_in_place(bucket, srcs):
                    msg = _flat_bytes(srcs[0])  # a lone whole tensor: no pack copy either
                else:
                    if not copied:
                        batched_copy_(dsts, srcs)  # one launch for the whole bucket
                    msg = self._message(slot, bucket.nbytes)
                    if self.verify:
                        data = msg[: _align8(bucket.nbytes)]
                        msg[data.numel() :].view(torch.int64).copy_(bucket_checksum(data))
                    self._tamper_hook(bucket.index, msg)
                stats.pack_s += time.perf_counter() - t0
                works[slot] = self._sender_broadcast(slot, msg, lane)
            if next(it, None) is not None:
                raise ValueError("the weight source yielded more tensors than its metadata lists")
            self._sender_drain(works)
        except BaseException:
            works.clear()  # pending work handles keep the group (and its sockets) alive
            self.abort()
            raise
        stats.total_s = time.perf_counter() - t_start
        stats.transfer_s = max(0.0, stats.total_s - stats.export_s - stats.pack_s)
        return stats

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

    def _sendable_in_place(self, bucket: Bucket, srcs: list[torch.Tensor]) -> bool:
        """The sender may broadcast a bucket's only tensor from the tensor itself when its memory
        already has the wire layout; receivers see the same bytes either way."""
        if len(srcs) != 1 or self.verify:
            return False
        src, e = srcs[0], bucket.entries[0]
        return src.is_contiguous() and src.device == self.device and src.dtype == torch_dtype(e.dtype) and src.numel() > 0

    def _tamper_hook(self, bucket_index: int, message: torch.Tensor) -> None:
        """Called after packing, before sending; subclasses used by fault tests corrupt here."""

    def _sender_slot_free(self, slot: int, works: list[Any]) -> None:
        if self._comm_stream is None:
            if works[slot] is not None:
                self._wait_work(works[slot], f"broadcast from buffer {slot}")
                works[slot] = None
        else:
            self._current_stream().wait_event(self._free[slot])

    def _sender_broadcast(self, slot: int, msg: torch.Tensor, lane: int) -> Any:
        group = self._lane_groups[lane]
        if self._comm_stream is None:
            return group.broadcast(msg, 0)
        stream = self._lane_streams[lane]
        self._ready[slot].record(self._current_stream())
        with self._stream_ctx(stream):
            stream.wait_event(self._ready[slot])
            work = group.broadcast(msg, 0)
            work.wait()
            self._free[slot].record(stream)
        return work

    def _sender_broadcast_group(self, slot: int, msgs: list[torch.Tensor], lane: int) -> Any:
        """Like `_sender_broadcast`, for one coalesced group of messages."""
        group = self._lane_groups[lane]
        if self._comm_stream is None:
            return _WorkList([group.broadcast(m, 0) for m in msgs])  # gloo cannot coalesce; same order
        stream = self._lane_streams[lane]
        self._ready[slot].record(self._current_stream())
        with self._stream_ctx(stream):
            stream.wait_event(self._ready[slot])
            work = _coalesced_broadcast(group, msgs)
            self._free[slot].record(stream)
        return work

    def _sender_drain(self, works: list[Any]) -> None:
        if self._comm_stream is None:
            for i, work in enumerate(works):
                if work is not None:
                    self._wait_work(work, f"broadcast from buffer {i}")
        else:
            for i, ev in enumerate(self._free):
                self._wait_event(ev, f"broadcast from buffer {i}")

    # --- receiver ----------------------------------------------------------------------------
    def receive_buckets(
        self, manifest: BucketManifest, destinations: Mapping[str, torch.Tensor] | None = None
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        self._require_group()
        if self.rank == 0:
            raise RuntimeError("receive_buckets() runs on receiver ranks, not on the sender (rank 0)")
        views = self._bucket_views(manifest)
        buckets = manifest.buckets
        works: list[Any] = [None] * len(buckets)
        nb = self.num_buffers
        if self._assembly_digest != manifest.digest:
            self._assembly, self._assembly_digest = {}, manifest.digest

        def assembly(e: TensorMeta) -> torch.Tensor:
            # A chunked tensor is reassembled in its destination when the loader offers one with
            # the wire layout (no extra memory, no final copy); otherwise in a reassembly tensor
            # kept across syncs of one plan (a fresh host allocation of a large tensor costs a
            # page fault per 4 KiB on every sync; the CUDA caching allocator would reuse it anyway).
            dest = destinations.get(e.name) if destinations is not None else None
            if dest is not None and _has_wire_layout(dest, e, self.device):
                return _flat_bytes(dest)
            asm = self._assembly.get(e.name)
            if asm is None:
                asm = self._assembly[e.name] = torch.empty(e.nbytes, dtype=torch.uint8, device=self.device)
            return asm

        # Per bucket, entries received outside the buffer: index -> the loader's destination, or
        # None for a chunk received straight into its reassembly tensor.
        landed: dict[int, dict[int, torch.Tensor | None]] = {}

        def destination(e: TensorMeta) -> torch.Tensor | None:
            dest = destinations.get(e.name) if destinations is not None else None
            return dest if dest is not None and _has_wire_layout(dest, e, self.device) else None

        def post(k: int) -> Any:
            bucket = buckets[k]
            slot, lane = bucket.index % nb, bucket.index % self.num_lanes
            e = bucket.entries[0] if bucket.entries else None
            if self._is_direct(bucket):
                assert e is not None
                landed[k] = {0: None}
                return self._post_receive(slot, assembly(e)[e.chunk_offset : e.chunk_offset + e.chunk_size], lane)
            if e is not None and self._is_direct_whole(bucket) and (dest := destination(e)) is not None:
                landed[k] = {0: dest}  # alone in its bucket: lands in the loader's own tensor
                return self._post_receive(slot, _flat_bytes(dest), lane)
            if self._is_grouped(bucket):
                land: dict[int, torch.Tensor | None] = {}
                targets: list[torch.Tensor] = []
                for i, (m, view) in enumerate(zip(bucket.entries, views[k])):
                    if m.chunk_size == 0:
                        continue
                    if not m.is_whole:
                        land[i] = None
                        targets.append(assembly(m)[m.chunk_offset : m.chunk_offset + m.chunk_size])
                    elif (dest := destination(m)) is not None:
                        land[i] = dest
                        targets.append(_flat_bytes(dest))
                    else:
                        targets.append(_flat_bytes(view))
                landed[k] = land
                return self._post_receive_group(slot, targets, lane)
            return self._post_receive(slot, self._message(slot, bucket.nbytes), lane)

        try:
            for k in range(min(nb, len(buckets))):
                works[k] = post(k)
            for k, bucket in enumerate(buckets):
                slot = bucket.index % nb
                self._finish_receive(slot, works[k], k)
                works[k] = None
                land = landed.pop(k, {})
                if self.verify:
                    self._check_bucket(k, self._message(slot, bucket.nbytes), bucket.nbytes)
                out: list[tuple[str, torch.Tensor]] = []
                for i, (e, view) in enumerate(zip(bucket.entries, views[k])):
                    if e.is_whole:
                        out.append((e.name, land.get(i) if land.get(i) is not None else view))
                        continue
                    asm = assembly(e)
                    if i not in land:
                        asm[e.chunk_offset : e.chunk_offset + e.chunk_size].copy_(view)
                    if e.is_last_chunk:
                        out.append((e.name, asm.view(torch_dtype(e.dtype)).view(e.shape)))
                yield out
                # The loader has issued its copies of bucket k: the slot may be refilled.
                if self._comm_stream is not None:
                    self._free[slot].record(self._current_stream())
                if k + nb < len(buckets):
                    works[k + nb] = post(k + nb)
        except BaseException:
            works.clear()  # pending work handles keep the group (and its sockets) alive
            self.abort()
            raise
        if self._comm_stream is not None:
            done = self._new_event()
            done.record(self._current_stream())
            self._wait_event(done, "loading the last bucket")

    def _post_receive(self, slot: int, msg: torch.Tensor, lane: int) -> Any:
        group = self._lane_groups[lane]
        if self._comm_stream is None:
            return group.broadcast(msg, 0)
        stream = self._lane_streams[lane]
        with self._stream_ctx(stream):
            stream.wait_event(self._free[slot])
            work = group.broadcast(msg, 0)
            work.wait()
            self._ready[slot].record(stream)
        return work

    def _post_receive_group(self, slot: int, targets: list[torch.Tensor], lane: int) -> Any:
        group = self._lane_groups[lane]
        if self._comm_stream is None:
            return _WorkList([group.broadcast(t, 0) for t in targets])
        stream = self._lane_streams[lane]
        with self._stream_ctx(stream):
            stream.wait_event(self._free[slot])
            work = _coalesced_broadcast(group, targets)
            self._ready[slot].record(stream)
        return work

    def _finish_receive(self, slot: int, work: Any, k: int) -> None:
        if self._comm_stream is None:
            self._wait_work(work, f"bucket {k}")
        else:
            self._current_stream().wait_event(self._ready[slot])

    def _check_bucket(self, k: int, msg: torch.Tensor, nbytes: int) -> None:
        data = msg[: _align8(nbytes)]
        expected = msg[data.numel() :].view(torch.int64).tolist()
        actual = bucket_checksum(data).tolist()
        if expected != actual:
            self._broken = True
            raise TransferError(f"rank {self.rank}: bucket {k} failed its checksum (sent {expected}, received {actual})")


class _WorkList:
    """Several pending works waited on as one, within one deadline."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self, timeout: Any = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()
        for work in self.works:
            if deadline is None:
                work.wait()
            else:
                work.wait(_timedelta(max(0.001, deadline - time.monotonic())))
        return True


def _coalesced_broadcast(group: Any, msgs: list[torch.Tensor]) -> Any:
    """Broadcasts from rank 0 of every message as one NCCL group (one launch); the current stream
    waits for it. Ranks must pass the same number of messages with the same sizes."""
    group._start_coalescing()
    try:
        for m in msgs:
            group.broadcast(m, 0)
    finally:
        work = group._end_coalescing()
    work.wait()
    return work


def _timedelta(seconds: float) -> Any:
    import datetime

    return datetime.timedelta(seconds=seconds)


def _next_weight(it: Iterator[tuple[str, torch.Tensor]], e: TensorMeta) -> torch.Tensor:
    try:
        name, tensor = next(it)
    except StopIteration:
        raise ValueError(f"the weight source ended before {e.name!r}, which its metadata lists") from None
    if name != e.name:
        raise ValueError(f"the weight source yielded {name!r} where its metadata put {e.name!r}")
    if tuple(tensor.shape) != e.shape:
        raise ValueError(f"{name}: the weight source yielded shape {tuple(tensor.shape)}, its metadata says {e.shape}")
    wire = torch_dtype(e.dtype)
    if tensor.dtype != wire and not (tensor.is_floating_point() and wire.is_floating_point):
        # Casting between float formats is the wire-dtype policy; anything else is a bug upstream.
        raise ValueError(f"{name}: the weight source yielded {dtype_name(tensor.dtype)}, its metadata says {e.dtype}")
    return tensor


def _has_wire_layout(t: torch.Tensor, e: TensorMeta, device: torch.device) -> bool:
    return t.is_contiguous() and t.device == device and t.dtype == torch_dtype(e.dtype) and tuple(t.shape) == e.shape


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)
