"""The one-pass diff of a whole bucket in one launch, its pieces read through a table.

One Triton launch per piece costs more host time than the GPU spends comparing a small one (a 30B
MoE bucket holds hundreds of expert slices). Here every program reads its piece from a map of
tiles to pieces (one load: a binary search was 2x slower on expert-sized pieces), reaches it as a
word offset from the bucket's base image, and runs kernels._diff_rows. The table and the map only
change when the pieces move, so a caller diffing the same tensors every sync keeps them (`cache`).

Loads at a runtime offset are only vectorized when the compiler knows its alignment (without it
the encode was 2.3x slower on an H200 than a launch per piece): pieces aligned to 16 bytes go
through a launch that says so (`tl.multiple_of`), the rare rest through a second one.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl

from ckpt_engine.delta import kernels
from ckpt_engine.delta.layout import Row
from ckpt_engine.delta.mixing import GROUP_BITS, GROUP_WORDS

__all__ = ["diff_pieces", "tile_table"]

_ALIGN_BYTES = 16  # one vector load

_diff_rows = kernels._diff_rows


@triton.jit(do_not_specialize=["cap"])
def _diff_pieces_kernel(
    table_ptr, tile_piece_ptr, base_ptr, counter_ptr, delta_ptr, pos_ptr, val_ptr, cap,
    ROWS: tl.constexpr, ALIGN: tl.constexpr, GROUP: tl.constexpr, GROUP_BITS: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    j = tl.load(tile_piece_ptr + pid).to(tl.int64)
    tile0 = tl.load(table_ptr + j * 4)
    first = tl.load(table_ptr + j * 4 + 1)
    length = tl.load(table_ptr + j * 4 + 2)
    rel = tl.load(table_ptr + j * 4 + 3)
    if ALIGN > 1:  # the host put only pieces aligned to whole vectors in this table
        first = tl.multiple_of(first, ALIGN)
        length = tl.multiple_of(length, ALIGN)
        rel = tl.multiple_of(rel, ALIGN)
    _diff_rows(base_ptr + rel, base_ptr + first, pid - tile0, length, first, counter_ptr, delta_ptr, pos_ptr, val_ptr, cap, ROWS, GROUP, GROUP_BITS)


def tile_table(pieces: list[tuple[int, ...]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """For pieces (first bucket word, length in words, *where its words are), the device table of
    rows [first tile, first word, length, *where] and the map of tiles (DIFF_ROWS x 32 words) to
    pieces that a one-launch kernel reads, and the number of tiles."""
    words = kernels.DIFF_ROWS * 32
    table = np.empty((len(pieces), 1 + len(pieces[0])), dtype=np.int64)
    counts = np.empty(len(pieces), dtype=np.int64)
    tile = 0
    for i, (first, n, *where) in enumerate(pieces):
        counts[i] = -(-n // words)
        table[i] = (tile, first, n, *where)
        tile += int(counts[i])
    tile_piece = np.repeat(np.arange(len(pieces), dtype=np.int32), counts)

    def to_dev(a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(a)
        return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t

    return to_dev(table), to_dev(tile_piece), tile


def _tables(rows: list[Row], base_w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """(table of [first tile, first word, length, offset from the base], map of tiles to pieces,
    tiles) of the pieces in `rows`, on the base image's device."""
    if not rows:
        return None
    size, origin = base_w.element_size(), base_w.data_ptr()
    return tile_table([(first, n, (ptr - origin) // size) for ptr, n, first in rows], base_w.device)


def diff_pieces(
    rows: list[Row],
    base_w: torch.Tensor,
    counter: torch.Tensor,
    delta: torch.Tensor,
    positions_out: torch.Tensor,
    values_out: torch.Tensor,
    cache: dict[str, Any] | None = None,
) -> None:
    """kernels.diff_into for every piece of `rows` at once, against the bucket's base image
    `base_w` (1-D words, 16-byte aligned), in one launch (two when some piece is not aligned to
    16 bytes). The pieces' memory must stay as it is until the launch has run (the caller keeps
    it; a temporary freed before that could be reused by the allocator). `cache`: a dict the
    caller keeps per bucket; the device tables are reused while the pieces stay where they are."""
    size = base_w.element_size()
    if base_w.data_ptr() % _ALIGN_BYTES:
        raise ValueError(f"the base image must start {_ALIGN_BYTES}-byte aligned")
    origin = base_w.data_ptr()
    if cache is not None and cache.get("rows") == rows and cache.get("origin") == (origin, kernels.DIFF_ROWS):
        launches = cache["launches"]  # the same pieces where they were: no per-piece work at all
    else:
        align = _ALIGN_BYTES // size
        split: dict[int, list[Row]] = {align: [], 1: []}
        for ptr, n, first in rows:
            if not n:
                continue
            gap = ptr - origin
            if gap % size:
                raise ValueError(f"piece at word {first} is not aligned to its {size}-byte words")
            a = align if (gap // size) % align == 0 and first % align == 0 and n % align == 0 else 1
            split[a].append((ptr, n, first))
        launches = {a: _tables(r, base_w) for a, r in split.items()}
        if cache is not None:
            cache["rows"], cache["origin"], cache["launches"] = list(rows), (origin, kernels.DIFF_ROWS), launches
    for a, made in launches.items():
        if made is not None:
            table, tile_piece, tiles = made
            with kernels.on_device_of(base_w):
                _diff_pieces_kernel[(tiles,)](
                    table, tile_piece, base_w, counter, delta, positions_out, values_out, positions_out.numel(),
                    ROWS=kernels.DIFF_ROWS, ALIGN=a, GROUP=GROUP_WORDS, GROUP_BITS=GROUP_BITS, num_warps=kernels.DIFF_NUM_WARPS,
                )
