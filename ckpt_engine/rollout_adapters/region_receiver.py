"""One receiving rank's side of region delivery: its plan, the assignment it accepted, its groups.

Runs inside the engine's worker beside `WeightReceiver` (which owns the whole-tensor path). At
validate it checks the controller's assignment against the engine's tensors and its own plan
(every region it holds is covered, no piece it does not hold comes its way); at receive it joins
its receiver sets' groups (once per layout and weight-sync group) and hands the loader
`(name, region, tensor)` items (`pipeline/region_assembly.py`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import torch

from ckpt_engine.delta.request import DeltaRequest
from ckpt_engine.manifest import BucketManifest, ManifestError, TensorSpec
from ckpt_engine.pipeline.region_assembly import RegionAssembly, RegionItem
from ckpt_engine.pipeline.region_groups import RegionGroups, receive_regions
from ckpt_engine.planning.fused_experts import fuse_plan
from ckpt_engine.planning.region_wire import RegionAssignment
from ckpt_engine.planning.regions import ReceivePlan, ReceivePlanError, Region
from ckpt_engine.rollout_adapters.base import ReceiveReport
from ckpt_engine.engine import CheckpointEngine, Rendezvous

__all__ = ["RegionLoader", "RegionReceiver"]

RegionLoader = Callable[[list[RegionItem]], int]
"""Loads one batch of `(name, region, tensor)` items (region None: the whole tensor; the tensor
has the region's shape); returns how many it loaded."""


class RegionReceiver:
    """Region delivery on one receiver rank (its plan None: it holds every tensor whole)."""

    def __init__(self, plan: ReceivePlan | None) -> None:
        self.plan = plan
        self._rdzv: Rendezvous | None = None
        self._rank = 0
        self._make: Callable[[], CheckpointEngine] | None = None
        self._accepted: dict[str, tuple[RegionAssignment, RegionAssembly]] = {}
        self._accepted_wire = b""
        self._groups: RegionGroups | None = None

    def joined(self, rendezvous: Rendezvous, rank: int, make_engine: Callable[[], CheckpointEngine]) -> None:
        self.left()
        self._rdzv, self._rank, self._make = rendezvous, rank, make_engine

    def left(self) -> None:
        self._accepted, self._accepted_wire = {}, b""
        self._drop_groups()

    def left_plan(self) -> None:
        """The plan changed: assignments made for the old one no longer hold."""
        self._accepted, self._accepted_wire = {}, b""

    def _drop_groups(self) -> None:
        groups, self._groups = self._groups, None
        if groups is not None:
            groups.close()

    def held(self, manifest: BucketManifest) -> dict[str, tuple[Region | None, ...]]:
        names = {s.name for s in manifest.specs}
        if self.plan is None:
            return {n: (None,) for n in names}
        plan = fuse_plan(self.plan, manifest.specs)  # a per-expert plan meets stacked experts
        return {n: (None,) if rs is None else rs for n, rs in plan.holds.items() if n in names}

    def accept(self, data: bytes, manifest: BucketManifest, expected: Mapping[str, TensorSpec] | None) -> list[str]:
        """Problems with this rank's assignment for `manifest` ([]: accepted and kept for its receive)."""
        if data == self._accepted_wire and manifest.digest in self._accepted:
            return []  # the same assignment as last sync: decoded and checked then
        specs = dict(expected) if expected is not None else {s.name: s for s in manifest.specs}
        try:
            a = RegionAssignment.from_wire(data, specs, senders=manifest.num_senders)  # the main manifest's, checked against the group
            if a.manifest_digest != manifest.digest:
                raise ReceivePlanError("region assignment belongs to another manifest")
            if self._rdzv is not None and a.receiver != self._rank - self._rdzv.num_senders:
                raise ReceivePlanError(f"region assignment is for receiver {a.receiver}, this is receiver {self._rank - self._rdzv.num_senders}")
            pieces = [p for s in a.sets for p in s.pieces]
            asm = RegionAssembly(self.held(manifest), pieces, specs)
            stray = [p.spec.name for p in pieces if p.spec.name not in asm.direct and p.spec.name not in asm.parts]
            if stray:
                raise ReceivePlanError(f"region assignment sends {stray[0]!r}, which this rank does not hold ({len(stray)} such pieces)")
        except (ReceivePlanError, ManifestError) as exc:
            return [f"region assignment: {exc}"]
        self._accepted, self._accepted_wire = {manifest.digest: (a, asm)}, data
        return []

    def has(self, digest: str) -> bool:
        return digest in self._accepted

    def receive(
        self, digest: str, loader: RegionLoader, destinations: Mapping[str, torch.Tensor] | None, delta: DeltaRequest | None,
        stats: dict[str, float],
    ) -> ReceiveReport:
        """Every set of the accepted assignment, into `loader` (see `receive_regions`)."""
        a, asm = self._accepted[digest]
        if self._rdzv is None or self._make is None:
            raise RuntimeError("call join() before receive()")
        if self._groups is None or self._groups.digest != a.digest:
            self._drop_groups()
            self._groups = RegionGroups(self._rdzv, self._rank, a.digest, [(s.index, s.members) for s in a.sets], self._make)
        groups = self._groups
        t0 = time.perf_counter()
        load_s, loaded, items = 0.0, 0, 0
        try:
            groups.join()
            for batch in receive_regions(groups, {s.index: s.manifest for s in a.sets}, asm, destinations, delta):
                t1 = time.perf_counter()
                loaded += loader(batch)
                load_s += time.perf_counter() - t1
                items += len(batch)
                stats["buckets"] = stats.get("buckets", 0) + 1
        except BaseException:
            self._drop_groups()  # broken: the next sync joins afresh
            raise
        extra: dict[str, float] = {"region_sets": float(len(a.sets))}
        if delta is not None:
            for engine in groups.engines.values():
                for k, v in engine.last_delta_stats.items():
                    extra[f"delta_{k}"] = extra.get(f"delta_{k}", 0.0) + float(v)
        return ReceiveReport(items, a.nbytes, time.perf_counter() - t0, load_s, loaded, extra)
