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
    storages = [(v.untyped_storage().data_ptr(), v.untyped_storage().nbytes()) for v in views]
    regions, where = group(spans, storages, _segments(device) if device.type == "cuda" else [])
    return Regions(device, regions, where)


def group(
    spans: Sequence[tuple[int, int]], storages: Sequence[tuple[int, int]], segments: Sequence[tuple[int, int]],
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(regions, (region, offset) of each span): a span lies in the segment holding it, else in
    its storage; each region once, in the order first met. ValueError naming a span outside its
    storage (a view that is not one)."""
    segs = sorted(segments)
    starts = [s for s, _ in segs]
    index: dict[tuple[int, int], int] = {}
    regions: list[tuple[int, int]] = []
    where: list[tuple[int, int]] = []
    for k, ((addr, n), storage) in enumerate(zip(spans, storages)):
        i = bisect.bisect_right(starts, addr) - 1
        container = segs[i] if i >= 0 and addr + n <= segs[i][0] + segs[i][1] else storage
        if not (container[0] <= addr and addr + n <= container[0] + container[1]):
            raise ValueError(f"view {k} ({n} bytes at {addr:#x}) lies outside its storage ({container[1]} bytes at {container[0]:#x})")
        r = index.get(container)
        if r is None:
            r = index[container] = len(regions)
            regions.append(container)
        where.append((r, addr - container[0]))
    return regions, where


def _segments(device: torch.device) -> list[tuple[int, int]]:
    """(address, bytes) of the caching allocator's segments on `device` that hold no unmapped pages."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return [
        (s["address"], s["total_size"]) for s in torch.cuda.memory_snapshot()
        if s.get("device") == index and not s.get("is_expandable", False)
    ]
