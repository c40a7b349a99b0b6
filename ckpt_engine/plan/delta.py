"""Bytes a delta sync puts on the wire, given the fraction of elements that changed.

A delta carries the changed values plus where they are: either their positions (int32 offsets,
int64 past 2**31 elements) or a bitmask of one bit per element, whichever is smaller. Positions
win below 1/32 changed (int32): 4 bytes per change against 1/8 byte per element. ckpt-engine's
codec (`delta/layout.py`) patches each bucket as one image of words of the dtype's size, with a
32-byte header per bucket, and sends a bucket dense when its patch would not be smaller; this
model picks the index once for the whole model and counts a header per tensor (an upper bound on
headers, negligible beside the values either way).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DeltaBytes", "delta_wire_bytes"]

HEADER_BYTES = 16  # per tensor: count + encoding tag, aligned


@dataclass(frozen=True)
class DeltaBytes:
    """Wire bytes of a delta and which index encoding they assume."""

    wire_bytes: int
    value_bytes: int
    index_bytes: int
    encoding: str

    def ratio(self, dense_bytes: int) -> float:
        return self.wire_bytes / dense_bytes if dense_bytes else 0.0


def delta_wire_bytes(dense_bytes: int, itemsize: int, fraction: float, num_tensors: int) -> DeltaBytes:
    """``dense_bytes x fraction x (itemsize + index bytes) / itemsize`` plus per-tensor headers,
    with the index as positions or a bitmask, whichever is smaller."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"--delta must be a changed fraction in [0, 1], got {fraction!r}")
    if itemsize < 1 or dense_bytes < 0 or num_tensors < 0:
        raise ValueError("delta_wire_bytes needs itemsize >= 1 and non-negative sizes")
    numel = dense_bytes // itemsize
    values = round(numel * fraction) * itemsize
    pos_width = 4 if numel / max(num_tensors, 1) < 2**31 else 8
    positions = round(numel * fraction) * pos_width
    bitmask = -(-numel // 8)
    index, encoding = (positions, "positions") if positions <= bitmask else (bitmask, "bitmask")
    return DeltaBytes(values + index + HEADER_BYTES * num_tensors, values, index, encoding)
