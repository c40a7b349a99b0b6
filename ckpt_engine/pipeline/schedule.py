"""The per-manifest schedule of a pipelined transfer: which buffer each bucket uses.

A pure function of (manifest, num_buffers), computed once per plan and cached, so the
send and receive loops never re-derive it per sync. Every sender streams its own buckets through
its own rotating buffers; receivers hold `num_buffers` buffers per sender and consume each
sender's buckets in its order (the planner interleaves senders round-robin; on the host path a
receiver takes whichever sender's next bucket lands first, see receive_order.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ckpt_engine.manifest import DTYPE_ITEMSIZE, Bucket, BucketManifest

__all__ = ["Schedule", "Step"]


@dataclass(frozen=True)
class Step:
    """One bucket's place in the pipeline."""

    bucket: Bucket
    ordinal: int
    """Position among its sender's buckets."""
    sender_slot: int
    """The sender's rotating buffer: ordinal % num_buffers."""
    slot: int
    """The receivers' rotating buffer: sender * num_buffers + ordinal % num_buffers."""
    refill: int | None
    """The bucket (manifest index) that reuses this one's receive buffer, posted once it is consumed."""
    word_bytes: int
    """gcd of the itemsizes in the bucket: the unit a delta patch compares."""


class Schedule:
    """Steps for every bucket plus, per sender, the start byte of each piece it sends."""

    def __init__(self, manifest: BucketManifest, num_buffers: int) -> None:
        self.digest = manifest.digest
        self.num_senders = manifest.num_senders
        ordinals = [0] * manifest.num_senders
        by_sender: list[list[int]] = [[] for _ in range(manifest.num_senders)]
        partial: list[tuple[Bucket, int]] = []
        for b in manifest.buckets:
            partial.append((b, ordinals[b.sender]))
            by_sender[b.sender].append(b.index)
            ordinals[b.sender] += 1
        self.steps: list[Step] = []
        for b, o in partial:
            own = by_sender[b.sender]
            refill = own[o + num_buffers] if o + num_buffers < len(own) else None
            word = math.gcd(8, *(DTYPE_ITEMSIZE[e.dtype] for e in b.entries))
            self.steps.append(
                Step(b, o, o % num_buffers, b.sender * num_buffers + o % num_buffers, refill, word)
            )
        self.first_posts = sorted(i for own in by_sender for i in own[:num_buffers])
        self.by_sender = by_sender
        # Start byte of each (sender, tensor) piece: where the sender's local tensor begins, and its
        # bytes; bytes of each tensor: a tensor is complete on a receiver when all of them have landed.
        self.piece_start: dict[tuple[int, str], int] = {}
        self.piece_bytes: dict[tuple[int, str], int] = {}
        self.tensor_bytes: dict[str, int] = {}
        for b in manifest.buckets:
            for e in b.entries:
                key = (b.sender, e.name)
                self.piece_start.setdefault(key, e.chunk_offset)
                self.piece_bytes[key] = self.piece_bytes.get(key, 0) + e.chunk_size
                self.tensor_bytes[e.name] = e.nbytes
