"""Many same-device tensor copies in one Triton launch, from a table built once per set of pairs.

A colocated receiver copies the same pairs (the sender's mapped tensors into the engine's live
parameters) at every sync. Per-tensor `copy_` pays a launch per pair and leaves the GPU idle
between small ones; `_foreach_copy_` batches them but cuts every tensor into small pieces over many
launches. On one H200 (`bench/colocated_copy_probe.py`) a 7B model's 339 tensors copied at 0.93 x
a flat copy of their bytes the old way (large ones alone, the rest batched) and 0.95 x here;
Qwen3-30B-A3B's 9,435 tensors (24 layers, 3 MiB experts) at 0.56 x against 0.95 x.

Each pair's bytes are cut into chunks of `CHUNK_BYTES`, one table row per chunk (source address,
destination address, 16-byte words); a copy is one launch over the table. Only contiguous pairs of
one dtype, shape and device with 16-byte aligned addresses and sizes are taken (`fusable`).
`ReplayedCopies` keeps the tables of the last pairs seen twice, so a sync that copies the same
tensor objects again pays no Python per pair beyond checking they are where they were. Imported where a copy runs on a GPU
(it needs Triton; its tests run in Triton's interpreter on the CPU).
"""

from __future__ import annotations

import contextlib
import operator
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = ["CHUNK_BYTES", "FusedCopy", "ReplayedCopies", "fusable"]

CHUNK_BYTES = 256 << 10
"""The bytes one program copies (a pair's last chunk is shorter): the best of 256 KiB, 1 MiB and
4 MiB on one H200 for both models above."""
_BLOCK = 8192
"""int64 words a program moves per step (64 KiB), with `_WARPS` warps: on one H200 (2026-12-03,
`bench/colocated_copy_probe.py --blocks --warps`, and a sweep of chunks and cache hints, three alternations) 0.949-0.953 x a
flat copy for both models above against 0.923-0.931 x at 4096 words and 4 warps; 16384 words spill
(0.12-0.67 x), streaming cache hints lose."""
_WARPS = 16


