"""A bucket image that lives in many tensors (a receiver's own weights), read and written by bucket
word position: a patch is checked and applied in place, with no bucket-sized base copy.

Each region maps a run of the bucket's words onto a 1-D word view of one tensor; words outside
every region (alignment padding) belong to no tensor, and a patch touching one is refused. On CUDA
a Triton kernel finds each position's region by binary search over the region starts
(scatter_kernels.py); a patch is applied by two kernels (swap_in: read every old word and sum the
checksum change, then write). Elsewhere torch ops group the positions by region.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ckpt_engine.delta import accel
from ckpt_engine.delta.layout import CHUNK_WORDS
from ckpt_engine.delta.mixing import mix

if TYPE_CHECKING:
    from ckpt_engine.delta.scatter_kernels import RegionTable

__all__ = ["ScatteredImage", "pair_delta"]

_Groups = tuple[list[tuple[int, torch.Tensor | slice, torch.Tensor]], int]
"""(region, which positions, their word offsets in the region) per touched region, and how many
positions fall outside every region."""


def pair_delta(positions: torch.Tensor, values: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """sum over k of h(positions[k]) * (values[k] - old[k]) in wrapping int64 (0-d, on the
    positions' device): a patch's checksum change, from the old words read where they live."""
    if accel.triton_on(positions.device):
        from ckpt_engine.delta import kernels

        return kernels.pairs_sum(positions, values, old)
    total = torch.zeros((), dtype=torch.int64, device=positions.device)
    for s in range(0, positions.numel(), CHUNK_WORDS):  # temporaries of CHUNK_WORDS int64s at most
        p64 = positions[s : s + CHUNK_WORDS].to(torch.int64)
        total += mix(p64).mul_(values[s : s + CHUNK_WORDS].to(torch.int64) - old[s : s + CHUNK_WORDS].to(torch.int64)).sum()
    return total


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
        self._table: RegionTable | None = None  # the Triton kernels' view of the regions (CUDA)
        if accel.triton_on(self.device):
            from ckpt_engine.delta.scatter_kernels import RegionTable

            self._table = RegionTable.of(regions)

    def _run(self, positions: torch.Tensor, values: torch.Tensor, write: bool) -> torch.Tensor:
        assert self._table is not None
        bad = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._table.move(positions, values, write, bad)
        return bad

    def _groups(self, positions: torch.Tensor) -> _Groups:
        """The positions cut into runs by region with a binary search: sorted positions (what a
        CPU encoder writes) with no sort, others sorted first (stable)."""
        p = positions.detach().to(device=self.device, dtype=torch.int64)
        order = None
        if p.numel() > 1 and not bool((p[1:] >= p[:-1]).all()):
            p, order = torch.sort(p, stable=True)
        lo = torch.searchsorted(p, self.starts.to(self.device), side="left")
        hi = torch.searchsorted(p, self.ends.to(self.device), side="left")
        groups: list[tuple[int, torch.Tensor | slice, torch.Tensor]] = []
        for k, (a, b) in enumerate(zip(lo.tolist(), hi.tolist())):
            if b > a:
                groups.append((k, order[a:b] if order is not None else slice(a, b), p[a:b] - self.regions[k][0]))
        return groups, int(p.numel() - int((hi - lo).sum()))

    def _pairs(self, positions: torch.Tensor, values: torch.Tensor, write: bool, groups: _Groups | None = None) -> torch.Tensor:
        """The torch path of gather (write False: fills `values`) and scatter; returns the count of
        positions outside every region as a 1-element tensor. `groups`: _groups(positions), when
        the caller has it already."""
        runs, bad = groups if groups is not None else self._groups(positions)
        for k, sel, local in runs:
            region = self.regions[k][1]
            if write:
                region.index_copy_(0, local, values[sel])
            else:
                values[sel] = region.index_select(0, local)
        return torch.tensor([bad], dtype=torch.int32, device=self.device)

    def gather(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the words at `positions`, 0 where outside every region; count of such positions as a
        1-element device tensor), without a host sync on CUDA."""
        out = torch.zeros(positions.numel(), dtype=self.dtype, device=self.device)
        if self._table is not None:
            return out, self._run(positions, out, write=False)
        return out, self._pairs(positions, out, write=False)

    def scatter(self, positions: torch.Tensor, values: torch.Tensor) -> None:
        """Write `values` at `positions` (positions outside every region are skipped: a patch that
        has them was refused by its check)."""
        self._check_values(positions, values)
        if self._table is not None:
            self._run(positions, values, write=True)
            return
        self._pairs(positions, values.contiguous(), write=True)

    def swap_in(self, positions: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Write `values` at `positions` and return (the old words, 0 where outside every region;
        count of such positions as a 1-element int32 tensor; pair_delta(positions, values, old) as
        a 0-d int64 tensor), without a host sync on CUDA. Positions outside every region (any
        position < 0 or >= num_words among them) are skipped: the caller refuses the patch. Every
        old word is read before any new word is written, so a position repeated by a corrupt
        patch still yields its old word each time: on CUDA all reads are in the first kernel (which
        also sums the change, so no kernel reads the pairs again) and all writes in the second,
        queued right after it on the same stream."""
        self._check_values(positions, values)
        if self._table is not None:
            return self._table.swap_in(positions, values)
        values = values.contiguous()
        old = torch.zeros(positions.numel(), dtype=self.dtype, device=self.device)
        groups = self._groups(positions)
        bad = self._pairs(positions, old, write=False, groups=groups)
        self._pairs(positions, values, write=True, groups=groups)
        return old, bad, pair_delta(positions, values, old)

    def _check_values(self, positions: torch.Tensor, values: torch.Tensor) -> None:
        if values.numel() != positions.numel() or values.dtype != self.dtype:
            raise ValueError(f"{values.numel()} values of {values.dtype} for {positions.numel()} positions of {self.dtype} words")
