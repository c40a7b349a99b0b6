"""The trainer's fp32 -> bf16 cast that records a bucket's patch as it writes (CUDA, one launch).

A trainer with fp32 masters writes its bf16 weights once per optimizer step anyway: that write
reads every master word and can read the bf16 word it replaces for two more bytes a word. This
kernel does both in the one pass the cast already makes: it rounds each master word, compares it
with the bf16 word in place, writes only the words that changed, and records them in the bucket's
scatter32 patch (positions in bucket words, new values, the delta sum), exactly as the one-pass
diff does from a base image (kernels._diff_rows with CAST). The sync then sends the recorded patch
without reading the model at all, and the sender keeps no base copy: the bf16 weights before the
cast are the base.

Pieces (a bf16 tensor, or the chunk of one that falls in this bucket, and its fp32 master) are
read through a table as in direct_kernels.py, each pointer as an offset from one origin per side.
"""

from __future__ import annotations

from typing import Any

import torch

from ckpt_engine.delta import kernels
from ckpt_engine.delta.direct_kernels import tile_table
from ckpt_engine.delta.mixing import GROUP_BITS, GROUP_WORDS

__all__ = ["CastRow", "CastTables", "cast_pieces", "cast_tables"]

# table rows (direct_kernels.tile_table): first tile, first bucket word, length in words, master offset, bf16 offset
_ALIGN_WORDS = 8  # one 16-byte vector load of bf16 words; of fp32 masters, two

try:  # Triton is optional: CPU installs and GPUs without it never call this module.
    import triton
    import triton.language as tl

    _HAVE_TRITON = True
except Exception:  # pragma: no cover - depends on the install
    _HAVE_TRITON = False

if _HAVE_TRITON:
    _diff_rows = kernels._diff_rows

    @triton.jit(do_not_specialize=["cap"])
    def _cast_pieces_kernel(
        table_ptr, tile_piece_ptr, src_ptr, dst_ptr, counter_ptr, delta_ptr, pos_ptr, val_ptr, cap,
        ROWS: tl.constexpr, ALIGN: tl.constexpr, GROUP: tl.constexpr, GROUP_BITS: tl.constexpr,
    ):
        pid = tl.program_id(0).to(tl.int64)
        j = tl.load(tile_piece_ptr + pid).to(tl.int64)
        tile0 = tl.load(table_ptr + j * 5)
        first = tl.load(table_ptr + j * 5 + 1)
        length = tl.load(table_ptr + j * 5 + 2)
        src = tl.load(table_ptr + j * 5 + 3)
        dst = tl.load(table_ptr + j * 5 + 4)
        if ALIGN > 1:  # the host put only pieces aligned to whole vectors in this table
            first = tl.multiple_of(first, ALIGN)
            length = tl.multiple_of(length, ALIGN)
            src = tl.multiple_of(src, ALIGN)
            dst = tl.multiple_of(dst, ALIGN)
        _diff_rows(src_ptr + src, dst_ptr + dst, pid - tile0, length, first, counter_ptr, delta_ptr, pos_ptr, val_ptr, cap, ROWS, GROUP,
                   GROUP_BITS, True)


CastRow = tuple[int, int, int, int]  # (fp32 master pointer, bf16 pointer, length in words, first bucket word)
CastTables = list[tuple[torch.Tensor, torch.Tensor, int, int]]  # per launch: table, tile map, tiles, alignment


def cast_tables(rows: list[CastRow], src_origin: torch.Tensor, dst_origin: torch.Tensor) -> CastTables:
    """The device tables of one bucket's pieces (built once per binding of the trainer's tensors):
    pieces whose every offset is a whole number of 16-byte bf16 vectors go into a launch that
    tells the compiler so (vectorized loads), the rest into a second one."""
    if src_origin.dtype != torch.int32 or dst_origin.dtype != torch.int16:
        raise ValueError("the origins are an fp32 master viewed as int32 and a bf16 tensor viewed as int16")
    split: dict[int, list[tuple[int, int, int, int]]] = {_ALIGN_WORDS: [], 1: []}
    so, do = src_origin.data_ptr(), dst_origin.data_ptr()
    for sp, dp, n, first in rows:
        if not n:
            continue
        if (sp - so) % 4 or (dp - do) % 2:
            raise ValueError(f"piece at bucket word {first} is not aligned to its words")
        s, d = (sp - so) // 4, (dp - do) // 2
        aligned = all(x % _ALIGN_WORDS == 0 for x in (s, d, first, n)) and sp % 16 == 0 and dp % 16 == 0
        split[_ALIGN_WORDS if aligned else 1].append((first, n, s, d))
    out: CastTables = []
    for align, pieces in split.items():
        if pieces:
            out.append((*tile_table(pieces, dst_origin.device), align))
    return out


def cast_pieces(
    tables: CastTables, src_origin: torch.Tensor, dst_origin: torch.Tensor, targets: tuple[Any, Any, torch.Tensor, torch.Tensor]
) -> None:
    """Queue the recording cast of one bucket's pieces: `targets` = (count, delta sum, positions,
    values) of its BucketDiff."""
    counter, delta, positions, values = targets
    for table, tile_piece, tiles, align in tables:
        _cast_pieces_kernel[(tiles,)](
            table, tile_piece, src_origin, dst_origin, counter, delta, positions, values, positions.numel(),
            ROWS=kernels.DIFF_ROWS, ALIGN=align, GROUP=GROUP_WORDS, GROUP_BITS=GROUP_BITS, num_warps=kernels.DIFF_NUM_WARPS,
        )
