"""Compiled CPU loops of the delta codec (numba), for what numpy can only do in many passes.

Why: a CPU receiver applying a patch in place did it in ~10 numpy passes over the patch (widen
the positions, group them by tensor, gather the old words, scatter the new ones, then sort, take,
subtract, multiply and reduce for the checksum change): 0.35 s per GiB bucket at 2 % changed words
on one core, more than the whole bucket's broadcast. One compiled loop over the sorted positions
reads each old word, sums its checksum term and writes the new word, in one pass over memory.

Same semantics as the numpy path in pieces.py (the tests compare them): every old word is read
before its position is written, so a position a corrupt patch repeats yields its old word each
time; positions outside every region are counted and skipped. Without numba (or for unsorted
positions, which a GPU sender's patch or a corrupt one has) the numpy path runs. Imported only
through accel.numba_on() (the first CPU patch), never at import time.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from numba.typed import List as _TypedList

from ckpt_engine.delta.mixing import GROUP_BITS, GROUP_WORDS, MIX_B

__all__ = ["SPLIT_POSITIONS", "diff_into", "ordered", "regions_list", "swap_in_sorted"]

SPLIT_POSITIONS = 1 << 20
"""A patch with at least this many positions per thread is applied by several threads."""


@numba.njit(cache=True, nogil=True)
def _ordered(p):  # type: ignore[no-untyped-def]
    for i in range(1, p.size):
        if p[i] < p[i - 1]:
            return False
    return True


@numba.njit(cache=True, nogil=True)
def _b(group):  # type: ignore[no-untyped-def]
    b = (group + 1) * np.int64(MIX_B)
    b ^= b >> 31
    return b | 1


@numba.njit(cache=True, nogil=True)
def _h(p, table_a):  # type: ignore[no-untyped-def]
    return table_a[p & (GROUP_WORDS - 1)] * _b(p >> GROUP_BITS)


@numba.njit(cache=True, nogil=True)
def _swap_range(pos, vals, old, starts, ends, regions, table_a, first, last):  # type: ignore[no-untyped-def]
    """The swap over positions [first, last): sorted, so each region takes one run of them."""
    bad = 0
    total = np.int64(0)
    i = first
    k = np.searchsorted(ends, pos[first], side="right") if first < last else starts.size
    while k < starts.size and i < last:
        lo, hi = starts[k], ends[k]
        while i < last and pos[i] < lo:  # in a gap before this region
            old[i] = 0
            bad += 1
            total += _h(np.int64(pos[i]), table_a) * np.int64(vals[i])
            i += 1
        if i < last and pos[i] < hi:
            region = regions[k]
            prev = np.int64(-1)
            group = np.int64(-1)
            b = np.int64(0)
            part = np.int64(0)  # the sum of A(p) * (new - old) over this group's positions
            while i < last and pos[i] < hi:
                p = np.int64(pos[i])
                if p == prev:  # repeated (a corrupt patch): the word read before it was written
                    o = old[i - 1]
                else:
                    o = region[p - lo]
                old[i] = o
                region[p - lo] = vals[i]
                prev = p
                if (p >> GROUP_BITS) != group:  # B(group) once per group of 2**16 words
                    total += part * b
                    part = np.int64(0)
                    group = p >> GROUP_BITS
                    b = _b(group)
                part += (np.int64(vals[i]) - np.int64(o)) * table_a[p & (GROUP_WORDS - 1)]
                i += 1
            total += part * b
        k += 1
    while i < last:  # past the last region
        old[i] = 0
        bad += 1
        total += _h(np.int64(pos[i]), table_a) * np.int64(vals[i])
        i += 1
    return bad, total


@numba.njit(cache=True, parallel=True)
def _swap_split(pos, vals, old, starts, ends, regions, table_a, cuts):  # type: ignore[no-untyped-def]
    parts = cuts.size - 1
    bads = np.zeros(parts, np.int64)
    totals = np.zeros(parts, np.int64)
    for t in numba.prange(parts):
        bads[t], totals[t] = _swap_range(pos, vals, old, starts, ends, regions, table_a, cuts[t], cuts[t + 1])
    bad = 0
    total = np.int64(0)
    for t in range(parts):
        bad += bads[t]
        total += totals[t]
    return bad, total


@numba.njit(cache=True, nogil=True)
def _diff(new, base, first, positions, values, count, cap, table_a):  # type: ignore[no-untyped-def]
    total = np.int64(0)
    group = np.int64(-1)
    b = np.int64(0)
    part = np.int64(0)
    for i in range(base.size):
        w = new[i]
        o = base[i]
        if w == o:
            continue
        p = np.int64(first + i)
        if count < cap:
            positions[count] = p
            values[count] = w
        count += 1
        base[i] = w
        if (p >> GROUP_BITS) != group:
            total += part * b
            part = np.int64(0)
            group = p >> GROUP_BITS
            b = _b(group)
        part += (np.int64(w) - np.int64(o)) * table_a[p & (GROUP_WORDS - 1)]
    return count, total + part * b


def ordered(positions: np.ndarray) -> bool:
    """True when every position is at least the one before: one pass,
    no temporaries."""
    return bool(_ordered(positions))


def regions_list(views: list[np.ndarray]) -> object:
    """The regions in the typed list the compiled loop takes (built once per image)."""
    out = _TypedList()
    for v in views:
        out.append(v)
    return out


def swap_in_sorted(
    positions: np.ndarray, values: np.ndarray, old: np.ndarray, starts: np.ndarray, ends: np.ndarray, regions: object, table_a: np.ndarray
) -> tuple[int, int]:
    """Write `values` at non-decreasing `positions` of the regions [starts[k], ends[k]) (sorted,
    disjoint), fill `old` with the words they held (0 outside every region) and return (positions
    outside every region, sum of h(p) * (new - old) in wrapping int64, those outside included
    with old 0, as pair_delta sums them). A large patch is cut into one run of positions per
    thread (never between two equal positions, so each word is read and written by one thread)."""
    n = positions.size
    parts = min(numba.get_num_threads(), torch.get_num_threads(), n // SPLIT_POSITIONS)  # torch's threads: what the rank may use
    if parts < 2:
        bad, total = _swap_range(positions, values, old, starts, ends, regions, table_a, 0, n)
        return int(bad), int(total)
    cuts = [0]
    for t in range(1, parts):
        c = max(cuts[-1], t * n // parts)
        while 0 < c < n and positions[c] == positions[c - 1]:
            c += 1
        cuts.append(c)
    cuts.append(n)
    bad, total = _swap_split(positions, values, old, starts, ends, regions, table_a, np.asarray(cuts, dtype=np.int64))
    return int(bad), int(total)


def diff_into(
    new: np.ndarray, base: np.ndarray, first: int, positions: np.ndarray, values: np.ndarray, count: int, cap: int, table_a: np.ndarray
) -> tuple[int, int]:
    """One pass over a piece: where `new` differs from `base`, record (first + i, new word) at `count` while below `cap`, write it into
    `base` and add its checksum term. Returns (the new count, the sum of the terms, wrapping)."""
    count, total = _diff(new, base, first, positions, values, count, cap, table_a)
    return int(count), int(total)
