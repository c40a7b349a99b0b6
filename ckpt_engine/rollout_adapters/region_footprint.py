"""Which part of a tensor a strided view reads, as one-dimension regions (pure geometry, no torch ops).

The recorder follows a loader's views of a placeholder tensor by their geometry (sizes, strides,
storage offset into the contiguous placeholder); every read is then a box of the tensor (one range
per dimension, a superset of the elements read). A rank's regions for one tensor are the boxes of
all its reads projected on the single dimension that moves the fewest elements.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import prod

from ckpt_engine.planning.regions import Region

__all__ = ["Box", "box_of_view", "regions_of_boxes"]

Box = tuple[tuple[int, int], ...]
"""[lo, hi) per dimension of the tensor."""


def _contiguous_strides(shape: Sequence[int]) -> list[int]:
    strides, step = [0] * len(shape), 1
    for d in range(len(shape) - 1, -1, -1):
        strides[d] = step
        step *= shape[d]
    return strides


def box_of_view(shape: Sequence[int], sizes: Sequence[int], strides: Sequence[int], offset: int) -> Box | None:
    """The smallest box of a contiguous tensor of `shape` that holds every element of the view
    (`sizes`, `strides`, `offset`); None when the view cannot be bounded that way (the caller then
    counts the whole tensor). An empty view gives an empty box (some hi == lo)."""
    if not shape:
        return None
    if any(z == 0 for z in sizes):
        return tuple((0, 0) for _ in shape)
    h = _contiguous_strides(shape)
    coords = [(offset // h[d]) % shape[d] for d in range(len(shape))]
    if offset >= prod(shape) or offset < 0:
        return None
    span = [0] * len(shape)
    work = [(z, s) for z, s in zip(sizes, strides) if z > 1 and s != 0]
    while work:
        z, s = work.pop()
        if s < 0:
            return None
        # the innermost dimension d with h[d] <= s: s must be a multiple of h[d] below the next one up
        d = next((d for d in range(len(shape)) if h[d] <= s), None)
        if d is None or s % h[d]:
            return None
        m = s // h[d]  # < shape[d] for d > 0: h[d-1] == shape[d] * h[d] > s
        if coords[d] + span[d] + (z - 1) * m < shape[d]:
            span[d] += (z - 1) * m
            continue
        # a view dimension running over several tensor dimensions (a flattened block): split it
        # where it wraps, if it starts at the beginning of dimension d and wraps whole rows
        if m == 1 and d > 0 and coords[d] == 0 and span[d] == 0 and z % shape[d] == 0:
            work.append((z // shape[d], h[d - 1]))
            work.append((shape[d], h[d]))
            continue
        return None
    return tuple((c, c + sp + 1) for c, sp in zip(coords, span))


def regions_of_boxes(shape: Sequence[int], boxes: Sequence[Box]) -> tuple[Region, ...] | None:
    """The fewest-element cover of `boxes` by ranges along one dimension (others whole); None when
    the cheapest cover is the whole tensor. Empty boxes are ignored; no box at all gives ()."""
    boxes = [b for b in boxes if all(hi > lo for lo, hi in b)]
    if not boxes:
        return ()
    numel = prod(shape)
    best: tuple[int, int, list[tuple[int, int]]] | None = None
    for d in range(len(shape)):
        merged: list[tuple[int, int]] = []
        for lo, hi in sorted(b[d] for b in boxes):
            if merged and lo <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(hi, merged[-1][1]))
            else:
                merged.append((lo, hi))
        cost = sum(hi - lo for lo, hi in merged) * (numel // shape[d])
        if best is None or cost < best[0]:
            best = (cost, d, merged)
    assert best is not None
    cost, d, merged = best
    if cost >= numel:
        return None
    return tuple(Region(d, lo, hi - lo) for lo, hi in merged)
