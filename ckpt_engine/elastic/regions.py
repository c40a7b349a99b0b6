"""The memory a peer join registers with NIXL: regions that hold many tensors, not each tensor.

A 24-layer Qwen3-30B-A3B image is 9,435 checkpoint tensors; registering each (and describing each
to the joiner's agent) was a large part of both sides' ~2-4 s before a byte moved on 2xH200. A
region is memory that stays mapped while any tensor in it lives:
- on CUDA, the caching allocator's segment holding the tensor (`torch.cuda.memory_snapshot`),
  registered once for every tensor it holds (an expandable segment may have unmapped pages between
  its tensors, so it is not used);
- otherwise (host memory, a tensor outside every segment) the tensor's storage: one allocation, so
  the views of one slab (a joiner's staging copy, `LoaderCopy.slab`) are one region, and tensors
  allocated one by one are one region each.
Each tensor is then (region, offset), which is what an offer describes and a read addresses.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import overload

import torch

__all__ = ["Regions", "group", "regions_of"]


@dataclass(frozen=True)
class Regions:
    """The regions to register for some views, and where each view lies in them."""

    device: torch.device
    spans: list[tuple[int, int]]
    """(address, bytes) of each region."""
    where: list[tuple[int, int]]
    """(region index, offset) of each view, in the views' order."""


def regions_of(views: Sequence[torch.Tensor]) -> Regions:
    """The regions holding `views` (contiguous byte views of one device, none empty)."""
    if not views:
        return Regions(torch.device("cpu"), [], [])
    device = views[0].device
    if any(v.device != device for v in views):
        raise ValueError(f"regions of one device at a time, got {sorted({str(v.device) for v in views})}")
    spans = [(v.data_ptr(), v.numel() * v.element_size()) for v in views]
    regions, where = group(spans, _Storages(views), _segments(device) if device.type == "cuda" else [])
    return Regions(device, regions, where)


class _Storages(Sequence[tuple[int, int]]):
    """(address, bytes) of each view's storage, asked only for a view outside every region found
    so far (`group`): one storage object made per slab, not per view (9,435 of them were 0.19 s of
    a joiner's prepare on the CPU box)."""

    def __init__(self, views: Sequence[torch.Tensor]) -> None:
        self.views = views

    def __len__(self) -> int:
        return len(self.views)

    @overload
    def __getitem__(self, k: int) -> tuple[int, int]: ...
    @overload
    def __getitem__(self, k: slice) -> list[tuple[int, int]]: ...
    def __getitem__(self, k: int | slice) -> tuple[int, int] | list[tuple[int, int]]:
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(self)))]
        storage = self.views[k].untyped_storage()
        return storage.data_ptr(), storage.nbytes()


def group(
    spans: Sequence[tuple[int, int]], storages: Sequence[tuple[int, int]], segments: Sequence[tuple[int, int]],
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(regions, (region, offset) of each span): a span lies in a region found already when inside
    one (live storages never overlap, so its own storage is that memory), else in the segment
    holding it, else in its storage (`storages[k]`, asked only then); each region once, in the
    order first met. ValueError naming a span outside its storage (a view that is not one)."""
    segs = sorted(segments)
    starts = [s for s, _ in segs]
    index: dict[tuple[int, int], int] = {}
    regions: list[tuple[int, int]] = []
    found: list[tuple[int, int, int]] = []
    """(start, end, index) of each region found, by start."""
    where: list[tuple[int, int]] = []
    for k, (addr, n) in enumerate(spans):
        j = bisect.bisect_right(found, (addr, _END, _END)) - 1
        if j >= 0 and addr + n <= found[j][1]:
            where.append((found[j][2], addr - found[j][0]))
            continue
        i = bisect.bisect_right(starts, addr) - 1
        container = segs[i] if i >= 0 and addr + n <= segs[i][0] + segs[i][1] else storages[k]
        if not (container[0] <= addr and addr + n <= container[0] + container[1]):
            raise ValueError(f"view {k} ({n} bytes at {addr:#x}) lies outside its storage ({container[1]} bytes at {container[0]:#x})")
        r = index.get(container)
        if r is None:
            r = index[container] = len(regions)
            regions.append(container)
            bisect.insort(found, (container[0], container[0] + container[1], r))
        where.append((r, addr - container[0]))
    return regions, where


_END = 1 << 64
"""Past every address: a bisect key after each region starting at an address."""


def _segments(device: torch.device) -> list[tuple[int, int]]:
    """(address, bytes) of the caching allocator's segments on `device` that hold no unmapped pages."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return [
        (s["address"], s["total_size"]) for s in torch.cuda.memory_snapshot()
        if s.get("device") == index and not s.get("is_expandable", False)
    ]
