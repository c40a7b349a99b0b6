"""Bytes a delta sync puts on the wire, given the fraction of elements that changed.

A patch carries the changed values plus their positions, int32 offsets (the codec's one patch
kind, `delta/layout.py`): itemsize + 4 bytes per changed element. The codec patches each bucket as
one image of words of the dtype's size, with a 32-byte header per bucket, and sends a bucket dense
when its patch would not be smaller (bf16: from 1/3 of the words changed). This model applies that
rule to the whole model at once and counts a header per tensor (an upper bound on headers,
negligible beside the values either way).
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
    """``dense_bytes x fraction x (itemsize + 4) / itemsize`` plus per-tensor headers, or the dense
    bytes where that patch would not be smaller."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"--delta must be a changed fraction in [0, 1], got {fraction!r}")
    if itemsize < 1 or dense_bytes < 0 or num_tensors < 0:
        raise ValueError("delta_wire_bytes needs itemsize >= 1 and non-negative sizes")
    changed = round(dense_bytes // itemsize * fraction)
    values, positions = changed * itemsize, changed * 4
    if values + positions >= dense_bytes:
        return DeltaBytes(dense_bytes, dense_bytes, 0, "dense")
    return DeltaBytes(values + positions + HEADER_BYTES * num_tensors, values, positions, "positions")
