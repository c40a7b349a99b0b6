"""Triton kernels of the delta codec on CUDA: the one-pass diff, checksums, a patch's checksum change.

The codec owns the patch layout and falls back to plain torch ops when Triton or a GPU is missing;
these kernels only move words. Imported only where a CUDA tensor is processed (accel.py), so a
CPU install never loads Triton. The diff reads both images once: each tile compares and packs one
int32 change mask per row of 32 words, then every row walks its own set bits, so its cost beyond
the compare follows the changed words, not the image.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import triton
import triton.language as tl

from ckpt_engine.delta.mixing import GROUP_BITS, GROUP_WORDS

__all__ = ["BLOCK_WORDS", "NUM_WARPS", "checksum", "delta_sum", "diff_into", "pairs_sum"]

# Words per program and warps per program of the checksum (8192 / 8: the fastest of the last sweep
# on an H200). BLOCK_WORDS must divide 2**16 (one B factor of h per block).
BLOCK_WORDS = 8192
NUM_WARPS = 8


# h(i) = A(i mod 2**16) * B(i div 2**16): the same function as mixing.py (MIX_A, MIX_B).
@triton.jit
def _mix_a(j):
    """int32 j in [0, 2**16) -> odd int32 A(j) < 2**31 (32-bit wrapping multiply)."""
    x = (j + 1) * -1640531535  # 0x9E3779B1 as int32
    return (x.to(tl.uint32, bitcast=True) >> 1).to(tl.int32, bitcast=True) | 1


@triton.jit
def _mix_b(k):
    x = (k + 1) * -4658895280553007687
    x = x ^ (x >> 31)
    return x | 1


@triton.jit
def _weighted(v, a, SMALL: tl.constexpr):
    """v * a as int64 for signed words v and int32 a: one widening multiply for words of <= 2
    bytes (their differences fit int32), a 64-bit multiply otherwise."""
    if SMALL:
        return v.to(tl.int32).to(tl.int64) * a.to(tl.int64)
    return v.to(tl.int64) * a.to(tl.int64)


@triton.jit
def _popc32(x):
    """Set bits of each int32 (SWAR popcount on the unsigned bits)."""
    x = x.to(tl.uint32, bitcast=True)
    x = x - ((x >> 1) & 0x55555555)
    x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F
    return ((x * 0x01010101) >> 24).to(tl.int32)


@triton.jit
def _diff_rows(new_base, old_base, tile, n_words, first, counter_ptr, delta_ptr, pos_ptr, val_ptr, cap, ROWS: tl.constexpr,
               GROUP: tl.constexpr, GROUP_BITS: tl.constexpr):
    """One tile (ROWS rows of 32 words) of a piece: `new_base` / `old_base` point at the
    piece's first new / base word, `first` is its first word's index in the bucket. The dense
    phase only compares and packs each row's changes into a bit mask; then every row walks its
    own set bits (as many rounds as the busiest row of the tile has changes) to write
    positions and new values and to add h(position) * (new - old) into the bucket's delta sum
    (one atomic per tile: wrapping int64 addition is order-free), so unchanged words cost a
    compare and nothing more, and no old word is written out."""
    row = tl.arange(0, ROWS)
    col = tl.arange(0, 32)
    row_start = tile * (ROWS * 32) + row * 32
    offs = row_start[:, None] + col[None, :]
    inb = offs < n_words
    a = tl.load(old_base + offs, mask=inb, other=0)
    b = tl.load(new_base + offs, mask=inb, other=0)
    bits = tl.sum(tl.where(a != b, 1 << col[None, :], 0), axis=1)  # distinct bits: sum == or
    per_row = _popc32(bits)
    cnt = tl.sum(per_row, axis=0)
    if cnt > 0:
        dest = tl.atomic_add(counter_ptr, cnt) + tl.cumsum(per_row, axis=0) - per_row
        # h(q) = A(q mod GROUP) * B(q div GROUP): a tile is shorter than a group, so it spans
        # groups g0 and g0 + 1 at most; each lane adds (new - old) * A to its group's sum and
        # B is applied twice per tile, not once per changed word
        g0 = (first + tile * (ROWS * 32)) >> GROUP_BITS
        acc0 = tl.zeros([ROWS], dtype=tl.int64)
        acc1 = tl.zeros([ROWS], dtype=tl.int64)
        for _ in range(0, tl.max(per_row, axis=0)):
            live = bits != 0
            p = row_start + _popc32((bits & (0 - bits)) - 1)
            bits = bits & (bits - 1)
            v = tl.load(new_base + p, mask=live, other=0)
            o = tl.load(old_base + p, mask=live, other=0)
            q = first + p
            t = tl.where(live, _change_a(v, o, q, GROUP), 0)
            upper = (q >> GROUP_BITS) != g0
            acc0 += tl.where(upper, 0, t)
            acc1 += tl.where(upper, t, 0)
            keep = live & (dest < cap)
            tl.store(pos_ptr + dest, q.to(tl.int32), mask=keep)
            tl.store(val_ptr + dest, v, mask=keep)
            # A row's lanes are copies in several threads (the 1-D layout is sliced from the 2-D
            # tile): no copy may write the base word before every copy has read it, or a late copy
            # reads the new word and adds 0 to the delta sum. Within one warp the copies move in
            # step; where the layout puts them in two warps (64 rows, 4 warps) the sums differed.
            tl.debug_barrier()
            tl.store(old_base + p, v, mask=live)
            dest += live.to(tl.int32)
        s0 = tl.sum(acc0, axis=0)
        s1 = tl.sum(acc1, axis=0)
        tl.atomic_add(delta_ptr, s0 * _mix_b(g0) + s1 * _mix_b(g0 + 1))


@triton.jit
def _change_a(v, o, q, GROUP: tl.constexpr):
    """(v - o) * A(q mod GROUP) in wrapping int64: a changed word's term of the delta sum
    before its group's factor B."""
    return (v.to(tl.int64) - o.to(tl.int64)) * _mix_a((q & (GROUP - 1)).to(tl.int32)).to(tl.int64)


