"""The sender of one sync: walk the source, pack or encode each own bucket, post it, drain.

Each sender packs its bucket k into slot k % num_buffers while earlier ones are in flight, or
sends straight from the caller's tensors where the source is stable and the bucket allows it. With
a source that names its anchors, each bucket's copies are recorded at a plan's first sync and
replayed while the anchors stay put (`copy_plan.py`); a delta sync frames each bucket as a patch
or dense (`delta_send.py`). How bytes move is the transport's business.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from ckpt_engine.checksum import bucket_checksum
from ckpt_engine.copies import batched_copy_
from ckpt_engine.delta.request import DeltaRequest
from ckpt_engine.fp8.direct import OFFER, Ask, Offer
from ckpt_engine.manifest import Bucket, BucketManifest
from ckpt_engine.pipeline.copy_plan import BucketSend, SendPlan, anchors_of, close_walk, coalesce, layout_of
from ckpt_engine.pipeline.delta_send import DeltaSender
from ckpt_engine.pipeline.fault_hooks import FaultHooks
from ckpt_engine.pipeline.options import PipelineOptions
from ckpt_engine.pipeline.piece_reader import PieceReader
from ckpt_engine.pipeline.plan_state import PlanState
from ckpt_engine.pipeline.schedule import Step
from ckpt_engine.pipeline.shared_sources import SharedSources
from ckpt_engine.delta.layout import align8
from ckpt_engine.pipeline.wire_views import SourceMismatch, flat_bytes, message
from ckpt_engine.sources.wire import torch_dtype
from ckpt_engine.engine import SendStats
from ckpt_engine.sources.base import WeightWalk
from ckpt_engine.transports.transport import Transport

__all__ = ["Sender"]


class _Once(BucketSend):
    """A bucket's send decided for this sync only (its pieces were temporaries, or were packed
    one by one): never recorded for replay."""


@dataclass
class _OnceByDtype(_Once):
    """A `_Once` packed bucket of a fresh walk, its copies already split by dtype pair while the
    walk was read (`PieceReader.fresh_entries`): one `_foreach_copy_` a pair, nothing sorted."""

    groups: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = field(default_factory=list)


class _OnceOneDtype(_Once):
    """A `_Once` packed bucket whose copies are all of one dtype, from the caller's own memory into
    the sender's slot (never the same memory): one `_foreach_copy_` with no per-pair sorting (a
    30B MoE sync packs ~19,000 such pairs)."""


def _as_lists(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return list(dsts), list(srcs)


class Sender:
    """A sender rank's side of every sync."""

    def __init__(self, transport: Transport, options: PipelineOptions, hooks: FaultHooks, *, scatter_below: float) -> None:
        self.t = transport
        self.opts = options
        self.hooks = hooks
        self.delta = DeltaSender(transport, options, hooks, scatter_below=scatter_below)
        sharing = transport.source_sharing
        self.shared = SharedSources(transport, sharing) if sharing is not None else None
        """The one-copy path where the receiver maps a stable sender's own tensors."""
        self.send_plan_builds = 0
        """How many send plans this sender has recorded."""

    def send(
        self, state: PlanState, manifest: BucketManifest, weights: Iterable[tuple[str, torch.Tensor]], *, stable: bool, delta: DeltaRequest | None
    ) -> SendStats:
        """One sync of this sender's buckets (see CheckpointEngine.send_weights)."""
        assert self.t.rank is not None
        self.t.begin_send(state.schedule.by_sender[self.t.rank])
        shareable, stable = stable, stable and self.t.stable_sources
        if delta is not None:
            return self.delta.send(state, manifest, weights, stable=stable, delta=delta)
        state.drop_delta()  # a sync outside delta framing: the bases are stale; free their memory
        if self.shared is not None:
            done, weights = self.shared.send(state, manifest, weights, shareable)
            if done is not None:
                return done
        t_start = time.perf_counter()
        mine, stats = state.own_steps(self.t.rank)
        views = state.bucket_views(manifest, self.t.buffers, self.opts.bucket_size_bytes, True)
        anchors = anchors_of(weights) if stable else None
        stats.export_s += time.perf_counter() - t_start
        plan = state.send_plan
        if anchors is None or plan is None or not plan.matches(manifest.digest, views, anchors):
            plan = None
        if anchors is not None and plan is None:
            state.send_plan = None  # stale: drop its references before walking anew
            close_walk(weights)
        recorded: dict[int, BucketSend] | None = {} if anchors is not None and plan is None else None
        fresh = not stable and isinstance(weights, WeightWalk) and weights.fresh  # pieces outlive the walk's next step
        offer = Offer(f"{manifest.digest}/{self.t.rank}") if fresh else None  # a replayed FP8 walk fills the slots itself
        it = iter(weights) if plan is None else iter(())
        works: list[Any] = [None] * self.opts.num_buffers
        offered = OFFER.set(offer)  # for the walk's generator: it runs in this context when pulled
        try:
            known = state.known if stable else None
            pieces = PieceReader(it, state.schedule, self.t.rank, self.t.device, stats, known) if plan is None else None
            for step in mine:
                bucket, slot = step.bucket, step.sender_slot
                self.t.wait_slot(slot, works)
                if plan is not None:
                    action = plan.buckets[bucket.index]
                else:
                    assert pieces is not None
                    action = self._resolve_bucket(
                        bucket, views[bucket.index], pieces, stable, stats, recorded is not None, fresh=fresh, kind=state.bucket_kind(bucket),
                        offer=offer, slot=slot,
                    )
                    if recorded is not None:
                        if isinstance(action, _Once):
                            recorded = None  # a piece was a temporary of this walk: nothing to replay
                        else:
                            recorded[bucket.index] = action
                works[slot] = self._send_bucket(step, slot, action, stats)
            if plan is None and next(it, None) is not None:
                raise SourceMismatch("the weight source yielded more tensors than its metadata lists")
            self.t.drain_slots(works)
        except BaseException:
            works.clear()  # pending work handles keep the group (and its sockets) alive
            self.t.abort()
            state.bases.sync_id = None
            raise
        finally:
            OFFER.reset(offered)
            if plan is not None:
                close_walk(weights)
        if recorded is not None:
            self._record_send_plan(state, manifest, views, weights, recorded)
        stats.total_s = time.perf_counter() - t_start
        return stats

    def _record_send_plan(
        self, state: PlanState, manifest: BucketManifest, views: Any, weights: Iterable[tuple[str, torch.Tensor]], recorded: dict[int, BucketSend]
    ) -> None:
        """Keep this sync's copies for replay, keyed by where the source's anchors are now (read in a
        fresh walk: the one just done has ended)."""
        anchors = anchors_of(weights)
        if anchors is None:
            return
        try:
            state.send_plan = SendPlan(manifest.digest, views, anchors, layout_of(anchors), recorded)
            self.send_plan_builds += 1
        finally:
            close_walk(weights)

    def _resolve_bucket(
        self, bucket: Bucket, dsts: list[torch.Tensor], pieces: PieceReader, stable: bool, stats: SendStats, record: bool,
        *, fresh: bool = False, kind: tuple[bool, bool], offer: Offer | None = None, slot: int = 0,
    ) -> BucketSend:
        """Take a bucket's pieces from the source and decide how it travels. Without `stable`, each
        piece is packed before the next is asked for (the result is then only good for this sync),
        unless the source's tensors are `fresh`: then the bucket's pieces are held and packed in one
        batched copy (a 30B-A3B FP8 walk has ~37k pieces, a copy launch each otherwise).
        A `_Once` when the decision holds for this sync only (not `record`ing, or a piece is a
        temporary of this walk); only a recorded decision pays for coalescing its copies. `kind`:
        `PlanState.bucket_kind` (every entry whole, one wire dtype). `offer`: a fresh walk is offered
        each bucket of whole entries first, to fill in `slot` itself (a replayed FP8 walk)."""
        srcs: list[torch.Tensor] = []
        borrowed: list[bool] = []  # src is the caller's memory in the wire layout
        replayable = stable and record
        pair = coalesce if record else _as_lists
        may_borrow = not self.t.reads_in_place(bucket.sender)
        one_copy = False  # every pair of one dtype, each source the caller's own memory in the wire layout
        all_whole, one_dtype = kind
        grouped = self.opts.is_grouped(bucket, self.t)
        if fresh and all_whole:  # new tensors, every one copied: checked and sorted in one loop
            how = "grouped" if grouped else "packed"
            if offer is not None:
                lend = grouped or self.opts.is_direct_whole(bucket, self.t)  # a message per entry
                ask = Ask(bucket.index, bucket.entries, dsts, self.t.slot(slot), lend=lend)
                if pieces.filled(offer, ask):  # in the slot already, or lent: nothing to pack
                    if grouped:
                        lent = ask.lent
                        return _OnceByDtype(how, msgs=[flat_bytes(lent.get(i, d)) for i, (e, d) in enumerate(zip(bucket.entries, dsts)) if e.chunk_size])
                    if ask.lent:
                        return _Once("message", msgs=[flat_bytes(ask.lent[0])])  # its one tensor, from its own memory
                    return _OnceByDtype(how)
            slot_msgs = [flat_bytes(d) for e, d in zip(bucket.entries, dsts) if e.chunk_size] if grouped else []
            return _OnceByDtype(how, msgs=slot_msgs, groups=pieces.fresh_entries(bucket.entries, dsts))
        if pieces.known is not None and all_whole:  # stable: one loop over the bucket's entries
            srcs, owns = pieces.whole_entries(bucket.entries)
            borrowed = [own and may_borrow for own in owns]
            one_copy = one_dtype and all(owns)
        else:
            for e, dst in zip(bucket.entries, dsts):
                src, own = pieces.source(e)
                borrowed.append(stable and own and may_borrow)
                replayable = replayable and (own or e.is_whole)  # a chunk that is not `own` is a conversion temporary
                if stable or fresh:
                    srcs.append(src)
                else:
                    t0 = time.perf_counter()
                    dst.copy_(src)
                    stats.pack_s += time.perf_counter() - t0
        if not stable:
            pack = (list(dsts), srcs) if fresh else ([], [])  # packed by `_send_bucket`, one launch
            if grouped:
                return _Once("grouped", *pack, msgs=[flat_bytes(d) for e, d in zip(bucket.entries, dsts) if e.chunk_size])
            return _Once("packed", *pack)
        if grouped:
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
        elif borrowed and borrowed[0] and self.opts.is_direct(bucket, self.t):
            action = BucketSend("message", msgs=[srcs[0]])  # a lone chunk of a large tensor, from the caller's memory
        elif may_borrow and self._sendable_in_place(bucket, srcs):
            action = BucketSend("message", msgs=[flat_bytes(srcs[0])])  # a lone whole tensor: no pack copy either
        elif not replayable and one_copy:
            return _OnceOneDtype("packed", dsts, srcs)
        else:
            action = BucketSend("packed", *pair(dsts, srcs))
        return action if replayable else _Once(action.kind, action.dsts, action.srcs, action.msgs)

    def _send_bucket(self, step: Step, slot: int, action: BucketSend, stats: SendStats) -> Any:
        """Pack (one batched copy) and post one bucket as `action` says."""
        bucket = step.bucket
        t0 = time.perf_counter()
        if isinstance(action, _OnceByDtype):
            for dsts, srcs in action.groups:
                torch._foreach_copy_(dsts, srcs)
        elif isinstance(action, _OnceOneDtype):
            torch._foreach_copy_(action.dsts, action.srcs)  # one dtype, no aliasing: batched_copy_'s sorting is moot
        elif isinstance(action, _Once):
            batched_copy_(action.dsts, action.srcs)  # one launch for the whole bucket
        elif action.dsts:
            torch._foreach_copy_(action.dsts, action.srcs)  # recorded: pairs already merged and filtered
        if action.kind == "grouped":
            stats.pack_s += time.perf_counter() - t0
            return self.t.post_group(step.bucket.sender, slot, action.msgs)
        if action.kind == "message":
            msg = action.msgs[0]
        else:
            if action.nbytes < 0:
                action.nbytes = bucket.nbytes  # a property summing every entry: once per plan
            msg = message(self.t.slot(slot), action.nbytes, self.opts.verify)
            if self.opts.verify:
                data = msg[: align8(action.nbytes)]
                msg[data.numel() :].view(torch.int64).copy_(bucket_checksum(data))
            self.hooks._tamper_hook(bucket.index, msg)
        stats.pack_s += time.perf_counter() - t0
        return self.t.post(step.bucket.sender, slot, msg)

    def _sendable_in_place(self, bucket: Bucket, srcs: list[torch.Tensor]) -> bool:
        """The sender may broadcast a bucket's only tensor from the tensor itself when its memory
        already has the wire layout; receivers see the same bytes either way."""
        if len(srcs) != 1 or self.opts.verify:
            return False
        src, e = srcs[0], bucket.entries[0]
        return src.is_contiguous() and src.device == self.t.device and src.dtype == torch_dtype(e.dtype) and src.numel() > 0
