"""The peer join's checksums of many device tensors in one Triton launch per word size.

`delta.checksums.checksum` launches once per tensor plus a few torch ops: a 24-layer Qwen3-30B-A3B
image has 9,435 checkpoint tensors, and their checksums took 0.9 s of a join on each side on an
H200 against 0.1 s of bytes. Here every tensor of one word size is one row of a table (its address,
its words, where its sum goes), the launch has a program per block of `BLOCK` words of every tensor,
and each program adds its block's weighted sum into its tensor's sum (wrapping int64 addition is
order-free, so the result does not depend on which block lands first). The value equals
`delta.checksums.checksum(bytes, word)` tensor by tensor (tests/test_elastic_checksum_kernel.py, in
Triton's interpreter on the CPU). Imported only where CUDA tensors are checksummed (it needs Triton).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ckpt_engine.delta.kernels import on_device_of
from ckpt_engine.delta.mixing import GROUP_BITS, GROUP_WORDS, MIX_A, MIX_B

__all__ = ["BLOCK", "checksums_at"]

BLOCK = 8192
"""Words per program (divides 2**16, so one B factor of h covers a block: `delta.kernels`' choice)."""
_TL_WORDS = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}
_GROUP_BITS = tl.constexpr(GROUP_BITS)
_BLOCKS_PER_GROUP = tl.constexpr(GROUP_WORDS // BLOCK)
_MIX_A = tl.constexpr(MIX_A)
_MIX_B = tl.constexpr(MIX_B)


def checksums_at(spans: Sequence[tuple[int, int, int]], device: torch.device) -> torch.Tensor:
    """sum_i w_i * h(i) (signed words of `word` bytes, wrapping int64) of each (address, bytes,
    word) span of `device` memory, as an int64 tensor on `device` (one launch per word size, no host
    sync). Each span is whole aligned words of its word size (unchecked: the caller holds the memory,
    as `offer.tensor_checksums` does its tensors, until the result is read). No view made per
    tensor: 9,435 of them cost more host time than the launch."""
    out = torch.zeros(len(spans), dtype=torch.int64, device=device)
    rows: dict[int, list[tuple[int, int, int]]] = {}
    for k, (address, nbytes, w) in enumerate(spans):
        if nbytes:
            rows.setdefault(w, []).append((address, nbytes // w, k))
    with on_device_of(out):  # Triton launches on the current device
        for w, table in rows.items():
            tables, blocks = _tables(table)
            _sums[(blocks.shape[0],)](tables.to(device), blocks.to(device), out, WORD=_TL_WORDS[w], BLOCK=BLOCK)
    return out


def _tables(table: list[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(address, words, output row) per tensor, and (tensor, block within it) per program."""
    tables = torch.tensor(table, dtype=torch.int64)
    counts = (tables[:, 1] + BLOCK - 1) // BLOCK
    total = int(counts.sum())
    which = torch.repeat_interleave(torch.arange(len(table), dtype=torch.int64), counts, output_size=total)
    first = torch.cumsum(counts, 0) - counts
    block = torch.arange(total, dtype=torch.int64) - first[which]
    return tables, torch.stack([which, block], dim=1).contiguous()


@triton.jit
def _sums(tables, blocks, out, WORD: tl.constexpr, BLOCK: tl.constexpr):
    """One block of one tensor: sum of its words times A(position mod 2**16), times B(position
    div 2**16), added into the tensor's sum."""
    pid = tl.program_id(0)
    t = tl.load(blocks + 2 * pid)
    b = tl.load(blocks + 2 * pid + 1)
    base = tl.load(tables + 3 * t).to(tl.pointer_type(WORD))
    n = tl.load(tables + 3 * t + 1)
    row = tl.load(tables + 3 * t + 2)
    start = b * BLOCK
    offs = start + tl.arange(0, BLOCK).to(tl.int64)
    w = tl.load(base + offs, mask=offs < n, other=0).to(tl.int64)
    j = (b % _BLOCKS_PER_GROUP) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    a = ((((j + 1) * _MIX_A) & 0xFFFFFFFF) >> 1) | 1
    x = ((start >> _GROUP_BITS) + 1) * _MIX_B
    x = x ^ (x >> 31)
    tl.atomic_add(out + row, tl.sum(w * a, axis=0) * (x | 1))