@triton.jit
def _diff_sparse_kernel(new_ptr, base_ptr, n_words, first, counter_ptr, delta_ptr, pos_ptr, val_ptr, cap, ROWS: tl.constexpr,
                        GROUP: tl.constexpr, GROUP_BITS: tl.constexpr):
    """The one-pass diff of one piece, a tile per program (see _diff_rows)."""
    _diff_rows(new_ptr, base_ptr, tl.program_id(0).to(tl.int64), n_words, first, counter_ptr, delta_ptr, pos_ptr, val_ptr, cap, ROWS,
               GROUP, GROUP_BITS)


@triton.jit
def _pairs_sum_kernel(pos_ptr, val_ptr, old_ptr, n, out_ptr, BLOCK: tl.constexpr, GROUP: tl.constexpr, GROUP_BITS: tl.constexpr):
    pid = tl.program_id(0)
    idx = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = idx < n
    p = tl.load(pos_ptr + idx, mask=m, other=0).to(tl.int64)
    v = tl.load(val_ptr + idx, mask=m, other=0).to(tl.int64)
    old = tl.load(old_ptr + idx, mask=m, other=0).to(tl.int64)
    a = _mix_a((p & (GROUP - 1)).to(tl.int32)).to(tl.int64)
    tl.store(out_ptr + pid, tl.sum((v - old) * a * _mix_b(p >> GROUP_BITS), axis=0))


