"""Walks a sender's weight source along its own manifest entries.

One yielded tensor per piece the sender owns (the whole tensor with one sender, else its shard or
a replicated tensor it slices), and for each entry the bytes it sends from it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch

from ckpt_engine.backends.wire_views import flat_bytes, has_wire_layout, next_weight, torch_dtype
from ckpt_engine.engine import SendStats
from ckpt_engine.manifest import TensorMeta

__all__ = ["PieceReader"]


class PieceReader:
    """Walks the weight source along one sender's entries: one yielded tensor per piece it owns
    (the whole tensor, or its shard), and the bytes of each entry within it."""

    def __init__(self, it: Iterator[tuple[str, torch.Tensor]], sched: Any, sender: int, device: torch.device, stats: SendStats) -> None:
        self.it, self.sched, self.sender, self.device, self.stats = it, sched, sender, device, stats
        self.current: torch.Tensor | None = None
        self.flat: torch.Tensor | None = None
        self.flat_is_source = False  # `flat` aliases the caller's tensor (no conversion temporary)
        self.base = 0

    def source(self, e: TensorMeta) -> tuple[torch.Tensor, bool]:
        """(what entry `e` sends, whether that is the caller's own memory in the wire layout)."""
        key = (self.sender, e.name)
        start = self.sched.piece_start[key]
        if e.chunk_offset == start:
            piece = self.sched.piece_bytes[key]
            t0 = time.perf_counter()
            self.current = next_weight(self.it, e, None if piece == e.nbytes else piece)
            self.stats.export_s += time.perf_counter() - t0
            self.flat = None
            # Byte 0 of what was yielded: the tensor's own for a whole (replicated) tensor, the
            # piece's start for a shard.
            self.base = 0 if tuple(self.current.shape) == e.shape else start
        current = self.current
        assert current is not None
        if e.is_whole:
            return current, has_wire_layout(current, e, self.device)
        if self.flat is None:
            converted = current.to(device=self.device, dtype=torch_dtype(e.dtype)).contiguous()
            self.flat_is_source = converted.data_ptr() == current.data_ptr()
            self.flat = flat_bytes(converted)
        lo = e.chunk_offset - self.base
        # Never a conversion temporary: on CUDA the allocator could hand its memory to the next
        # allocation while the collective still reads it.
        return self.flat[lo : lo + e.chunk_size], self.flat_is_source
