"""Land received regions through an engine's own loader, exactly as the full tensors would land.

A receiver with a receive plan gets `(name, region, tensor)` items, `tensor` shaped like the region
(the global shape with `region.dim` cut to `region.length`). The engine's loader (vLLM's
`load_weights`, its TP narrowing, its CPU repacking through layerwise reload) wants global-shaped
tensors; it reads only the regions the plan was recorded from. So each name gets one scratch tensor
of its global shape, the regions are copied in where they belong, and once all of a name's regions
are there the scratch goes to the loader: it narrows exactly the filled part. The rest of the scratch
is never read (uninitialised, or NaN with `poison=True` to prove it in tests). On CPU, pages never
written are never touched, so the scratch costs what the regions cost.
"""

from __future__ import annotations

from collections.abc import Mapping
from math import prod

import torch

from ckpt_engine.manifest import TensorSpec
from ckpt_engine.planning.regions import ReceivePlan, ReceivePlanError, Region

__all__ = ["RegionAssembler", "held_bytes"]


def held_bytes(plan: ReceivePlan, specs: Mapping[str, TensorSpec]) -> int:
    """Bytes a rank receives under `plan` (whole tensors at full size)."""
    total = 0
    for name, regions in plan.holds.items():
        spec = specs[name]
        itemsize = torch.empty((), dtype=getattr(torch, spec.dtype)).element_size()
        numel = prod(spec.shape)
        if regions is None:
            total += numel * itemsize
        else:
            total += sum(r.length * (numel // spec.shape[r.dim]) for r in regions) * itemsize
    return total


class RegionAssembler:
    """Collects one sync's region items per name; hands back (name, global-shaped tensor) once
    every region of the name has arrived. One per receive; not thread-safe."""

    def __init__(self, plan: ReceivePlan, specs: Mapping[str, TensorSpec], device: torch.device, *, poison: bool = False) -> None:
        self.plan, self.specs, self.device, self.poison = plan, specs, device, poison
        self._scratch: dict[str, torch.Tensor] = {}
        self._missing: dict[str, set[Region]] = {}

    def add(self, name: str, region: Region | None, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """Take one item; returns the (name, tensor) pairs now ready for the loader (maybe none)."""
        if region is None:
            return [(name, tensor)]
        spec = self.specs.get(name)
        regions = self.plan.holds.get(name)
        if spec is None or not regions or region not in regions:
            raise ReceivePlanError(f"received region {region.to_wire()} of {name!r}, which this rank's receive plan does not hold")
        want = tuple(region.length if d == region.dim else n for d, n in enumerate(spec.shape))
        if tuple(tensor.shape) != want:
            raise ReceivePlanError(f"received region {region.to_wire()} of {name!r} with shape {list(tensor.shape)}, expected {list(want)}")
        scratch = self._scratch.get(name)
        if scratch is None:
            dtype = getattr(torch, spec.dtype)
            scratch = torch.empty(spec.shape, dtype=dtype, device=self.device)
            if self.poison:
                scratch.fill_(float("nan") if dtype.is_floating_point else -1)
            self._scratch[name] = scratch
            self._missing[name] = set(regions)
        missing = self._missing[name]
        if region not in missing:
            raise ReceivePlanError(f"received region {region.to_wire()} of {name!r} twice in one sync")
        scratch.narrow(region.dim, region.start, region.length).copy_(tensor)
        missing.discard(region)
        if missing:
            return []
        del self._missing[name]
        return [(name, self._scratch.pop(name))]

    def incomplete(self) -> list[str]:
        """Names with some regions still missing (a receive that ends with any is broken)."""
        return sorted(self._missing)