@triton.jit
def _checksum_kernel(
    w_ptr, n_words, out_ptr, BLOCK: tl.constexpr, GROUP: tl.constexpr, GROUP_BITS: tl.constexpr, SMALL: tl.constexpr
):
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    w = tl.load(w_ptr + offs, mask=offs < n_words, other=0)
    j = (pid % (GROUP // BLOCK)) * BLOCK + tl.arange(0, BLOCK)
    part = tl.sum(_weighted(w, _mix_a(j), SMALL), axis=0)
    tl.store(out_ptr + pid, part * _mix_b(start >> GROUP_BITS))


@triton.jit
def _delta_sum_kernel(
    pos_ptr, val_ptr, base_ptr, n, out_ptr, BLOCK: tl.constexpr, GROUP: tl.constexpr, GROUP_BITS: tl.constexpr
):
    pid = tl.program_id(0)
    idx = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = idx < n
    p = tl.load(pos_ptr + idx, mask=m, other=0)
    v = tl.load(val_ptr + idx, mask=m, other=0).to(tl.int64)
    old = tl.load(base_ptr + p, mask=m, other=0).to(tl.int64)
    a = _mix_a((p & (GROUP - 1)).to(tl.int32)).to(tl.int64)
    tl.store(out_ptr + pid, tl.sum((v - old) * a * _mix_b(p >> GROUP_BITS), axis=0))


# Rows of 32 words per program and warps of the one-pass diff: 256 x 32 words on 8 warps was the
# fastest of the sweep in bench/delta_kernel_probe.py on an H200 (0.84 ms per GiB at 2 % changed).
DIFF_ROWS = 256
DIFF_NUM_WARPS = 8


def on_device_of(t: torch.Tensor) -> contextlib.AbstractContextManager[object]:
    """Launch on `t`'s GPU: Triton launches on the current device (and its stream), which a
    trainer may have left on another GPU than its tensors (an engine on cuda:0 beside a sender on
    cuda:1 refused every launch: 'Pointer argument cannot be accessed from Triton'). Tensors off
    CUDA (Triton's CPU interpreter in tests) launch as they are."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def diff_into(
    new_w: torch.Tensor,
    base_w: torch.Tensor,
    first: int,
    counter: torch.Tensor,
    delta: torch.Tensor,
    positions_out: torch.Tensor,
    values_out: torch.Tensor,
    *,
    rows: int = DIFF_ROWS,
    num_warps: int = DIFF_NUM_WARPS,
) -> None:
    """One pass over a piece of a bucket: for each word of `new_w` that differs from `base_w`,
    claim a slot in `counter` (int32, shared by every piece of the bucket), write `first` + its
    index to `positions_out` and its new word to `values_out` when the slot is below their
    capacity, add h(first + index) * (new - old) to `delta` (one int64, shared likewise) and copy
    the word into `base_w`. Blocks claim slots in any order, so positions are sorted within a
    block only; `counter` and `delta` end at the true count and sum either way. `rows` x 32 words per
    program over `num_warps` warps: the defaults are the fastest measured; every tile shape writes the
    same outputs."""
    n = new_w.numel()
    words = rows * 32
    nb = (n + words - 1) // words
    if nb:
        with on_device_of(new_w):
            _diff_sparse_kernel[(nb,)](
                new_w, base_w, n, first, counter, delta, positions_out, values_out, positions_out.numel(),
                ROWS=rows, GROUP=GROUP_WORDS, GROUP_BITS=GROUP_BITS, num_warps=num_warps,
            )


def pairs_sum(positions: torch.Tensor, values: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """sum over k of h(positions[k]) * (values[k] - old[k]), a 0-d int64 tensor."""
    return _sum_over_pairs(_pairs_sum_kernel, positions, values, old)


def checksum(words: torch.Tensor) -> torch.Tensor:
    """sum_i words[i] * h(i) in wrapping int64, as a 0-d tensor on the words' device."""
    n = words.numel()
    nb = (n + BLOCK_WORDS - 1) // BLOCK_WORDS
    partial = torch.zeros(max(nb, 1), dtype=torch.int64, device=words.device)
    if nb:
        with on_device_of(words):
            _checksum_kernel[(nb,)](
                words, n, partial, BLOCK=BLOCK_WORDS, GROUP=GROUP_WORDS, GROUP_BITS=GROUP_BITS, SMALL=words.element_size() <= 2, num_warps=NUM_WARPS
            )
    return partial.sum()


def delta_sum(positions: torch.Tensor, values: torch.Tensor, base_w: torch.Tensor) -> torch.Tensor:
    """sum over k of h(positions[k]) * (values[k] - base_w[positions[k]]), a 0-d int64 tensor."""
    return _sum_over_pairs(_delta_sum_kernel, positions, values, base_w)


def _sum_over_pairs(kernel: Any, positions: torch.Tensor, values: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    n = positions.numel()
    nb = (n + 4095) // 4096
    partial = torch.zeros(max(nb, 1), dtype=torch.int64, device=positions.device)
    if nb:
        with on_device_of(positions):
            kernel[(nb,)](positions, values, old, n, partial, BLOCK=4096, GROUP=GROUP_WORDS, GROUP_BITS=GROUP_BITS, num_warps=8)
    return partial.sum()
