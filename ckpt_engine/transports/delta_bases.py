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

__all__ = ["DELTA_BASES", "DENSE", "FRAME_WORDS", "PATCH", "Bases"]

DENSE, PATCH = 0, 1
FRAME_WORDS = 7  # a bucket's frame header: kind, bytes, checksum of the result, a patch's 32-byte header
DELTA_BASES = ("device", "host", "cast")  # where a sender keeps its bases (engine option `delta_base`; cast: none)


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
    codec, whose bitmask index is smaller when many words change."""
    stamps: dict[str, tuple[int, int]] = field(default_factory=dict)
    """In-place receivers: (data_ptr, version counter) of each destination after the last sync;
    a tensor changed since then (by anything but a sync) is no longer the base."""
    tables: dict[int, dict[str, Any]] = field(default_factory=dict)
    """Senders: per bucket, the one-pass diff's device table of its pieces (direct_kernels.py),
    reused while the source tensors stay where they are."""

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in self.images.values())
