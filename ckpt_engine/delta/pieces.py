"""A bucket image that lives in many tensors (a receiver's own weights), read and written by
bucket word position: a patch is checked and applied in place, with no bucket-sized base copy and
no loader copy of the whole model afterwards.

Each region maps a run of the bucket's words onto a 1-D word view of one tensor (or of the part
of it this bucket carries). Words of the bucket outside every region (alignment padding) belong to
no tensor: a patch that touches one is refused. On CUDA a Triton kernel finds the positions'
regions and reads or writes the words through one base pointer (every region's offset from it is
precomputed), by a binary search over the region starts per position (scatter_kernels.py; one
search per block of positions that lies in one region was tried: no faster on an H200).
A patch is applied by two kernels (swap_in): the first reads every old word and sums the patch's
checksum change, the second writes. On a CPU one compiled pass does both for sorted positions
(host_kernels.py); elsewhere numpy and torch ops group the positions by region.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np
import torch

from ckpt_engine.delta import accel, host
from ckpt_engine.delta.mixing import mix, table_a

if TYPE_CHECKING:
    from ckpt_engine.delta.scatter_kernels import RegionTable

__all__ = ["ScatteredImage", "pair_delta"]

logger = logging.getLogger(__name__)

def pair_delta(positions: torch.Tensor, values: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """sum over k of h(positions[k]) * (values[k] - old[k]) in wrapping int64 (0-d, on the
    positions' device): a patch's checksum change, from the old words read where they live."""
    if accel.triton_on(positions.device):
        from ckpt_engine.delta import kernels

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
        self._host_regions: object | None = None  # the regions as host_kernels takes them, built at first use
        self._table: RegionTable | None = None  # the Triton kernels' view of the regions (CUDA)
        if accel.triton_on(self.device):
            from ckpt_engine.delta.scatter_kernels import RegionTable

            self._table = RegionTable.of(regions)

    def _run(self, positions: torch.Tensor, values: torch.Tensor, write: bool) -> torch.Tensor:
        assert self._table is not None
        bad = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._table.move(positions, values, write, bad)
        return bad

    def _groups(self, positions: torch.Tensor) -> tuple[list[tuple[int, np.ndarray | slice, np.ndarray]], int]:
        """(region, which positions, their word offsets in the region) per touched region, and how
        many positions fall outside every region. Sorted positions (what the CPU encoders write)
        are cut into runs by binary search, with no sort; others are sorted first."""
        p = positions.detach().to(device="cpu", dtype=torch.int64).numpy()
        order = None
        if p.size > 1 and not bool((p[1:] >= p[:-1]).all()):
            order = np.argsort(p, kind="stable")
            p = p[order]
        lo = np.searchsorted(p, self.starts.numpy(), side="left")
        hi = np.searchsorted(p, self.ends.numpy(), side="left")
        groups: list[tuple[int, np.ndarray | slice, np.ndarray]] = []
        for k in np.flatnonzero(hi > lo).tolist():
            a, b = int(lo[k]), int(hi[k])
            groups.append((k, order[a:b] if order is not None else slice(a, b), p[a:b] - self.regions[k][0]))
        return groups, int(p.size - int((hi - lo).sum()))

    def _pairs(
        self, positions: torch.Tensor, values: torch.Tensor | None, write: bool,
        groups: tuple[list[tuple[int, np.ndarray | slice, np.ndarray]], int] | None = None,
    ) -> torch.Tensor:
        """The CPU / torch path of gather (write False: fills `values`) and scatter; returns the
        count of positions outside every region as a 1-element tensor. `groups`: _groups(positions),
        when the caller has it already."""
        groups, bad = groups if groups is not None else self._groups(positions)
        on_cpu = self.device.type == "cpu"
        vals = values.numpy() if on_cpu else values
        for k, sel, local in groups:
            region = self.regions[k][1]
            if on_cpu:
                if write:
                    region.numpy()[local] = vals[sel]
                else:
                    vals[sel] = region.numpy()[local]
                continue
            idx = torch.as_tensor(local, device=self.device)
            rows = torch.as_tensor(np.arange(positions.numel())[sel], device=self.device)
            if write:
                region.index_copy_(0, idx, values.index_select(0, rows))
            else:
                values[rows] = region.index_select(0, idx)
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
        done = self._swap_in_compiled(positions, values)
        if done is not None:
            return done
        old = torch.zeros(positions.numel(), dtype=self.dtype, device=self.device)
        groups = self._groups(positions)
        bad = self._pairs(positions, old, write=False, groups=groups)
        self._pairs(positions, values, write=True, groups=groups)
        return old, bad, pair_delta(positions, values, old)

    def _swap_in_compiled(self, positions: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """swap_in on a CPU in one compiled pass (host_kernels), for sorted positions (what a CPU
        sender writes; repeats allowed); None where it does not apply."""
        if self.device.type != "cpu" or positions.device.type != "cpu" or not accel.numba_on():
            return None
        from ckpt_engine.delta import host_kernels

        p = positions.contiguous().numpy()
        if p.dtype not in (np.int32, np.int64) or not host_kernels.ordered(p):
            return None
        if self._host_regions is None:
            self._host_regions = host_kernels.regions_list([v.numpy() for _f, v in self.regions])
        old = torch.empty(positions.numel(), dtype=self.dtype)  # the pass writes every entry
        bad, total = host_kernels.swap_in_sorted(
            p, values.numpy(), old.numpy(), self.starts.numpy(), self.ends.numpy(), self._host_regions, table_a(self.device).numpy()
        )
        return old, torch.tensor([bad], dtype=torch.int32), torch.tensor(total, dtype=torch.int64)

    def _check_values(self, positions: torch.Tensor, values: torch.Tensor) -> None:
        if values.numel() != positions.numel() or values.dtype != self.dtype:
            raise ValueError(f"{values.numel()} values of {values.dtype} for {positions.numel()} positions of {self.dtype} words")
