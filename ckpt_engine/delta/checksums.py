"""Position-weighted checksums: a full one of an image, and the change a patch makes to it.

checksum(x) = sum_i x_i * h(i) over signed words in wrapping int64 (h in mixing.py, odd), so
checksum(new) = checksum(base) + sum over changed i of h(i) * (new_i - base_i): a receiver checks
a patch from the changed words alone, without re-reading the whole image.
"""

from __future__ import annotations

import torch

from ckpt_engine.delta.decoder import base_words
from ckpt_engine.delta.layout import CHUNK_WORDS, DecodedPatch, resolve_impl, words_of
from ckpt_engine.delta.mixing import GROUP_WORDS, mix, mix_b, table_a

__all__ = ["checksum", "delta_checksum"]

_ROWS = 16  # groups of 2**16 words per step of the torch path: an 8 MiB int64 temporary


def checksum(data: torch.Tensor, word_bytes: int, *, impl: str = "auto") -> torch.Tensor:
    """sum_i w_i * h(i) over the words of `data` (signed, wrapping int64): a 0-d int64 tensor on
    `data`'s device, computed without a host sync, with temporaries of a few MiB to 32 MiB."""
    words = words_of(data, word_bytes, "data")
    how = resolve_impl(data.device, impl)
    with torch.profiler.record_function("ckpt_engine.delta.checksum"):
        if how == "triton":
            from ckpt_engine.delta import kernels

            return kernels.checksum(words)
        return _checksum_torch(words)


def _checksum_torch(words: torch.Tensor) -> torch.Tensor:
    a = table_a(words.device)
    n_full = words.numel() // GROUP_WORDS
    sums = torch.zeros(n_full + 1, dtype=torch.int64, device=words.device)
    groups = words[: n_full * GROUP_WORDS].view(n_full, GROUP_WORDS)
    for k in range(0, n_full, _ROWS):
        rows = groups[k : k + _ROWS].to(torch.int64, copy=True)  # int64 words would alias the input
        torch.sum(rows.mul_(a), dim=1, out=sums[k : k + rows.shape[0]])
    tail = words[n_full * GROUP_WORDS :]
    if tail.numel():
        sums[n_full] = (tail.to(torch.int64) * a[: tail.numel()]).sum()
    b = mix_b(torch.arange(n_full + 1, dtype=torch.int64, device=words.device))
    return sums.mul_(b).sum()


def delta_checksum(base: torch.Tensor, patch: DecodedPatch, *, impl: str = "auto") -> torch.Tensor:
    """sum over the patch's positions of h(i) * (new_i - base_i), from the receiver's own base
    before applying: checksum(base) + this is the checksum of the patched image (0-d int64)."""
    bw = base_words(base, patch)
    how = resolve_impl(base.device, impl)
    with torch.profiler.record_function("ckpt_engine.delta.delta_checksum"):
        if how == "triton":
            from ckpt_engine.delta import kernels

            return kernels.delta_sum(patch.positions, patch.values, bw)
        total_t = torch.zeros((), dtype=torch.int64, device=base.device)
        for s in range(0, patch.positions.numel(), CHUNK_WORDS):
            q = patch.positions[s : s + CHUNK_WORDS]
            diff = patch.values[s : s + CHUNK_WORDS].to(torch.int64) - bw.index_select(0, q).to(torch.int64)
            total_t += mix(q).mul_(diff).sum()
        return total_t
