"""What the controller tells one receiver rank of region delivery, as msgpack (never pickle).

Per receiver set the rank belongs to: the set's index and members (its group), the set's bucket
manifest of pieces, and which region of which tensor each piece is. Decoded with size limits and
checked against the tensors the engine expects before it is accepted: it comes from another
process and decides where received bytes are written.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgpack

from ckpt_engine.manifest import MAX_ENTRIES, BucketManifest, ManifestBudget, TensorSpec, decode_manifest, encode_manifest
from ckpt_engine.planning.receive_sets import MAX_RECEIVER_SETS, Piece, ReceiverSet, piece_name
from ckpt_engine.planning.regions import ReceivePlanError, Region

__all__ = ["RegionAssignment", "SetAssignment"]

MAX_SET_MEMBERS = 1 << 16


@dataclass(frozen=True)
class SetAssignment:
    """One receiver set as one of its members sees it."""

    index: int
    members: tuple[int, ...]
    manifest: BucketManifest
    pieces: tuple[Piece, ...]


@dataclass(frozen=True)
class RegionAssignment:
    """One receiver rank's sets for the sync whose (whole-tensor) manifest is `manifest_digest`."""

    digest: str
    """The layout and its manifests: what the delta chain and the cached groups are keyed by."""
    manifest_digest: str
    receiver: int
    sets: tuple[SetAssignment, ...]

    @property
    def nbytes(self) -> int:
        return sum(p.spec.nbytes for s in self.sets for p in s.pieces)

    @classmethod
    def of(cls, digest: str, manifest_digest: str, receiver: int, sets: list[ReceiverSet], manifests: Mapping[int, BucketManifest]) -> RegionAssignment:
        return cls(digest, manifest_digest, receiver, tuple(SetAssignment(s.index, s.members, manifests[s.index], s.pieces) for s in sets))

    def to_wire(self) -> bytes:
        sets = [
            [s.index, list(s.members), encode_manifest(s.manifest), [[p.name, p.region.to_wire() if p.region is not None else None] for p in s.pieces]]
            for s in self.sets
        ]
        return msgpack.packb({"digest": self.digest, "manifest": self.manifest_digest, "receiver": self.receiver, "sets": sets}, use_bin_type=True)

    @classmethod
    def from_wire(cls, data: bytes, expected: Mapping[str, TensorSpec], *, senders: int = 1) -> RegionAssignment:
        """Decode and check against the engine's tensors (`expected`, global shapes): every piece
        names a tensor it has and lies inside it, and every set's manifest carries exactly its
        pieces (each decoded within the budget of its pieces from `senders`, the group's)."""
        try:
            raw = msgpack.unpackb(data, raw=False, max_ext_len=0, max_array_len=MAX_ENTRIES, max_map_len=8)
        except Exception as exc:
            raise ReceivePlanError(f"region assignment: not valid msgpack ({exc})") from None
        if not isinstance(raw, dict) or set(raw) != {"digest", "manifest", "receiver", "sets"}:
            raise ReceivePlanError("region assignment must be a map of digest, manifest, receiver, sets")
        sets_raw = raw["sets"]
        if not isinstance(sets_raw, list) or len(sets_raw) > MAX_RECEIVER_SETS:
            raise ReceivePlanError(f"region assignment: sets must be a list of at most {MAX_RECEIVER_SETS}")
        if not all(isinstance(raw[k], str) for k in ("digest", "manifest")) or not isinstance(raw["receiver"], int):
            raise ReceivePlanError("region assignment: digest and manifest must be strings, receiver an int")
        sets = []
        for item in sets_raw:
            if not isinstance(item, list) or len(item) != 4:
                raise ReceivePlanError("region assignment: each set is [index, members, manifest, pieces]")
            index, members, encoded, pieces_raw = item
            if not isinstance(index, int) or not isinstance(members, list) or not 0 < len(members) <= MAX_SET_MEMBERS:
                raise ReceivePlanError(f"region assignment: set {index!r:.20} has no valid index or members")
            if raw["receiver"] not in members or not all(isinstance(m, int) for m in members) or members != sorted(set(members)):
                raise ReceivePlanError(f"region assignment: set {index} does not list this receiver ({raw['receiver']}) among sorted members")
            if not isinstance(pieces_raw, list) or not isinstance(encoded, bytes):
                raise ReceivePlanError(f"region assignment: set {index} needs a manifest and a list of pieces")
            pieces = tuple(_piece(p, expected) for p in pieces_raw)
            budget = ManifestBudget.expecting([p.spec for p in pieces], senders=senders)
            manifest = decode_manifest(encoded, budget)
            specs = {s.name: s for s in manifest.specs}
            if specs != {p.spec.name: p.spec for p in pieces}:
                raise ReceivePlanError(f"region assignment: set {index}'s manifest does not carry exactly its pieces")
            sets.append(SetAssignment(index, tuple(members), manifest, pieces))
        return cls(raw["digest"], raw["manifest"], raw["receiver"], tuple(sets))


def _piece(value: Any, expected: Mapping[str, TensorSpec]) -> Piece:
    if not isinstance(value, list) or len(value) != 2 or not isinstance(value[0], str):
        raise ReceivePlanError(f"region assignment: a piece is [name, region or nil], got {value!r:.100}")
    name, region_raw = value
    spec = expected.get(name)
    if spec is None:
        raise ReceivePlanError(f"region assignment names tensor {name!r}, which this engine does not have")
    region = Region.from_wire(name, region_raw) if region_raw is not None else None
    shape = list(spec.shape)
    if region is not None:
        if not 0 <= region.dim < len(shape) or region.length < 1 or region.start < 0 or region.start + region.length > shape[region.dim]:
            raise ReceivePlanError(f"region assignment: region {region} of {name!r} lies outside its shape {list(spec.shape)}")
        shape[region.dim] = region.length
    return Piece(name, region, TensorSpec(piece_name(name, region), spec.dtype, tuple(shape)))
