"""The sending side of a delta sync whose patches the trainer's cast recorded (`delta_base: cast`).

With `delta_base="cast"` a sender keeps no base image: its trainer writes its bf16 weights through
`engine.cast_recorder(manifest)` (delta/recorder.py), which records each bucket's patch while it
casts. A sync then only frames and sends those patches; a bucket without a valid recording (first
sync, more changes since the last sync than its patch area holds, weights written elsewhere, a
patch that would not be smaller) is packed and sent dense from the source, and its checksum is
taken from the packed bytes. The receivers cannot tell the difference: frames, checksums and
patches are those of pipelined_delta.py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ckpt_engine.transports.copy_plan import anchors_of, anchors_unmoved, layout_of
from ckpt_engine.transports.delta_bases import DENSE, PATCH
from ckpt_engine.transports.piece_reader import PieceReader
from ckpt_engine.transports.pipelined_delta import FAST_LINK_SCATTER_BELOW
from ckpt_engine.copies import batched_copy_
from ckpt_engine.delta import codec
from ckpt_engine.delta.recorder import CastBucket, CastRecorder, CastSlice
from ckpt_engine.delta.request import DeltaRequest
from ckpt_engine.transports.base import SendStats
from ckpt_engine.manifest import BucketManifest

__all__ = ["CastSendMixin"]

logger = logging.getLogger(__name__)


@dataclass
class _CastWalk:
    """A sender's sources per bucket at a sync whose source named its anchors (the tensors every
    piece is a view of, `sharded_source.PieceWalk`), replayed while they stay where they were: a
    30B MoE's 3,933 tensors per rank cost 10-15 ms of walk per sync. Holding the anchors keeps
    their memory from being reused behind the plan's back."""

    digest: str
    anchors: list[torch.Tensor]
    layout: tuple[Hashable, ...]
    srcs: dict[int, list[torch.Tensor]]
    fresh: set[int]
    """Buckets whose sources were the recorder's bound tensors."""
    binding: int
    """The recorder's binding they were checked against (a new `bind` walks anew)."""

    def matches(self, digest: str, anchors: list[torch.Tensor], binding: int) -> bool:
        return digest == self.digest and binding == self.binding and anchors_unmoved(self.anchors, self.layout, anchors)


