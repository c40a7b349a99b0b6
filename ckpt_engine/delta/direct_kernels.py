"""The one-pass diff of a whole bucket in one launch, its pieces read through a table.

A bucket holds tens to thousands of tensors; one kernel launch per piece costs more host time
than the GPU spends comparing a small one. Here every program finds its piece by binary search
over the pieces' first tile (a table of a few int64 per piece: first tile, first bucket word,
length, and the piece's offset in words from one anchor tensor, so any tensor is reachable through
one pointer), then runs the same compare / row-mask / bit-walk as kernels._diff_sparse_kernel. The
base side is the bucket's contiguous base image.
"""

from __future__ import annotations

import torch

from ckpt_engine.delta import kernels

__all__ = ["TABLE_COLUMNS", "diff_pieces"]

TABLE_COLUMNS = 4  # first tile, first bucket word, length in words, offset from the anchor in words

try:  # Triton is optional: CPU installs and GPUs without it never call this module.
    import triton
    import triton.language as tl

    _HAVE_TRITON = True
except Exception:  # pragma: no cover - depends on the install
    _HAVE_TRITON = False

if _HAVE_TRITON:
    _popc32 = kernels._popc32

    @triton.jit(do_not_specialize=["n_pieces", "steps", "cap"])
    def _diff_pieces_kernel(
        table_ptr, n_pieces, steps, anchor_ptr, base_ptr, counter_ptr, pos_ptr, val_ptr, old_ptr, cap, ROWS: tl.constexpr
    ):
        pid = tl.program_id(0).to(tl.int64)
        j = pid * 0
        stride = 1 << (steps - 1)
        for _ in range(steps):
            cand = j + stride
            s = tl.load(table_ptr + cand * 4, mask=cand < n_pieces, other=9223372036854775807)
            j = tl.where(s <= pid, cand, j)
            stride = stride // 2
        tile0 = tl.load(table_ptr + j * 4)
        first = tl.load(table_ptr + j * 4 + 1)
        length = tl.load(table_ptr + j * 4 + 2)
        rel = tl.load(table_ptr + j * 4 + 3)
        row = tl.arange(0, ROWS)
        col = tl.arange(0, 32)
        row_start = (pid - tile0) * (ROWS * 32) + row * 32
        offs = row_start[:, None] + col[None, :]
        inb = offs < length
        a = tl.load(base_ptr + first + offs, mask=inb, other=0)
        b = tl.load(anchor_ptr + rel + offs, mask=inb, other=0)
        bits = tl.sum(tl.where(a != b, 1 << col[None, :], 0), axis=1)  # distinct bits: sum == or
        per_row = _popc32(bits)
        cnt = tl.sum(per_row, axis=0)
        if cnt > 0:
            dest = tl.atomic_add(counter_ptr, cnt) + tl.cumsum(per_row, axis=0) - per_row
            for _ in range(0, tl.max(per_row, axis=0)):
                live = bits != 0
                low = bits & (0 - bits)
                p = row_start + _popc32(low - 1)
                v = tl.load(anchor_ptr + rel + p, mask=live)
                o = tl.load(base_ptr + first + p, mask=live)
                keep = live & (dest < cap)
                tl.store(pos_ptr + dest, (first + p).to(tl.int32), mask=keep)
                tl.store(val_ptr + dest, v, mask=keep)
                tl.store(old_ptr + dest, o, mask=keep)
                tl.store(base_ptr + first + p, v, mask=live)
                dest += live.to(tl.int32)
                bits = bits & (bits - 1)


def diff_pieces(
    news: list[torch.Tensor],
    firsts: list[int],
    base_w: torch.Tensor,
    counter: torch.Tensor,
    positions_out: torch.Tensor,
    values_out: torch.Tensor,
    old_out: torch.Tensor,
) -> None:
    """kernels.diff_into for every (new words, first bucket word) piece at once, against the
    bucket's base image `base_w` (1-D words), in one launch. The pieces' tensors must stay
    unchanged until the launch has run (the caller keeps them)."""
    pieces = [(t, f) for t, f in zip(news, firsts) if t.numel()]
    if not pieces:
        return
    words = kernels.DIFF_ROWS * 32
    anchor = min((t for t, _f in pieces), key=lambda t: t.data_ptr())
    size = anchor.element_size()
    rows, tile = [], 0
    for t, f in pieces:
        rows.append((tile, f, t.numel(), (t.data_ptr() - anchor.data_ptr()) // size))
        tile += -(-t.numel() // words)
    host = torch.tensor(rows, dtype=torch.int64).pin_memory() if base_w.is_cuda else torch.tensor(rows, dtype=torch.int64)
    table = host.to(base_w.device, non_blocking=True)
    steps = max(1, len(rows).bit_length())
    _diff_pieces_kernel[(tile,)](
        table, len(rows), steps, anchor, base_w, counter, positions_out, values_out, old_out, positions_out.numel(),
        ROWS=kernels.DIFF_ROWS, num_warps=kernels.DIFF_NUM_WARPS,
    )
