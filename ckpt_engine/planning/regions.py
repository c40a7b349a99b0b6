"""Receive plans: which parts of which tensors one engine rank holds.

A TP rank keeps a row or column range of most tensors, an EP rank only its experts, every rank
the replicated ones whole. A rank states it once at join time, so senders deliver only those
bytes; the plan comes from another process, so it is validated against the sync's tensors before
any engine pauses. A region is a range along one dimension of a tensor's global (HF) shape; a
name mapped to `None` is held whole, an absent name is not needed at all.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ckpt_engine.manifest import MAX_ENTRIES, MAX_NDIM, TensorSpec

__all__ = ["ReceivePlan", "ReceivePlanError", "Region"]


class ReceivePlanError(ValueError):
    """A receive plan names a tensor, a dimension or a range that does not fit the sync's tensors."""


@dataclass(frozen=True, order=True)
class Region:
    """Elements [start, start + length) along dimension `dim` of one tensor (all of the others)."""

    dim: int
    start: int
    length: int

    def to_wire(self) -> list[int]:
        return [self.dim, self.start, self.length]

    @classmethod
    def from_wire(cls, name: str, value: Any) -> Region:
        if (
            not isinstance(value, (list, tuple))
            or len(value) != 3
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        ):
            raise ReceivePlanError(f"receive plan: region of {name!r} must be [dim, start, length] ints, got {value!r:.100}")
        return cls(*value)


@dataclass(frozen=True)
class ReceivePlan:
    """What one engine rank holds: name -> its regions (sorted, disjoint), or None for the whole tensor."""

    holds: Mapping[str, tuple[Region, ...] | None]

    def check(self, specs: Iterable[TensorSpec]) -> None:
        """Refuse, naming the tensor, a plan that does not fit `specs` (the sync's tensors)."""
        by_name = {s.name: s for s in specs}
        for name, regions in self.holds.items():
            spec = by_name.get(name)
            if spec is None:
                raise ReceivePlanError(
                    f"receive plan names tensor {name!r}, which this sync does not carry (a sync with receive plans carries "
                    "every tensor the engine ranks hold: sync the whole model, or the plan names a tensor the model lacks)"
                )
            if regions is None:
                continue
            if not regions:
                raise ReceivePlanError(f"receive plan: {name!r} lists no region (leave it out, or hold it whole)")
            dims = {r.dim for r in regions}
            if len(dims) != 1:
                raise ReceivePlanError(f"receive plan: regions of {name!r} span several dimensions {sorted(dims)}")
            (dim,) = dims
            if not 0 <= dim < len(spec.shape):
                raise ReceivePlanError(f"receive plan: {name!r} has no dimension {dim} (shape {list(spec.shape)})")
            end = 0
            for r in sorted(regions):
                if r.length < 1 or r.start < 0 or r.start + r.length > spec.shape[dim]:
                    raise ReceivePlanError(
                        f"receive plan: region [{r.start}, {r.start + r.length}) of {name!r} lies outside "
                        f"dimension {dim} of size {spec.shape[dim]}"
                    )
                if r.start < end:
                    raise ReceivePlanError(f"receive plan: regions of {name!r} overlap at dimension {dim} index {r.start}")
                end = r.start + r.length

    def to_wire(self) -> dict[str, Any]:
        """A msgpack-ready map (never pickle)."""
        return {n: None if rs is None else [r.to_wire() for r in rs] for n, rs in self.holds.items()}

    @classmethod
    def from_wire(cls, value: Any) -> ReceivePlan:
        """Decode with type and size checks; `check` then fits it to the sync's tensors."""
        if not isinstance(value, dict):
            raise ReceivePlanError(f"receive plan must be a map of tensor name -> regions, got {type(value).__name__}")
        if len(value) > MAX_ENTRIES:
            raise ReceivePlanError(f"receive plan lists {len(value)} tensors (at most {MAX_ENTRIES})")
        holds: dict[str, tuple[Region, ...] | None] = {}
        for name, regions in value.items():
            if not isinstance(name, str):
                raise ReceivePlanError(f"receive plan: tensor names must be strings, got {name!r:.100}")
            if regions is None:
                holds[name] = None
                continue
            if not isinstance(regions, (list, tuple)) or len(regions) > MAX_NDIM * 64:
                raise ReceivePlanError(f"receive plan: regions of {name!r} must be a short list, got {regions!r:.100}")
            holds[name] = tuple(sorted(Region.from_wire(name, r) for r in regions))
        return cls(holds)
