"""Region delivery's plan: the receive plans of every receiver rank, cut into pieces per receiver set.

Every tensor is cut along the one dimension its receivers' regions use, at every region bound;
each piece is a virtual tensor held by a set of receivers, and travels once to that set (a
broadcast over a group of the senders and those receivers). A receiver without a plan takes every
piece; receivers that cut one tensor along different dimensions all get it whole.
A pure function of (specs, plans): the controller and every sender compute the same layout.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from ckpt_engine.manifest import TensorSpec
from ckpt_engine.planning.fused_experts import fuse_plan
from ckpt_engine.planning.ownership import OwnerMap, Shard
from ckpt_engine.planning.regions import ReceivePlan, ReceivePlanError, Region

__all__ = ["MAX_RECEIVER_SETS", "Piece", "ReceiverSet", "RegionLayout", "cut_region", "piece_name"]

MAX_RECEIVER_SETS = 64
"""Receiver sets one layout may make: each is a process group (of the senders and its members)."""


def piece_name(name: str, region: Region | None) -> str:
    """A piece's virtual tensor name (the tensor's own when the piece is the whole tensor)."""
    return name if region is None else f"{name}@{region.dim}:{region.start}:{region.length}"


def cut_region(t: torch.Tensor, region: Region | None) -> torch.Tensor:
    return t if region is None else t.narrow(region.dim, region.start, region.length)


@dataclass(frozen=True)
class Piece:
    """One virtual tensor: `region` of tensor `name` (None: all of it)."""

    name: str
    region: Region | None
    spec: TensorSpec
    """Its virtual name, the wire dtype and the piece's shape."""