class CastSendMixin:
    """Mixed into PipelinedBroadcastEngine next to DeltaTransferMixin."""

    _cast_walk: _CastWalk | None = None

    def cast_recorder(self, manifest: BucketManifest) -> CastRecorder:
        """The recorder of this sender's buckets under `manifest` (one per plan; made on first use):
        bind the trainer's (fp32 master, bf16 weight) pairs to it and call its `cast_()` after each
        optimizer step instead of copying the masters into the weights."""
        if self.delta_base != "cast":
            raise RuntimeError(f"a cast recorder needs the engine option delta_base='cast' (this engine keeps its bases on the {self.delta_base})")
        if not getattr(self, "is_sender", False):
            raise RuntimeError(f"rank {self.rank} is not a sender: only senders record their casts")
        if self._recorder is None or self._recorder[0] != manifest.digest:
            sched, mine, _ = self._own_steps(manifest)
            buckets = [
                CastBucket(s.ordinal, s.bucket.nbytes, s.word_bytes, tuple(
                    CastSlice(e.name, e.shape, e.dtype, sched.piece_start[(self.rank, e.name)], e.chunk_offset, e.chunk_size, e.bucket_offset)
                    for e in s.bucket.entries
                ))
                for s in mine
            ]
            below = self.delta_scatter_below if self._scatter_below_given else FAST_LINK_SCATTER_BELOW
            self._recorder = (manifest.digest, CastRecorder(buckets, self.device, below))
        return self._recorder[1]

    def _remember_walk(self, manifest: BucketManifest, weights: Any, srcs: dict[int, list[torch.Tensor]], fresh: set[int]) -> None:
        """Keep this sync's sources per bucket, keyed by where the source's anchors are now (a fresh
        walk reads them), so that later syncs of the same tensors skip the walk."""
        anchors = anchors_of(weights)
        if anchors is None:
            return
        try:
            self._cast_walk = _CastWalk(manifest.digest, anchors, layout_of(anchors), srcs, set(fresh), self._recorder[1].binding)
        finally:
            weights.close()

    def _send_cast(self, manifest: BucketManifest, weights: Iterable[tuple[str, torch.Tensor]], *, stable: bool, delta: DeltaRequest) -> SendStats:
        """Send each bucket's recorded patch, or the bucket dense (through two rotating buffers)."""
        t_start = time.perf_counter()
        sched, mine, stats = self._own_steps(manifest)
        rec = self._recorder[1] if self._recorder is not None and self._recorder[0] == manifest.digest else None
        anchors = anchors_of(weights) if stable and rec is not None else None
        walk = self._cast_walk
        replay = anchors is not None and walk is not None and rec is not None and walk.matches(manifest.digest, anchors, rec.binding)
        if anchors is not None and not replay:
            self._cast_walk = walk = None  # stale: drop its references, then walk anew
            weights.close()  # type: ignore[attr-defined]
        recorded: dict[int, list[torch.Tensor]] | None = {} if anchors is not None and not replay else None
        it = iter(weights) if not replay else iter(())
        works: list[Any] = []
        slot_works: list[Any] = [None] * self.num_buffers
        tally = {"wire": 0, "changed": 0, "words": 0, "patches": 0, "recorded": 0}
        fresh: set[int] = set()
        dense_seen = 0
        try:
            bases = self._bases_for(manifest, delta, [(s.ordinal, s.bucket.nbytes) for s in mine])
            pieces = PieceReader(it, sched, self.rank, self.device, stats, self._known_sources(manifest, stable))
            for step in mine:
                key, n, word = step.ordinal, step.bucket.nbytes, step.word_bytes
                tally["words"] += n // word
                t0 = time.perf_counter()
                srcs: list[torch.Tensor] | None = None
                frame: tuple[int, int, torch.Tensor | None, torch.Tensor, int] | None = None
                if replay:  # the same tensors where they were: no walk, no check per tensor
                    assert walk is not None
                    srcs, held = walk.srcs[key], key in walk.fresh
                elif stable:
                    got = [pieces.source(e) for e in step.bucket.entries]
                    srcs = [src for src, _own in got]
                    held = rec is not None and rec.holds(key, [src.data_ptr() for src in srcs])
                    if recorded is not None:
                        if all(own or e.is_whole for (_s, own), e in zip(got, step.bucket.entries)):
                            recorded[key] = srcs
                        else:  # a conversion temporary of this walk: nothing to replay
                            recorded = None
                if srcs is not None and rec is not None:
                    if held:
                        fresh.add(key)
                        diff = rec.take(key, delta.base_id) if delta.patches and bases.sums.get(key) is not None else None
                        if diff is not None:
                            size, delta_sum, count = diff.finish()
                            if size is not None:
                                result = bases.sums[key] + delta_sum
                                bases.sums[key] = result
                                frame = (PATCH, size, result, diff.out[:size], count)
                                tally["recorded"] += 1
                stats.extra["encode_s"] = stats.extra.get("encode_s", 0.0) + time.perf_counter() - t0
                slot = None
                if frame is None:  # dense, packed into one of the rotating buffers
                    slot = dense_seen % self.num_buffers
                    dense_seen += 1
                    self._sender_slot_free(slot, slot_works)
                    target = self._buffers[slot][:n]
                    t0 = time.perf_counter()
                    target.zero_()  # padding stays zero: in-place receivers hold none
                    if srcs is None:
                        for e in step.bucket.entries:
                            self._entry_view(target, e).copy_(pieces.source(e)[0])
                    else:
                        batched_copy_([self._entry_view(target, e) for e in step.bucket.entries], srcs)
                    bases.sums[key] = codec.checksum(target, word)
                    stats.pack_s += time.perf_counter() - t0
                    frame = (DENSE, n, None, target, n // word)
                kind, size, result, msg, changed = frame
                tally["wire"] += size
                tally["changed"] += changed
                tally["patches"] += kind == PATCH
                header = self._frame_header(kind, size, result, msg)
                self._tamper_hook(step.bucket.index, msg)
                works.append(self._broadcast_on(step.gid, None, header))
                work = self._broadcast_on(step.gid, slot, msg)
                works.append(work)
                if slot is not None:
                    slot_works[slot] = work
            if next(it, None) is not None:
                raise ValueError("the weight source yielded more tensors than its metadata lists")
            self._drain_unslotted(works, "delta payloads")
            bases.sync_id = delta.new_id
        except BaseException:
            works.clear()
            slot_works.clear()
            self._cast_walk = None
            if rec is not None:
                rec.forget()
            self.abort()
            raise
        finally:
            if replay:
                weights.close()  # type: ignore[attr-defined]
        if recorded is not None and len(recorded) == len(mine):
            self._remember_walk(manifest, weights, recorded, fresh)
        if rec is not None:
            rec.synced(delta.new_id, fresh)
            strays = rec.bound_keys() - fresh
            if strays:
                logger.warning("rank %s: %d bucket(s) were not sent from the recorder's bound tensors (the source yields others); "
                               "they stay dense", self.rank, len(strays))
        elif delta.patches:
            logger.warning("rank %s: delta_base='cast' but no cast recorder for this plan: every bucket is sent dense", self.rank)
        words = tally["words"]
        stats.extra.update(
            wire_bytes=float(tally["wire"]), table_bytes=float(24 * len(mine)), dense_bytes=float(sum(s.bucket.nbytes for s in mine)),
            patch_buckets=float(tally["patches"]), direct_buckets=0.0, recorded_buckets=float(tally["recorded"]),
            changed_fraction=tally["changed"] / words if words else 0.0, walk_skipped=float(replay),
            base_bytes=float(rec.nbytes if rec is not None else 0), base_on_host=float(self.device.type == "cpu"),
        )
        stats.total_s = time.perf_counter() - t_start
        stats.transfer_s = max(0.0, stats.total_s - stats.export_s - stats.pack_s - stats.extra.get("encode_s", 0.0))
        self.last_delta_stats = dict(stats.extra)
        return stats
