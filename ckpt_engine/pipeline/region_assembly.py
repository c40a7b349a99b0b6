"""A receiver's regions from the pieces it takes: what the engine's loader gets in region delivery.

Each held region must be covered whole by the pieces of its receiver sets: an assignment leaving
any row unfilled is refused when accepted (issue 45: rows no piece filled used to be handed over
uninitialised). A piece that is exactly one of its regions is handed over as it landed; otherwise
the overlaps are copied into a region-shaped tensor (the loader's own where the sync may write in
place). Items are `(name, region, tensor)`, region None for a whole tensor.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from ckpt_engine.manifest import TensorSpec
from ckpt_engine.sources.wire import torch_dtype
from ckpt_engine.planning.receive_sets import Piece
from ckpt_engine.planning.regions import ReceivePlanError, Region

__all__ = ["RegionAssembly", "RegionItem"]

RegionItem = tuple[str, Region | None, torch.Tensor]
"""What a receiver with a plan hands its engine's loader: one item per region it holds."""


def _extent(spec: TensorSpec, region: Region | None, dim: int) -> tuple[int, int]:
    if region is None or region.dim != dim:
        return 0, spec.shape[dim]
    return region.start, region.start + region.length


@dataclass(frozen=True)
class _Part:
    """Where one piece lands in one region: the piece's sub-slice and the region's sub-slice."""

    key: tuple[str, Region | None]
    dim: int
    src_start: int
    dst_start: int
    length: int


class RegionAssembly:
    """Per receiver and layout: which of its regions each piece fills (built once per layout)."""

    def __init__(self, held: Mapping[str, tuple[Region | None, ...]], pieces: Iterable[Piece], specs: Mapping[str, TensorSpec]) -> None:
        self.specs = specs
        self.direct: dict[str, tuple[str, Region | None]] = {}
        self.parts: dict[str, list[_Part]] = {}
        self.count: dict[tuple[str, Region | None], int] = {}
        for p in pieces:
            spec = specs[p.name]
            for region in held.get(p.name, ()):
                if region == p.region:
                    self.direct[p.spec.name] = (p.name, region)
                    continue
                if region is not None and p.region is not None and region.dim != p.region.dim:
                    raise ReceivePlanError(f"{p.name}: piece {p.region} and region {region} cut different dimensions")
                dim = region.dim if region is not None else (p.region.dim if p.region is not None else 0)
                (a, b), (c, d) = _extent(spec, p.region, dim), _extent(spec, region, dim)
                lo, hi = max(a, c), min(b, d)
                if hi <= lo:
                    continue
                self.parts.setdefault(p.spec.name, []).append(_Part((p.name, region), dim, lo - a, lo - c, hi - lo))
                self.count[(p.name, region)] = self.count.get((p.name, region), 0) + 1
        self._check_covered(held)

    def _check_covered(self, held: Mapping[str, tuple[Region | None, ...]]) -> None:
        """Every region held is filled whole by the pieces (issue 45): a region a piece only
        overlaps would hand the loader rows no piece wrote (uninitialised, or the old version's)."""
        spans: dict[tuple[str, Region | None], list[tuple[int, int, int]]] = {}
        for parts in self.parts.values():
            for part in parts:
                spans.setdefault(part.key, []).append((part.dim, part.dst_start, part.dst_start + part.length))
        direct = set(self.direct.values())
        for name, regions in held.items():
            for region in regions:
                key = (name, region)
                if key in direct:
                    continue
                if key not in spans:
                    raise ReceivePlanError(f"{name}: {_words(region)} is covered by no piece this receiver takes")
                dims = sorted({d for d, _, _ in spans[key]})
                if len(dims) > 1:
                    raise ReceivePlanError(f"{name}: the pieces this receiver takes of {_words(region)} cut dimensions {dims}")
                dim = dims[0]
                extent = region.length if region is not None else self.specs[name].shape[dim]
                gaps = _gaps(sorted((lo, hi) for _, lo, hi in spans[key]), extent)
                if gaps:
                    start = region.start if region is not None and region.dim == dim else 0
                    missing = ", ".join(f"[{start + lo}, {start + hi})" for lo, hi in gaps[:3])
                    raise ReceivePlanError(
                        f"{name}: the pieces this receiver takes do not cover {_words(region)}: rows {missing} of dim {dim} "
                        f"({len(gaps)} gap(s)) would keep old or uninitialised values; the controller's receive plan "
                        "for this rank does not match what it holds"
                    )

    def nbytes(self, pieces: Iterable[Piece]) -> int:
        return sum(p.spec.nbytes for p in pieces if p.spec.name in self.direct or p.spec.name in self.parts)

    def destinations(self, destinations: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        """Per piece name, the loader's own tensor it may land in (a direct piece of that shape)."""
        out: dict[str, torch.Tensor] = {}
        if destinations is None:
            return out
        for vname, (name, region) in self.direct.items():
            dest = destinations.get(name)
            if dest is not None and tuple(dest.shape) == self._shape(name, region):
                out[vname] = dest
        return out

    def _shape(self, name: str, region: Region | None) -> tuple[int, ...]:
        shape = list(self.specs[name].shape)
        if region is not None:
            shape[region.dim] = region.length
        return tuple(shape)

    def start(self, destinations: Mapping[str, torch.Tensor] | None) -> _Landing:
        """One sync's landing: assembled regions go into the loader's tensor of that shape when
        `destinations` names one (pass None to keep the loader's tensors untouched), else into new ones."""
        return _Landing(self, destinations)


def _words(region: Region | None) -> str:
    return "the whole tensor" if region is None else f"region [{region.start}, {region.start + region.length}) of dim {region.dim}"


def _gaps(spans: list[tuple[int, int]], extent: int) -> list[tuple[int, int]]:
    """The parts of [0, extent) that no span (sorted) covers."""
    gaps: list[tuple[int, int]] = []
    reached = 0
    for lo, hi in spans:
        if lo > reached:
            gaps.append((reached, lo))
        reached = max(reached, hi)
    if reached < extent:
        gaps.append((reached, extent))
    return gaps


class _Landing:
    def __init__(self, asm: RegionAssembly, destinations: Mapping[str, torch.Tensor] | None) -> None:
        self.asm = asm
        self.dests = destinations
        self.left = dict(asm.count)
        self.buffers: dict[tuple[str, Region | None], torch.Tensor] = {}

    def land(self, vname: str, tensor: torch.Tensor) -> list[RegionItem]:
        """The items piece `vname` completes (it landed as `tensor`, the piece's shape)."""
        out: list[RegionItem] = []
        direct = self.asm.direct.get(vname)
        if direct is not None:
            out.append((direct[0], direct[1], tensor))
        for part in self.asm.parts.get(vname, ()):
            buf = self.buffers.get(part.key)
            if buf is None:
                name, region = part.key
                shape = self.asm._shape(name, region)
                dest = self.dests.get(name) if self.dests is not None else None
                if dest is None or tuple(dest.shape) != shape or dest.dtype != tensor.dtype or not dest.is_contiguous():
                    dest = torch.empty(shape, dtype=torch_dtype(self.asm.specs[name].dtype), device=tensor.device)
                buf = self.buffers[part.key] = dest
            buf.narrow(part.dim, part.dst_start, part.length).copy_(tensor.narrow(part.dim, part.src_start, part.length))
            self.left[part.key] -= 1
            if self.left[part.key] == 0:
                out.append((part.key[0], part.key[1], self.buffers.pop(part.key)))
        return out

