"""What each rank of a delta sync keeps between syncs: the base of every bucket and its checksum.

A sender keeps each of its buckets' wire bytes at the last sync (`images`, in device memory: 1/S
of the model on each of S senders). A receiver keeps them the same way, or, when its loader's own
tensors hold every entry in the wire layout (`inplace`), keeps nothing but checksums and stamps:
its weights are the base, and patches are checked and applied where they live.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ckpt_engine.delta.request import DeltaRequest
from ckpt_engine.manifest import BucketManifest
from ckpt_engine.engine import TransferError
from ckpt_engine.transports.transport import Frames, Transport

__all__ = ["DENSE", "FRAME_WORDS", "PATCH", "SEAL_WORD", "Bases", "bases_for", "frame_seal", "frames_of", "stamp_of"]

DENSE, PATCH = 0, 1
FRAME_WORDS = 8  # a bucket's frame header: kind, bytes, checksum of the result, a patch's 32-byte header, the seal
SEAL_WORD = 7
"""Where the frame header keeps its seal (`frame_seal`)."""


def frames_of(transport: Transport) -> Frames:
    """The transport's delta frames (the engine refused a delta sync where it carries none)."""
    frames = transport.frames
    assert frames is not None
    return frames


def frame_seal(kind: int, size: int, bucket_index: int, sync_id: int) -> int:
    """The seal of a frame header: a 64-bit mix (splitmix64 rounds) of the two fields that size
    the payload (kind, bytes), bound to the bucket and the sync. The sender writes it from the
    very values it sizes the payload with; a receiver posts a payload only under a header whose
    seal matches, so a header corrupted on its own (its size no longer what the sender posts)
    is refused before anything is posted: gloo aborts a process whose receive size differs from
    what arrives, so no size may come from an unchecked header."""
    x = 0
    for word in (kind, size, bucket_index, sync_id):
        x = (x ^ (word & _MASK64)) + 0x9E3779B97F4A7C15 & _MASK64
        x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
        x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
        x ^= x >> 31
    return x - (1 << 64) if x >= 1 << 63 else x  # as the int64 the header holds


_MASK64 = (1 << 64) - 1


@dataclass
class Bases:
    """Bases of the buckets this rank sends (by ordinal) or receives (by manifest index)."""

    digest: str | None = None
    sync_id: int | None = None
    inplace: bool = False
    images: dict[int, torch.Tensor] = field(default_factory=dict)
    sums: dict[int, torch.Tensor | None] = field(default_factory=dict)
    calm: set[int] = field(default_factory=set)
    """Sender buckets whose last patch changed fewer than 1 word in 32: diffed in one pass from
    the source tensors. The others (and every bucket at first) are packed and encoded by the
    codec (the same diff over the packed image, dense where a patch would not be smaller)."""
    stamps: dict[str, tuple[int, int]] = field(default_factory=dict)
    """In-place receivers: (data_ptr, version counter) of each destination after the last sync;
    a tensor changed since then (by anything but a sync) is no longer the base."""
    tables: dict[int, dict[str, Any]] = field(default_factory=dict)
    """Senders: per bucket, the one-pass diff's device table of its pieces (direct_kernels.py),
    reused while the source tensors stay where they are."""

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in self.images.values())


def bases_for(
    current: Bases, manifest: BucketManifest, delta: DeltaRequest, keys: list[tuple[int, int]], *,
    inplace: bool, rank: int | None, device: torch.device,
) -> Bases:
    """The bases for this sync: `current` checked against the request, or new ones for a first
    (dense) sync of a plan, or a receiver whose destinations start or stop holding the base
    (`inplace`)."""
    b = current
    if delta.patches:
        if b.digest != manifest.digest or b.sync_id != delta.base_id or b.inplace != inplace:
            held = b.sync_id if b.digest == manifest.digest else None
            where = "" if b.inplace == inplace else (
                " (held in the loader's tensors, which this sync does not offer)" if b.inplace else " (held in base copies, not the loader's tensors)"
            )
            raise TransferError(
                f"rank {rank}: asked to patch against base {delta.base_id}, but this rank's bases hold "
                f"{held if held is not None else 'nothing valid'} for this plan{where}; the sync must be dense"
            )
    elif b.digest != manifest.digest or b.inplace != inplace:
        b = Bases(digest=manifest.digest, inplace=inplace)
        for key, nbytes in keys:
            if not inplace:
                b.images[key] = torch.zeros(nbytes, dtype=torch.uint8, device=device)
            b.sums[key] = None
    b.sync_id = None  # until this sync completes on this rank
    return b


def stamp_of(t: torch.Tensor) -> tuple[int, int]:
    """A destination's entry in `Bases.stamps`."""
    return t.data_ptr(), t._version
