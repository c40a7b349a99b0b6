"""Batched tensor copies for packing and loading buckets.

One `torch._foreach_copy_` launch per bucket and dtype pair: thousands of small tensors cost a few
kernel launches, not thousands of Python-level copies. (Routing large tensors through per-tensor
`copy_` was measured on 2xH200 and made the MoE sync slower: 0.785 vs 0.943 of raw.) PyTorch's CUDA
`_foreach_copy_` takes its batched path only when every tensor of its lists shares one dtype, and
copies pair by pair otherwise: an FP8 bucket mixes e4m3 codes, float32 scales and bf16 norms.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ckpt_engine.copy_kernel import ReplayedCopies

__all__ = ["ALONE_BYTES", "batched_copy_", "copy_groups", "copy_large_alone_", "put_int64s_"]

ALONE_BYTES = 16 << 20
"""From this size a pair is copied with a `copy_` of its own (a device memcpy), smaller ones in one
batched copy. On an H200 a `_foreach_copy_` over a 7B model's tensors ran at 0.66 x a flat copy of
the bytes (`bench/colocated_copy_probe.py`), while a copy launched alone costs ~5 us of host time:
from 16 MiB (~8 us of copying at 2 TB/s) a pair pays for its own launch. A 7B model's large weights
go alone (~140 launches); MoE experts (Qwen3-30B-A3B: 3 MiB each) stay batched. Measured on one
H200 (`ckpt-engine bench --backend colocated --in-place`): at 1 MiB a 30B-A3B sync (12 layers) ran
at 0.10-0.12 x one device copy, at 16 MiB 0.27-0.29 x, all batched 0.18-0.22 x; 7B 0.73 / 0.76 x."""


def batched_copy_(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    """dsts[i].copy_(srcs[i]) for every i, one batched launch per (destination, source) dtype pair
    (casting where they differ). The destinations must not overlap (then order does not matter).

    Pairs that are already the same tensor (a receiver reassembled it in its destination) are skipped.
    """
    for keep_d, keep_s in copy_groups(dsts, srcs):
        torch._foreach_copy_(keep_d, keep_s)


def copy_large_alone_(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    """dsts[i].copy_(srcs[i]) for every i (one dtype a pair, no aliasing). On a GPU every contiguous
    aligned pair goes into one launch (`copy_kernel.ReplayedCopies`, its table kept for the same
    tensors: 0.95 x a flat copy of the bytes on one H200, where the way below ran at 0.93 x for a 7B
    model and 0.56 x for Qwen3-30B-A3B's experts); the rest, and everything elsewhere: pairs of
    `ALONE_BYTES` and up one `copy_` each, the others in one batched copy."""
    if srcs and srcs[0].is_cuda:
        left = _replayed().copy(dsts, srcs)
        if not left:
            return
        dsts, srcs = [dsts[i] for i in left], [srcs[i] for i in left]
    small_d: list[torch.Tensor] = []
    small_s: list[torch.Tensor] = []
    for d, s in zip(dsts, srcs):
        if s.numel() * s.element_size() >= ALONE_BYTES:
            d.copy_(s)
        else:
            small_d.append(d)
            small_s.append(s)
    if small_d:
        torch._foreach_copy_(small_d, small_s)


@functools.cache
def _replayed() -> ReplayedCopies:
    """The process's kept copy tables (Triton is imported only where a GPU copies)."""
    from ckpt_engine.copy_kernel import ReplayedCopies

    return ReplayedCopies()


def copy_groups(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """`batched_copy_`'s launches, one (destinations, sources) pair of lists per dtype pair, for a
    caller that replays the same copies every sync (the per-pair checks cost ~1 us a tensor)."""
    groups: dict[tuple[torch.dtype, torch.dtype], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for d, s in zip(dsts, srcs):
        if d.data_ptr() == s.data_ptr() and d.numel() and d.dtype == s.dtype and d.shape == s.shape and d.stride() == s.stride():
            continue
        keep_d, keep_s = groups.setdefault((d.dtype, s.dtype), ([], []))
        keep_d.append(d)
        keep_s.append(s)
    return list(groups.values())


def put_int64s_(dst: torch.Tensor, values: Sequence[int]) -> None:
    """dst[i] = values[i] for a 1-D int64 tensor, without a host sync: on CUDA one copy from
    pinned memory (a copy from pageable memory would wait for the work queued before it),
    elsewhere one fill kernel per value."""
    if dst.dtype != torch.int64 or dst.dim() != 1 or dst.numel() != len(values):
        raise ValueError(f"need a 1-D int64 tensor of {len(values)} values, got {dst.dtype} of shape {tuple(dst.shape)}")
    if dst.is_cuda:
        src = torch.tensor(list(values), dtype=torch.int64).pin_memory()
        dst.copy_(src, non_blocking=True)  # the host allocator keeps `src` until the copy has run
        return
    for i, v in enumerate(values):
        dst[i].fill_(v)