@dataclass(frozen=True)
class ReceiverSet:
    """Receivers (indices among the receiver ranks, ascending) that hold exactly the same pieces."""

    index: int
    members: tuple[int, ...]
    pieces: tuple[Piece, ...]

    @property
    def nbytes(self) -> int:
        return sum(p.spec.nbytes for p in self.pieces)

    def owners(self, specs: Mapping[str, TensorSpec], owners: OwnerMap | None) -> OwnerMap | None:
        """The senders' shards of each piece, from their shards of the whole tensors: a sender
        owning rows [r0, r1) (a dim-0 shard) owns those rows of a dim-0 piece, or of any other
        piece (whose rows are the tensor's). Shards not on row bounds are refused by name."""
        if owners is None:
            return None
        out: dict[str, list[Shard]] = {}
        for p in self.pieces:
            shards = owners.get(p.name)
            if shards is None:
                continue
            spec = specs[p.name]
            rows = spec.shape[0] if spec.shape else 1
            row_bytes = spec.nbytes // rows if rows else 0
            prow = p.spec.nbytes // (p.spec.shape[0] if p.spec.shape else 1) if p.spec.nbytes else 0
            lo, hi = (p.region.start, p.region.start + p.region.length) if p.region is not None and p.region.dim == 0 else (0, rows)
            mine: list[Shard] = []
            for sh in shards:
                if row_bytes == 0 or sh.start % row_bytes or sh.stop % row_bytes:
                    raise ReceivePlanError(f"{p.name}: a sender's shard [{sh.start}, {sh.stop}) is not on row bounds; regions need dim-0 shards")
                r0, r1 = max(lo, sh.start // row_bytes), min(hi, sh.stop // row_bytes)
                if r1 > r0:
                    mine.append(Shard(sh.sender, (r0 - lo) * prow, (r1 - lo) * prow))
            out[p.spec.name] = mine
        return out


@dataclass(frozen=True)
class RegionLayout:
    """The pieces of every receiver set, and what each receiver holds (its plan, resolved)."""

    sets: tuple[ReceiverSet, ...]
    held: tuple[dict[str, tuple[Region | None, ...]], ...]
    """Per receiver: name -> the regions it holds (None: the whole tensor), in plan order."""
    digest: str

    @classmethod
    def build(cls, specs: Sequence[TensorSpec], plans: Sequence[ReceivePlan | None], *, one_receiver_per_set: bool = False) -> RegionLayout:
        """Check every plan against `specs` (refused by name: ReceivePlanError) and cut the pieces.

        `one_receiver_per_set`: every set has one member, and a piece several receivers hold
        travels to each apart (for a transport whose groups take one receiver rank: nccl_handoff
        with senders on the receivers' GPUs). A plan in per-expert names meets stacked experts
        through `fuse_plan`, as the receiver does."""
        plans = [fuse_plan(p, specs) if p is not None else None for p in plans]
        for i, plan in enumerate(plans):
            if plan is not None:
                try:
                    plan.check(specs)
                except ReceivePlanError as exc:
                    raise ReceivePlanError(f"receiver rank {i}: {exc}") from None
        held: list[dict[str, tuple[Region | None, ...]]] = [{} for _ in plans]
        by_set: dict[tuple[int, ...], list[Piece]] = {}
        for spec in specs:
            regions: dict[int, tuple[Region, ...] | None] = {}
            for i, plan in enumerate(plans):
                if plan is None:
                    regions[i] = None
                elif spec.name in plan.holds:
                    regions[i] = plan.holds[spec.name]
            for i, rs in regions.items():
                held[i][spec.name] = (None,) if rs is None else tuple(rs)
            for members, region in _cut(spec, regions):
                shape = list(spec.shape)
                if region is not None:
                    shape[region.dim] = region.length
                piece = Piece(spec.name, region, TensorSpec(piece_name(spec.name, region), spec.dtype, tuple(shape)))
                for group in ([(m,) for m in members] if one_receiver_per_set else [members]):
                    by_set.setdefault(group, []).append(piece)
        if len(by_set) > MAX_RECEIVER_SETS:
            raise ReceivePlanError(f"the receive plans make {len(by_set)} receiver sets (at most {MAX_RECEIVER_SETS})")
        order = sorted(by_set, key=lambda m: (len(m), m))
        sets = tuple(ReceiverSet(k, m, tuple(by_set[m])) for k, m in enumerate(order))
        return cls(sets, tuple(held), _digest(sets))

    def to_wire(self) -> list[Any]:
        """The sets and their pieces as msgpack-ready lists (what another sender needs; not what
        each receiver holds)."""
        return [[list(s.members), [[p.name, p.region.to_wire() if p.region is not None else None] for p in s.pieces]] for s in self.sets]

    @classmethod
    def from_wire(cls, raw: Any, specs: Mapping[str, TensorSpec]) -> RegionLayout:
        """A sender's copy of the layout (`held` empty), checked against the sync's tensors."""
        if not isinstance(raw, list) or len(raw) > MAX_RECEIVER_SETS:
            raise ReceivePlanError(f"region layout must be a list of at most {MAX_RECEIVER_SETS} sets")
        sets = []
        for k, item in enumerate(raw):
            if not isinstance(item, list) or len(item) != 2 or not isinstance(item[0], list) or not isinstance(item[1], list):
                raise ReceivePlanError("region layout: each set is [members, pieces]")
            pieces = []
            for piece in item[1]:
                if not isinstance(piece, list) or len(piece) != 2 or piece[0] not in specs:
                    raise ReceivePlanError(f"region layout: a piece must name a tensor of the sync, got {piece!r:.100}")
                region = Region.from_wire(piece[0], piece[1]) if piece[1] is not None else None
                spec = specs[piece[0]]
                ReceivePlan({piece[0]: (region,) if region is not None else None}).check([spec])
                shape = list(spec.shape)
                if region is not None:
                    shape[region.dim] = region.length
                pieces.append(Piece(piece[0], region, TensorSpec(piece_name(piece[0], region), spec.dtype, tuple(shape))))
            sets.append(ReceiverSet(k, tuple(item[0]), tuple(pieces)))
        return cls(tuple(sets), (), _digest(tuple(sets)))

    def sets_of(self, receiver: int) -> list[ReceiverSet]:
        return [s for s in self.sets if receiver in s.members]

    def bytes_for(self, receiver: int) -> int:
        """Bytes receiver `receiver` takes in one dense sync."""
        return sum(s.nbytes for s in self.sets_of(receiver))


def _digest(sets: tuple[ReceiverSet, ...]) -> str:
    wire = [[list(s.members), [[p.spec.name, p.spec.dtype, list(p.spec.shape)] for p in s.pieces]] for s in sets]
    return hashlib.sha256(msgpack.packb(wire, use_bin_type=True)).hexdigest()


def _cut(spec: TensorSpec, regions: dict[int, tuple[Region, ...] | None]) -> list[tuple[tuple[int, ...], Region | None]]:
    """(holders, piece region) for every held piece of one tensor, in order along its dimension."""
    if not regions:
        return []
    dims = {r.dim for rs in regions.values() if rs is not None for r in rs}
    if not dims or len(dims) > 1:
        return [(tuple(sorted(regions)), None)]  # held whole by all, or cut along several dims
    (dim,) = dims
    size = spec.shape[dim]
    spans = {i: [(0, size)] if rs is None else [(r.start, r.start + r.length) for r in rs] for i, rs in regions.items()}
    bounds = sorted({b for ss in spans.values() for s in ss for b in s})
    out: list[tuple[tuple[int, ...], Region | None]] = []
    for lo, hi in zip(bounds, bounds[1:]):
        members = tuple(i for i in sorted(spans) if any(a <= lo and hi <= b for a, b in spans[i]))
        if members:
            out.append((members, None if (lo, hi) == (0, size) else Region(dim, lo, hi - lo)))
    return out
