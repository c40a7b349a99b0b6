"""The Triton kernels of ScatteredImage (pieces.py): patch words read and written where they live.

Each position's region is found by a binary search over the region starts, and its word reached
through one base pointer (every region's offset from it precomputed in a RegionTable). Imported
only when a CUDA image is made (accel.py), so a CPU install never loads Triton.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ckpt_engine.delta import kernels
from ckpt_engine.delta.mixing import GROUP_BITS, GROUP_WORDS

__all__ = ["BLOCK", "NUM_WARPS", "RegionTable"]

# Positions per program and warps of the gather / scatter / swap kernels (bench/delta_apply_probe.py).
BLOCK = 1024
NUM_WARPS = 4

_mix_a = kernels._mix_a
_mix_b = kernels._mix_b


@triton.jit
def _locate(p, starts_ptr, n_regions, steps):
    """Index of the last region whose start is <= p (region 0 when p is before every start):
    `steps` halvings of a power-of-two stride (a runtime count, so one compiled kernel serves
    buckets of any number of regions)."""
    at = tl.zeros(p.shape, dtype=tl.int32)
    stride = 1 << (steps - 1)
    for _ in range(steps):
        cand = at + stride
        s = tl.load(starts_ptr + cand, mask=cand < n_regions, other=9223372036854775807)
        at = tl.where(s <= p, cand, at)
        stride = stride // 2
    return at


@triton.jit
def _addresses(p, m, starts_ptr, ends_ptr, rel_ptr, n_regions, steps):
    """(word offset from the base pointer, inside a region) for a block's positions `p` (valid
    lanes `m`): each lane searches the region starts."""
    r = _locate(p, starts_ptr, n_regions, steps)
    lo = tl.load(starts_ptr + r, mask=m, other=0)
    hi = tl.load(ends_ptr + r, mask=m, other=0)
    ok = m & (p >= lo) & (p < hi)
    addr = tl.load(rel_ptr + r, mask=ok, other=0) + p
    return addr, ok


@triton.jit(do_not_specialize=["n", "n_regions", "steps"])
def _pieces_kernel(
    pos_ptr, n, starts_ptr, ends_ptr, rel_ptr, n_regions, steps, base_ptr, vals_ptr, bad_ptr,
    BLOCK: tl.constexpr, WRITE: tl.constexpr,
):
    """WRITE: base[rel[r] + p] = vals[i]; else vals[i] = base[rel[r] + p] (0 outside regions).
    Positions outside every region are counted in `bad` and never touch memory."""
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = idx < n
    p = tl.load(pos_ptr + idx, mask=m, other=0).to(tl.int64)
    addr, ok = _addresses(p, m, starts_ptr, ends_ptr, rel_ptr, n_regions, steps)
    if WRITE:
        tl.store(base_ptr + addr, tl.load(vals_ptr + idx, mask=ok), mask=ok)
    else:
        tl.store(vals_ptr + idx, tl.load(base_ptr + addr, mask=ok, other=0), mask=m)
    nbad = tl.sum((m & ~ok).to(tl.int32), axis=0)
    if nbad > 0:
        tl.atomic_add(bad_ptr, nbad)


@triton.jit(do_not_specialize=["n", "n_regions", "steps"])
def _swap_read_kernel(
    pos_ptr, n, starts_ptr, ends_ptr, rel_ptr, n_regions, steps, base_ptr, vals_ptr, old_ptr, bad_ptr, part_ptr,
    BLOCK: tl.constexpr, GROUP: tl.constexpr, GROUP_BITS: tl.constexpr,
):
    """The read half of swap_in: old[i] = base[rel[r] + p] (0 outside every region, counted
    in `bad`), and this block's partial sum of h(p) * (vals[i] - old[i]) in wrapping int64,
    the same terms as kernels._pairs_sum_kernel (so the total is pair_delta's, bit for bit)."""
    pid = tl.program_id(0)
    idx = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = idx < n
    p = tl.load(pos_ptr + idx, mask=m, other=0).to(tl.int64)
    addr, ok = _addresses(p, m, starts_ptr, ends_ptr, rel_ptr, n_regions, steps)
    o = tl.load(base_ptr + addr, mask=ok, other=0)
    tl.store(old_ptr + idx, o, mask=m)
    v = tl.load(vals_ptr + idx, mask=m, other=0).to(tl.int64)
    a = _mix_a((p & (GROUP - 1)).to(tl.int32)).to(tl.int64)
    tl.store(part_ptr + pid, tl.sum((v - o.to(tl.int64)) * a * _mix_b(p >> GROUP_BITS), axis=0))
    nbad = tl.sum((m & ~ok).to(tl.int32), axis=0)
    if nbad > 0:
        tl.atomic_add(bad_ptr, nbad)


@dataclass(frozen=True)
class RegionTable:
    """An image's regions as the kernels read them: each region's word offset from one anchor
    tensor (the lowest address), its start and end in bucket words, on the image's device."""

    anchor: torch.Tensor
    starts: torch.Tensor
    ends: torch.Tensor
    rel: torch.Tensor
    steps: int  # halvings of the binary search over the region starts

    @classmethod
    def of(cls, regions: list[tuple[int, torch.Tensor]]) -> RegionTable:
        """The table of `regions` ((first bucket word, 1-D word view), sorted, one device)."""
        anchor = min(regions, key=lambda r: r[1].data_ptr())[1]
        size, device = anchor.element_size(), anchor.device
        rel = [(v.data_ptr() - anchor.data_ptr()) // size - f for f, v in regions]
        return cls(
            anchor,
            torch.tensor([f for f, _ in regions], dtype=torch.int64).to(device),
            torch.tensor([f + v.numel() for f, v in regions], dtype=torch.int64).to(device),
            torch.tensor(rel, dtype=torch.int64).to(device),
            max(1, math.ceil(math.log2(len(regions))) + 1),
        )

    def move(self, positions: torch.Tensor, values: torch.Tensor, write: bool, bad: torch.Tensor) -> None:
        """write: the image's words at `positions` become `values`; else `values` gets them (0
        outside every region). Positions outside every region are added to `bad`."""
        n = positions.numel()
        if n:
            with kernels.on_device_of(positions):
                _pieces_kernel[(triton.cdiv(n, BLOCK),)](
                    positions, n, self.starts, self.ends, self.rel, self.starts.numel(), self.steps, self.anchor, values, bad,
                    BLOCK=BLOCK, WRITE=write, num_warps=NUM_WARPS,
                )

    def swap_in(self, positions: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """ScatteredImage.swap_in on the device: every old word read (and the checksum change
        summed) by the first kernel, every new word written by the second, queued after it."""
        positions, values = positions.contiguous(), values.contiguous()
        n = positions.numel()
        nb = triton.cdiv(n, BLOCK)
        device = self.anchor.device
        old = torch.empty(n, dtype=self.anchor.dtype, device=device)
        bad = torch.zeros(1, dtype=torch.int32, device=device)
        partial = torch.empty(nb, dtype=torch.int64, device=device) if n else torch.zeros(1, dtype=torch.int64, device=device)
        if n:
            with kernels.on_device_of(positions):
                _swap_read_kernel[(nb,)](
                    positions, n, self.starts, self.ends, self.rel, self.starts.numel(), self.steps, self.anchor, values, old, bad,
                    partial, BLOCK=BLOCK, GROUP=GROUP_WORDS, GROUP_BITS=GROUP_BITS, num_warps=NUM_WARPS,
                )
            self.move(positions, values, True, bad.new_empty(1))  # scratch: the read counted these already
        return old, bad, partial.sum()
