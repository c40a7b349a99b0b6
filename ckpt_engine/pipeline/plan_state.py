"""Everything a rank keeps for as long as one plan (manifest digest) lives: one object, dropped
whole when the plan changes (or the group is left).

The schedule, the views of the slot buffers, the reassembly tensors of chunked tensors, the
recorded copy plans of each side, what a sender's source yielded last, its counts, the delta
bases and checksums, a CPU receiver's kept patch buffers and an in-place receiver's places.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch

from ckpt_engine.delta.pieces import ScatteredImage
from ckpt_engine.manifest import Bucket, BucketManifest, TensorMeta
from ckpt_engine.pipeline.copy_plan import ReceivePlan, SendPlan
from ckpt_engine.pipeline.delta_bases import Bases
from ckpt_engine.pipeline.piece_reader import Known
from ckpt_engine.pipeline.schedule import Schedule, Step
from ckpt_engine.pipeline.wire_views import entry_view
from ckpt_engine.transports.shared_tensors import Placement
from ckpt_engine.engine import SendStats

__all__ = ["PlanState", "SharedBucket", "SharedPlan", "SharedWalk"]


class SharedBucket(list[tuple[str, torch.Tensor]]):
    """One bucket of (name, mapped tensor) pairs a receiver of a stable sender's own tensors yields:
    the very same object, holding the same tensors, at every sync of one plan and offer (never
    changed once built). A loader may keep what it derives from one, keyed by the object (weakly:
    a new offer or plan makes new buckets), instead of working it out per tensor every sync."""


@dataclass
class SharedPlan:
    """A receiver of a sender's own tensors (`shared_sources.py`): per plan and offer, what each
    bucket yields, over the mapped tensors."""

    offered: list[torch.Tensor]
    buckets: list[SharedBucket]


@dataclass
class SharedWalk:
    """A stable sender's last walk of its source in the one-copy sync (`shared_sources.py`), for the
    next: the names it yielded, where and as their tensors lay (`placement`), and what it offered. A
    walk whose tensors lie the same way is the same memory, read the same way, whether or not they
    are the same objects (a `state_dict()` makes new ones each time): the transport holds every
    offered tensor's memory, so none of it can have gone to another tensor since."""

    names: list[str]
    placement: Placement
    offered: list[torch.Tensor]
    all_offered: bool
    """Every walked tensor was offered (none empty): the walk's placement is the offer's."""


class PlanState:
    """One plan's state on one rank (sender or receiver)."""

    def __init__(self, manifest: BucketManifest, num_buffers: int) -> None:
        self.digest = manifest.digest
        self.schedule = Schedule(manifest, num_buffers)
        self.views: list[list[torch.Tensor]] | None = None
        """Per bucket, views of its slot's buffer, one per entry."""
        self.assembly: dict[str, torch.Tensor] = {}
        """Receivers: reassembly tensors of chunked tensors (kept: a fresh host allocation of a
        large tensor costs a page fault per 4 KiB every sync)."""
        self.send_plan: SendPlan | None = None
        self.recv_plan: ReceivePlan | None = None
        self.known: Known = {}
        """Senders with stable sources: what the source yielded for each whole entry last time."""
        self.shared_plan: SharedPlan | None = None
        """Receivers of a sender's own tensors: what each bucket yields."""
        self.shared_walk: SharedWalk | None = None
        """Senders of their own tensors: the last walk, which a walk of the same tensors replays."""
        self.own_counts: tuple[int, int, int] | None = None  # (rank, bytes, tensors) a sender sends
        self.chunked: list[TensorMeta] | None = None
        self.kinds: dict[int, tuple[bool, bool]] = {}
        """Per bucket index: (every entry whole, every entry of one wire dtype); see `bucket_kind`."""
        self.bases = Bases()
        """Delta bases (dropped, within the plan, by a sync outside delta framing)."""
        self.patch_buffers: dict[int, torch.Tensor] = {}
        self.places: tuple[Hashable, dict[int, ScatteredImage] | None] | None = None

    def bucket_views(self, manifest: BucketManifest, buffers: list[torch.Tensor], buffer_bytes: int, is_sender: bool) -> list[list[torch.Tensor]]:
        """Views of the rotating buffers, one per entry of each bucket."""
        if self.views is None:
            if manifest.bucket_size_bytes > buffer_bytes:
                raise ValueError(
                    f"manifest buckets are {manifest.bucket_size_bytes} bytes, larger than this engine's "
                    f"{buffer_bytes}-byte buffers"
                )
            views = []
            for step in self.schedule.steps:
                slot = step.sender_slot if is_sender else step.slot
                buf = buffers[slot] if slot < len(buffers) else None
                views.append([entry_view(buf, e) for e in step.bucket.entries] if buf is not None else [])
            self.views = views
        return self.views

    def own_steps(self, rank: int) -> tuple[list[Step], SendStats]:
        """A sender's own steps in order, and stats counting what it sends (worked out once per
        plan: a MoE sender owns ~10,000 entries)."""
        sched = self.schedule
        mine = [sched.steps[i] for i in sched.by_sender[rank]]
        if self.own_counts is None or self.own_counts[0] != rank:
            self.own_counts = (
                rank, sum(e.chunk_size for s in mine for e in s.bucket.entries), len({e.name for s in mine for e in s.bucket.entries})
            )
        return mine, SendStats(bytes=self.own_counts[1], tensors=self.own_counts[2], buckets=len(mine))

    def bucket_kind(self, bucket: Bucket) -> tuple[bool, bool]:
        """(every entry is a whole tensor, every entry has one wire dtype), once per plan: a sender with
        a stable source takes such a bucket in one loop and packs it in one copy."""
        kind = self.kinds.get(bucket.index)
        if kind is None:
            kind = self.kinds[bucket.index] = (all(e.is_whole for e in bucket.entries), len({e.dtype for e in bucket.entries}) <= 1)
        return kind

    def chunked_entries(self, manifest: BucketManifest) -> list[TensorMeta]:
        """One entry per tensor that travels in chunks (split over buckets or senders)."""
        if self.chunked is None:
            seen: dict[str, TensorMeta] = {}
            for b in manifest.buckets:
                for e in b.entries:
                    if not e.is_whole:
                        seen.setdefault(e.name, e)
            self.chunked = list(seen.values())
        return self.chunked

    def drop_delta(self) -> None:
        """A sync outside delta framing: the bases are stale; free their memory."""
        self.bases = Bases()
        self.patch_buffers = {}
        self.places = None
