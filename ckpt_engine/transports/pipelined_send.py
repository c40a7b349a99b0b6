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

from ckpt_engine.transports.collectives import WorkList, coalesced_broadcast
from ckpt_engine.transports.copy_plan import BucketSend, SendPlan, anchors_of, coalesce, layout_of
from ckpt_engine.transports.piece_reader import PieceReader
from ckpt_engine.transports.wire_views import align8, flat_bytes, torch_dtype
from ckpt_engine.checksum import bucket_checksum
from ckpt_engine.copies import batched_copy_
from ckpt_engine.delta.request import DeltaRequest
from ckpt_engine.transports.base import SendStats
from ckpt_engine.manifest import Bucket, BucketManifest

__all__ = ["SendLoopMixin"]


class _Once(BucketSend):
    """A bucket's send decided for this sync only (its pieces were temporaries, or were packed
    one by one): never recorded for replay."""


def _as_lists(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return list(dsts), list(srcs)


class SendLoopMixin:
    """Mixed into PipelinedBroadcastEngine; uses its buffers, groups, streams and events."""

    _send_plan: SendPlan | None = None
    _own_counts: tuple[str, int | None, int, int] | None = None  # (digest, rank, bytes, tensors)
    send_plan_builds = 0
    """How many send plans this engine has recorded (tests check that a plan is reused, and rebuilt
    when a source's tensors moved)."""

    def _own_steps(self, manifest: BucketManifest) -> tuple[Any, list[Any], SendStats]:
        """This sender's schedule, its own steps in order, and stats counting what it sends (the
        counts are worked out once per plan: a MoE sender owns ~10,000 entries)."""
        sched = self._schedule(manifest)
        mine = [sched.steps[i] for i in sched.by_sender[self.rank]]
        counts = self._own_counts
        if counts is None or counts[:2] != (manifest.digest, self.rank):
            counts = self._own_counts = (
                manifest.digest, self.rank,
                sum(e.chunk_size for s in mine for e in s.bucket.entries), len({e.name for s in mine for e in s.bucket.entries}),
            )
        return sched, mine, SendStats(bytes=counts[2], tensors=counts[3], buckets=len(mine))

    def send_weights(
        self,
        manifest: BucketManifest,
        weights: Iterable[tuple[str, torch.Tensor]],
        *,
        stable: bool = False,
        delta: DeltaRequest | None = None,
    ) -> SendStats:
        """See CheckpointEngine.send_weights. With `stable`, a bucket holding a single tensor (or a
        single chunk of one) travels straight from the tensor's memory instead of being packed.

        With `stable` weights that name their anchors (`sharded_source.PieceWalk`), the copies of
        every bucket are recorded at the first sync of a plan and replayed while the anchors stay
        where they were (`copy_plan.py`): no piece is then produced or looked up one by one."""
        self._require_group()
        if not self.is_sender:
            raise RuntimeError(f"send_weights() runs on sender ranks [0, {self.num_senders}), this is rank {self.rank}")
        if delta is not None:
            return self._send_delta(manifest, weights, stable=stable, delta=delta)
        self._reset_delta()  # a sync outside delta framing: the bases are stale; free their memory
        t_start = time.perf_counter()
        sched, mine, stats = self._own_steps(manifest)
        views = self._bucket_views(manifest)
        anchors = anchors_of(weights) if stable else None
        stats.export_s += time.perf_counter() - t_start
        plan = self._send_plan
        if anchors is None or plan is None or not plan.matches(manifest.digest, views, anchors):
            plan = None
        if anchors is not None and plan is None:
            self._send_plan = None  # stale: drop its references before walking anew
            weights.close()  # type: ignore[attr-defined]
        recorded: dict[int, BucketSend] | None = {} if anchors is not None and plan is None else None
        it = iter(weights) if plan is None else iter(())
        works: list[Any] = [None] * self.num_buffers
        try:
            pieces = PieceReader(it, sched, self.rank, self.device, stats, self._known_sources(manifest, stable)) if plan is None else None
            for step in mine:
                bucket, slot = step.bucket, step.sender_slot
                self._sender_slot_free(slot, works)
                if plan is not None:
                    action = plan.buckets[bucket.index]
                else:
                    assert pieces is not None
                    action = self._resolve_bucket(bucket, views[bucket.index], pieces, stable, stats, recorded is not None)
                    if recorded is not None:
                        if isinstance(action, _Once):
                            recorded = None  # a piece was a temporary of this walk: nothing to replay
                        else:
                            recorded[bucket.index] = action
                works[slot] = self._send_bucket(step, slot, action, stats)
            if plan is None and next(it, None) is not None:
                raise ValueError("the weight source yielded more tensors than its metadata lists")
            self._sender_drain(works)
        except BaseException:
            works.clear()  # pending work handles keep the group (and its sockets) alive
            self.abort()
            raise
        finally:
            if plan is not None:
                weights.close()  # type: ignore[attr-defined]
        if recorded is not None:
            self._record_send_plan(manifest, views, weights, recorded)
        stats.total_s = time.perf_counter() - t_start
        stats.transfer_s = max(0.0, stats.total_s - stats.export_s - stats.pack_s)
        return stats

    def _record_send_plan(self, manifest: BucketManifest, views: Any, weights: Any, recorded: dict[int, BucketSend]) -> None:
        """Keep this sync's copies for replay, keyed by where the source's anchors are now (read in a
        fresh walk: the one just done has ended, and its casts were kept in place)."""
        anchors = anchors_of(weights)
        if anchors is None:
            return
        try:
            self._send_plan = SendPlan(manifest.digest, views, anchors, layout_of(anchors), recorded)
            self.send_plan_builds += 1
        finally:
            weights.close()

    def _resolve_bucket(
        self, bucket: Bucket, dsts: list[torch.Tensor], pieces: PieceReader, stable: bool, stats: SendStats, record: bool
    ) -> BucketSend:
        """Take a bucket's pieces from the source and decide how it travels. Without `stable`, each
        piece is packed before the next is asked for (the result is then only good for this sync).
        A `_Once` when the decision holds for this sync only (not `record`ing, or a piece is a
        temporary of this walk); only a recorded decision pays for coalescing its copies."""
        srcs: list[torch.Tensor] = []
        borrowed: list[bool] = []  # src is the caller's memory in the wire layout
        replayable = stable and record
        pair = coalesce if record else _as_lists
        for e, dst in zip(bucket.entries, dsts):
            src, own = pieces.source(e)
            borrowed.append(stable and own and self._may_borrow())
            replayable = replayable and (own or e.is_whole)  # a chunk that is not `own` is a conversion temporary
            if stable:
                srcs.append(src)
            else:
                t0 = time.perf_counter()
                dst.copy_(src)
                stats.pack_s += time.perf_counter() - t0
        if not stable:
            return self._finish_unstable(bucket, dsts)
        if self._is_grouped(bucket):
            # One message per tensor, coalesced: borrowed tensors travel from the caller's memory,
            # the others are copied into their place in the buffer first.
            msgs: list[torch.Tensor] = []
            pend_d: list[torch.Tensor] = []
            pend_s: list[torch.Tensor] = []
            for i, (e, dst) in enumerate(zip(bucket.entries, dsts)):
                if e.chunk_size == 0:
                    continue
                if borrowed[i]:
                    msgs.append(flat_bytes(srcs[i]))
                    continue
                pend_d.append(dst)
                pend_s.append(srcs[i])
                msgs.append(flat_bytes(dst))
            action = BucketSend("grouped", *pair(pend_d, pend_s), msgs=msgs)
        elif borrowed and borrowed[0] and self._is_direct(bucket):
            action = BucketSend("message", msgs=[srcs[0]])  # a lone chunk of a large tensor, from the caller's memory
        elif self._may_borrow() and self._sendable_in_place(bucket, srcs):
            action = BucketSend("message", msgs=[flat_bytes(srcs[0])])  # a lone whole tensor: no pack copy either
        else:
            action = BucketSend("packed", *pair(dsts, srcs))
        return action if replayable else _Once(action.kind, action.dsts, action.srcs, action.msgs)

    def _finish_unstable(self, bucket: Bucket, dsts: list[torch.Tensor]) -> BucketSend:
        """A bucket whose pieces were packed one by one: only its messages are left to decide."""
        if self._is_grouped(bucket):
            return _Once("grouped", msgs=[flat_bytes(d) for e, d in zip(bucket.entries, dsts) if e.chunk_size])
        return _Once("packed")

    def _send_bucket(self, step: Any, slot: int, action: BucketSend, stats: SendStats) -> Any:
        """Pack (one batched copy) and broadcast one bucket as `action` says."""
        bucket = step.bucket
        t0 = time.perf_counter()
        if isinstance(action, _Once):
            batched_copy_(action.dsts, action.srcs)  # one launch for the whole bucket
        elif action.dsts:
            torch._foreach_copy_(action.dsts, action.srcs)  # recorded: pairs already merged and filtered
        if action.kind == "grouped":
            stats.pack_s += time.perf_counter() - t0
            return self._sender_broadcast_group(slot, action.msgs, step.gid)
        if action.kind == "message":
            msg = action.msgs[0]
        else:
            if action.nbytes < 0:
                action.nbytes = bucket.nbytes  # a property summing every entry: once per plan
            msg = self._message(slot, action.nbytes)
            if self.verify:
                data = msg[: align8(action.nbytes)]
                msg[data.numel() :].view(torch.int64).copy_(bucket_checksum(data))
            self._tamper_hook(bucket.index, msg)
        stats.pack_s += time.perf_counter() - t0
        return self._sender_broadcast(slot, msg, step.gid)

    def _may_borrow(self) -> bool:
        """Whether this sender may broadcast straight from its source's memory (a sender whose
        buffers a receiver reads in place may not: every bucket must be in those buffers)."""
        return True

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
