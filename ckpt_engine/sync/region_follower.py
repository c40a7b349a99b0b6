"""A trainer rank other than 0 in a multi-sender sync with region delivery: its rows of every piece.

Trainer rank 0 announces the layout (the receiver sets and their pieces) with the send; this rank
plans the sets' buckets alike (`plan_sets`, a pure function), refuses a digest rank 0 did not
plan, streams as many sets side by side as rank 0 announced (`width`: every sender's waves must
match), joins the sets' groups (once per layout and weight-sync group) and streams its rows.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ckpt_engine.delta.request import DeltaRequest
from ckpt_engine.manifest import BucketManifest
from ckpt_engine.pipeline.region_groups import RegionGroups, send_regions
from ckpt_engine.planning.receive_sets import RegionLayout
from ckpt_engine.sources.sharded import ShardedWeightSource
from ckpt_engine.sync.regions import plan_sets, sender_tensors
from ckpt_engine.engine import CheckpointEngine, Rendezvous, SendStats

__all__ = ["FollowerRegions"]

logger = logging.getLogger(__name__)


class FollowerRegions:
    """Held by a SenderFollower: the receiver-set groups of this sending rank."""

    def __init__(self) -> None:
        self._rdzv: Rendezvous | None = None
        self._make: Callable[[], CheckpointEngine] | None = None
        self._planner: CheckpointEngine | None = None
        self._groups: RegionGroups | None = None

    def joined(self, rendezvous: Rendezvous, make_engine: Callable[[], CheckpointEngine], planner: CheckpointEngine) -> None:
        self.close()
        self._rdzv, self._make, self._planner = rendezvous, make_engine, planner

    def send(self, source: ShardedWeightSource, manifest: BucketManifest, msg: dict[str, Any]) -> tuple[str | None, SendStats | None]:
        """This rank's part of the sync's region delivery: (the error text, or None when it went
        well; its send's stats when it did)."""
        try:
            if self._rdzv is None or self._make is None or self._planner is None:
                raise RuntimeError("this rank is not in a weight-sync group (its join failed)")
            announced = msg["regions"]
            if not isinstance(announced, dict) or not isinstance(announced.get("layout"), list):
                raise ValueError(f"malformed region announcement from trainer rank 0: {announced!r:.200}")
            width = announced.get("width")
            if isinstance(width, bool) or not isinstance(width, int) or width < 1:
                raise ValueError(f"malformed region announcement from trainer rank 0: width must be an int >= 1, got {width!r:.40}")
            specs = manifest.specs
            layout = RegionLayout.from_wire(announced["layout"], {s.name: s for s in specs})
            owners = source.owners()
            manifests, digest = plan_sets(layout, self._planner, specs, source.num_senders, owners)
            if digest != announced.get("digest"):
                raise ValueError(f"planned region sets {digest[:12]} but trainer rank 0 planned {str(announced.get('digest'))[:12]}")
            groups = self._groups
            if groups is None or groups.digest != digest or groups.width != width:
                self.close_groups()
                sets = [(s.index, s.members) for s in layout.sets]
                groups = self._groups = RegionGroups(self._rdzv, source.sender_index, digest, sets, self._make, width=width)
            groups.join()
            tensors = sender_tensors(source, layout.sets, manifests, stable=source.stable_pieces)
            delta = DeltaRequest.from_dict(msg["delta"]) if msg["delta"] is not None else None
            stats = send_regions(groups, layout.sets, manifests, tensors, {s.name: s.shape for s in specs}, owners=owners, delta=delta)
            return None, stats
        except Exception as exc:
            logger.warning("sending rank %d: region delivery failed: %s", source.sender_index, exc)
            self.close_groups()
            return f"{type(exc).__name__}: {exc}", None

    def close_groups(self) -> None:
        groups, self._groups = self._groups, None
        if groups is not None:
            groups.close()

    def close(self) -> None:
        self.close_groups()
        self._rdzv = self._make = self._planner = None
