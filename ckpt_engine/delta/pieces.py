"""A bucket image that lives in many tensors (a receiver's own weights), read and written by
bucket word position: a patch is checked and applied in place, with no bucket-sized base copy and
no loader copy of the whole model afterwards.

Each region maps a run of the bucket's words onto a 1-D word view of one tensor (or of the part
of it this bucket carries). Words of the bucket outside every region (alignment padding) belong to
no tensor: a patch that touches one is refused. On CUDA one Triton kernel per bucket finds each
position's region by binary search over the region starts and reads or writes the word through one
base pointer (every region's offset from it is precomputed); elsewhere numpy and torch ops group
the positions by region.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch

from ckpt_engine.delta import kernels, host
from ckpt_engine.delta.mixing import mix

__all__ = ["ScatteredImage", "pair_delta"]

logger = logging.getLogger(__name__)

try:  # Triton is optional: CPU installs and GPUs without it use the torch path.
    import triton
    import triton.language as tl

    _HAVE_TRITON = True
except Exception:  # pragma: no cover - depends on the install
    _HAVE_TRITON = False

if _HAVE_TRITON:

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
        r = _locate(p, starts_ptr, n_regions, steps)
        lo = tl.load(starts_ptr + r, mask=m, other=0)
        hi = tl.load(ends_ptr + r, mask=m, other=0)
        ok = m & (p >= lo) & (p < hi)
        addr = tl.load(rel_ptr + r, mask=ok, other=0) + p
        if WRITE:
            tl.store(base_ptr + addr, tl.load(vals_ptr + idx, mask=ok), mask=ok)
        else:
            tl.store(vals_ptr + idx, tl.load(base_ptr + addr, mask=ok, other=0), mask=m)
        nbad = tl.sum((m & ~ok).to(tl.int32), axis=0)
        if nbad > 0:
            tl.atomic_add(bad_ptr, nbad)


def pair_delta(positions: torch.Tensor, values: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """sum over k of h(positions[k]) * (values[k] - old[k]) in wrapping int64 (0-d, on the
    positions' device): a patch's checksum change, from the old words read where they live."""
    if kernels.available(positions.device):
        return kernels.pairs_sum(positions, values, old)
    if positions.device.type == "cpu":
        p = positions.numpy().astype(np.int64, copy=False)
        order = np.argsort(p, kind="stable")
        total = host.weighted_diff_sum(p[order], values.numpy()[order], old.numpy()[order])
        return torch.tensor(host.wrap64(total), dtype=torch.int64)
    p64 = positions.to(torch.int64)
    return mix(p64).mul_(values.to(torch.int64) - old.to(torch.int64)).sum()


class ScatteredImage:
    """One bucket's words spread over `regions`: (first bucket word, 1-D word view of a tensor),
    in bucket order, not overlapping. All views share one dtype (the bucket's word) and device."""

    def __init__(self, regions: list[tuple[int, torch.Tensor]], num_words: int) -> None:
        if not regions:
            raise ValueError("a scattered image needs at least one region")
        regions = sorted(regions, key=lambda r: r[0])
        self.num_words = num_words
        self.dtype = regions[0][1].dtype
        self.device = regions[0][1].device
        prev_end = 0
        for first, view in regions:
            if view.dim() != 1 or view.dtype != self.dtype or view.device != self.device or not view.is_contiguous():
                raise ValueError(f"region at word {first}: every region must be a contiguous 1-D {self.dtype} view on {self.device}")
            if first < prev_end or first + view.numel() > num_words:
                raise ValueError(f"region at word {first} of {view.numel()} words overlaps another or leaves the bucket of {num_words}")
            prev_end = first + view.numel()
        self.regions = regions
        self.starts = torch.tensor([f for f, _ in regions], dtype=torch.int64)
        self.ends = torch.tensor([f + v.numel() for f, v in regions], dtype=torch.int64)
        self._fused = kernels.available(self.device)
        if self._fused:
            anchor = min(regions, key=lambda r: r[1].data_ptr())[1]
            size = anchor.element_size()
            rel = [(v.data_ptr() - anchor.data_ptr()) // size - f for f, v in regions]
            self._anchor = anchor
            self._starts_d = self.starts.to(self.device)
            self._ends_d = self.ends.to(self.device)
            self._rel_d = torch.tensor(rel, dtype=torch.int64).to(self.device)
            self._steps = max(1, math.ceil(math.log2(len(regions))) + 1)

    def _run(self, positions: torch.Tensor, values: torch.Tensor, write: bool) -> torch.Tensor:
        bad = torch.zeros(1, dtype=torch.int32, device=self.device)
        n = positions.numel()
        if n:
            block = 1024
            _pieces_kernel[((n + block - 1) // block,)](
                positions, n, self._starts_d, self._ends_d, self._rel_d, len(self.regions), self._steps, self._anchor, values, bad,
                BLOCK=block, WRITE=write, num_warps=4,
            )
        return bad

    def _groups(self, positions: torch.Tensor) -> tuple[list[tuple[int, torch.Tensor, torch.Tensor]], int]:
        """(region, indices into positions, local word offsets) per touched region, and how many
        positions fall outside every region."""
        p = positions.to(torch.int64).cpu()
        r = torch.searchsorted(self.starts, p, right=True) - 1
        inside = (r >= 0) & (p < self.ends[r.clamp(min=0)])
        bad = int((~inside).sum())
        order = torch.argsort(r, stable=True)
        counts = torch.bincount(r[inside], minlength=len(self.regions)).tolist()
        order = order[inside[order]]
        groups, at = [], 0
        for k, c in enumerate(counts):
            if c:
                sel = order[at : at + c]
                groups.append((k, sel.to(self.device), (p[sel] - self.regions[k][0]).to(self.device)))
                at += c
        return groups, bad

    def gather(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the words at `positions`, 0 where outside every region; count of such positions as a
        1-element device tensor), without a host sync on CUDA."""
        out = torch.empty(positions.numel(), dtype=self.dtype, device=self.device)
        if self._fused:
            return out, self._run(positions, out, write=False)
        out.zero_()
        groups, bad = self._groups(positions)
        for k, sel, local in groups:
            out[sel] = self.regions[k][1].index_select(0, local)
        return out, torch.tensor([bad], dtype=torch.int32, device=self.device)

    def scatter(self, positions: torch.Tensor, values: torch.Tensor) -> None:
        """Write `values` at `positions` (positions outside every region are skipped: a patch that
        has them was refused by its check)."""
        if values.numel() != positions.numel() or values.dtype != self.dtype:
            raise ValueError(f"{values.numel()} values of {values.dtype} for {positions.numel()} positions of {self.dtype} words")
        if self._fused:
            self._run(positions, values, write=True)
            return
        groups, _bad = self._groups(positions)
        for k, sel, local in groups:
            self.regions[k][1].index_copy_(0, local, values.index_select(0, sel))