def fusable(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether `FusedCopy` takes the pair: both contiguous on one device, one dtype and shape, 16-byte
    aligned addresses and byte size."""
    return (
        dst.device == src.device and dst.dtype == src.dtype and dst.shape == src.shape and src.nbytes % 16 == 0 and src.nbytes > 0
        and dst.is_contiguous() and src.is_contiguous() and dst.data_ptr() % 16 == 0 and src.data_ptr() % 16 == 0
    )


class FusedCopy:
    """`dsts[i].copy_(srcs[i])` for every pair (each `fusable`, destinations not overlapping) as one
    launch. Keeps addresses only: the caller keeps every tensor alive and where it is while it
    launches (`ReplayedCopies` checks that)."""

    def __init__(
        self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], chunk_bytes: int = CHUNK_BYTES, *, block: int = _BLOCK, warps: int = _WARPS,
    ) -> None:
        if len(dsts) != len(srcs):
            raise ValueError(f"{len(dsts)} destinations for {len(srcs)} sources")
        if chunk_bytes <= 0 or chunk_bytes % 16:
            raise ValueError(f"chunk_bytes must be a positive multiple of 16, got {chunk_bytes}")
        for i, (d, s) in enumerate(zip(dsts, srcs)):
            if not fusable(d, s):
                raise ValueError(f"pair {i} ({s.dtype} {tuple(s.shape)} into {d.dtype} {tuple(d.shape)}) cannot be copied here")
        self.device = srcs[0].device if srcs else torch.device("cpu")
        table = _table(srcs, dsts, chunk_bytes) if srcs else None
        if table is not None and self.device.type == "cuda":  # pinned: no wait for the work queued before it
            table = table.pin_memory().to(self.device, non_blocking=True)  # the host allocator keeps it until copied
        self._table = table
        self._block, self._warps = block, warps  # other values only to measure them

    def launch(self) -> None:
        """Enqueue every copy on the current stream (one launch, no host sync)."""
        if self._table is None:
            return
        with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
            _copy[(self._table.shape[0],)](self._table, BLOCK=self._block, num_warps=self._warps)


def _table(srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor], chunk: int) -> torch.Tensor:
    """A row per chunk: (source address, destination address, 16-byte words), built with tensor ops
    (a 7B model's ~58k rows cost no Python each)."""
    s = torch.tensor(list(map(torch.Tensor.data_ptr, srcs)), dtype=torch.int64)
    d = torch.tensor(list(map(torch.Tensor.data_ptr, dsts)), dtype=torch.int64)
    n = torch.tensor([t.nbytes for t in srcs], dtype=torch.int64)
    counts = (n + chunk - 1) // chunk
    pair = torch.repeat_interleave(torch.arange(len(srcs)), counts)
    first = torch.cumsum(counts, 0) - counts
    offset = (torch.arange(pair.numel(), dtype=torch.int64) - first[pair]) * chunk
    words = torch.clamp(n[pair] - offset, max=chunk) // 16
    return torch.stack([s[pair] + offset, d[pair] + offset, words], dim=1).contiguous()


class ReplayedCopies:
    """`dsts[i].copy_(srcs[i])` for every pair, the fusable ones in one `FusedCopy` launch, for pairs
    of tensor objects seen before: a table is built the second time the same objects come, where
    they were (checked by identity, data pointer and shape: a parameter whose `.data` was replaced is
    the same object elsewhere), and used while that holds. Pairs seen once (a receive buffer's views,
    new at every sync) are all handed back: building a table for them each time cost an NCCL sync
    into vLLM ~5 ms (7B, 2 H200s). The pairs not copied here are returned for the caller's own
    copies. Holds weak references only, so an old sync's mapped tensors are never kept alive here."""

    def __init__(self, kept: int = 256) -> None:
        self._kept = kept
        self._tables: dict[tuple[int, ...], _Seen] = {}

    def copy(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> list[int]:
        """Launch the fusable copies of pairs seen before; the indices of the pairs left to the caller."""
        tensors = [*dsts, *srcs]
        key = tuple(map(id, tensors))
        seen = self._tables.pop(key, None)
        with torch._C.DisableTorchFunctionSubclass():  # vLLM's parameters answer in Python otherwise (~3 us a call)
            ptrs, shapes = list(map(torch.Tensor.data_ptr, tensors)), list(map(_SHAPE, tensors))
            if seen is None or seen.ptrs != ptrs or seen.shapes != shapes or not all(map(operator.is_, map(_DEREF, seen.refs), tensors)):
                seen = _Seen([weakref.ref(t) for t in tensors], ptrs, shapes, None, list(range(len(srcs))))  # seen once: all handed back
            elif seen.copy is None:  # seen again, where it was: its table
                fuse = [i for i, (d, s) in enumerate(zip(dsts, srcs)) if fusable(d, s)]
                taken = set(fuse)
                seen.copy = FusedCopy([dsts[i] for i in fuse], [srcs[i] for i in fuse])
                seen.rest = [i for i in range(len(srcs)) if i not in taken]
        self._tables[key] = seen  # the latest last: the oldest goes first
        while len(self._tables) > self._kept:
            self._tables.pop(next(iter(self._tables)))
        if seen.copy is not None:
            seen.copy.launch()
        return seen.rest


@dataclass
class _Seen:
    """Pairs `ReplayedCopies` saw: their tensors (weakly), where they were, their table once made,
    and the pairs it leaves to the caller."""

    refs: list[weakref.ref[torch.Tensor]]
    ptrs: list[int]
    shapes: list[torch.Size]
    copy: FusedCopy | None
    rest: list[int]


_SHAPE = operator.attrgetter("shape")
_DEREF = weakref.ref.__call__


@triton.jit
def _copy(table, BLOCK: tl.constexpr):
    """One program per chunk: its 16-byte words moved as int64 pairs (addresses 16-byte aligned)."""
    m = tl.program_id(0).to(tl.int64)
    s = tl.multiple_of(tl.load(table + 3 * m), 16)
    d = tl.multiple_of(tl.load(table + 3 * m + 1), 16)
    n = tl.load(table + 3 * m + 2) * 2  # int64 words
    src = s.to(tl.pointer_type(tl.int64))
    dst = d.to(tl.pointer_type(tl.int64))
    full = n // BLOCK * BLOCK
    for start in range(0, full, BLOCK):
        i = tl.multiple_of(start, BLOCK) + tl.arange(0, BLOCK)
        tl.store(dst + i, tl.load(src + i))
    i = full + tl.arange(0, BLOCK)
    live = i < n
    tl.store(dst + i, tl.load(src + i, mask=live), mask=live)
