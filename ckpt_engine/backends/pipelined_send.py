"""The sender's loop of the pipelined broadcast (dense buckets).

Each sender walks only its own buckets: it packs bucket k into rotating buffer k % num_buffers
while earlier ones are in flight, or sends straight from the caller's tensors where the source is
stable and the bucket allows it (one lone tensor or chunk, or a coalesced group of a few tensors).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import torch

from ckpt_engine.backends.collectives import WorkList, coalesced_broadcast
from ckpt_engine.backends.piece_reader import PieceReader
from ckpt_engine.backends.wire_views import align8, flat_bytes, torch_dtype
from ckpt_engine.checksum import bucket_checksum
from ckpt_engine.copies import batched_copy_
from ckpt_engine.delta.request import DeltaRequest
from ckpt_engine.engine import SendStats
from ckpt_engine.manifest import Bucket, BucketManifest

__all__ = ["SendLoopMixin"]


class SendLoopMixin:
    """Mixed into PipelinedBroadcastEngine; uses its buffers, groups, streams and events."""

    def _own_steps(self, manifest: BucketManifest) -> tuple[Any, list[Any], SendStats]:
        """This sender's schedule, its own steps in order, and stats counting what it sends."""
        sched = self._schedule(manifest)
        mine = [sched.steps[i] for i in sched.by_sender[self.rank]]
        stats = SendStats(
            bytes=sum(e.chunk_size for s in mine for e in s.bucket.entries),
            tensors=len({e.name for s in mine for e in s.bucket.entries}),
            buckets=len(mine),
        )
        return sched, mine, stats

    def send_weights(
        self,
        manifest: BucketManifest,
        weights: Iterable[tuple[str, torch.Tensor]],
        *,
        stable: bool = False,
        delta: DeltaRequest | None = None,
    ) -> SendStats:
        """See CheckpointEngine.send_weights. With `stable`, a bucket holding a single tensor (or a
        single chunk of one) travels straight from the tensor's memory instead of being packed."""
        self._require_group()
        if not self.is_sender:
            raise RuntimeError(f"send_weights() runs on sender ranks [0, {self.num_senders}), this is rank {self.rank}")
        if delta is not None:
            return self._send_delta(manifest, weights, stable=stable, delta=delta)
        self._reset_delta()  # a sync outside delta framing: the bases are stale; free their memory
        t_start = time.perf_counter()
        sched, mine, stats = self._own_steps(manifest)
        views = self._bucket_views(manifest)
        it = iter(weights)
        works: list[Any] = [None] * self.num_buffers
        try:
            pieces = PieceReader(it, sched, self.rank, self.device, stats, self._known_sources(manifest, stable))
            for step in mine:
                bucket, slot = step.bucket, step.sender_slot
                dsts = views[bucket.index]
                self._sender_slot_free(slot, works)
                srcs: list[torch.Tensor] = []
                borrowed: list[bool] = []  # src is the caller's memory in the wire layout
                copied = False  # without `stable`, each tensor is packed before the next is requested
                for e, dst in zip(bucket.entries, dsts):
                    src, own = pieces.source(e)
                    borrowed.append(stable and own)
                    if stable:
                        srcs.append(src)
                    else:
                        t0 = time.perf_counter()
                        dst.copy_(src)
                        stats.pack_s += time.perf_counter() - t0
                        copied = True
                t0 = time.perf_counter()
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
                            msgs.append(flat_bytes(srcs[i]))
                            continue
                        if stable:
                            pend_d.append(dst)
                            pend_s.append(srcs[i])
                        msgs.append(flat_bytes(dst))
                    if pend_d:
                        batched_copy_(pend_d, pend_s)
                    stats.pack_s += time.perf_counter() - t0
                    works[slot] = self._sender_broadcast_group(slot, msgs, step.gid)
                    continue
                if stable and borrowed[0] and self._is_direct(bucket):
                    msg = srcs[0]  # a lone chunk of a large tensor travels from the caller's memory
                elif stable and self._sendable_in_place(bucket, srcs):
                    msg = flat_bytes(srcs[0])  # a lone whole tensor: no pack copy either
                else:
                    if not copied:
                        batched_copy_(dsts, srcs)  # one launch for the whole bucket
                    msg = self._message(slot, bucket.nbytes)
                    if self.verify:
                        data = msg[: align8(bucket.nbytes)]
                        msg[data.numel() :].view(torch.int64).copy_(bucket_checksum(data))
                    self._tamper_hook(bucket.index, msg)
                stats.pack_s += time.perf_counter() - t0
                works[slot] = self._sender_broadcast(slot, msg, step.gid)
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

    def _sender_broadcast(self, slot: int, msg: torch.Tensor, gid: int) -> Any:
        return self._broadcast_on(gid, slot, msg)

    def _sender_broadcast_group(self, slot: int, msgs: list[torch.Tensor], gid: int) -> Any:
        """Like `_sender_broadcast`, for one coalesced group of messages."""
        group = self._groups[gid]
        if self._comm_stream is None:
            return WorkList([group.broadcast(m, 0) for m in msgs])  # gloo cannot coalesce; same order
        stream = self._streams[gid]
        self._ready[slot].record(self._current_stream())
        with self._stream_ctx(stream):
            stream.wait_event(self._ready[slot])
            work = coalesced_broadcast(group, msgs)
            self._free[slot].record(stream)
        return work

    def _sender_drain(self, works: list[Any]) -> None:
        if self._comm_stream is None:
            for i, work in enumerate(works):
                if work is not None:
                    self._wait_work(work, f"broadcast from buffer {i}")
        else:
            for i, ev in enumerate(self._free[: self.num_buffers]):
                self._wait_event(ev, f"broadcast from buffer {i}")
