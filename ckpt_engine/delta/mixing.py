"""The position weights h(i) of the delta checksum, shared by the torch and Triton paths.

h(i) = A(i mod 2**16) * B(i div 2**16) in wrapping int64, with A and B odd mixes of their argument,
so h(i) is odd (a single changed word always changes the sum) and a chunk of 2**16 words needs one
table of A plus one scalar B. A is a 31-bit value from 32-bit arithmetic, so a GPU multiplies a
word by it with one widening 32-bit multiply; B (one per 2**16 words) is a 64-bit mix.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["GROUP_BITS", "GROUP_WORDS", "MIX_A", "MIX_B", "mix", "mix_a", "mix_b", "table_a"]

GROUP_BITS = 16
GROUP_WORDS = 1 << GROUP_BITS
MIX_A = 0x9E3779B1  # a 32-bit odd multiplier
MIX_B = -4658895280553007687  # 0xBF58476D1CE4E5B9 as a signed int64


def mix_a(j: torch.Tensor) -> torch.Tensor:
    """A(j) = (((j + 1) * MIX_A mod 2**32) >> 1) | 1 for int64 j in [0, 2**16): odd, < 2**31."""
    x = ((j + 1) * MIX_A).bitwise_and_(0xFFFFFFFF)
    return (x >> 1).bitwise_or_(1)


def mix_b(k: torch.Tensor) -> torch.Tensor:
    """B(k) = (x ^ (x >> 31)) | 1 with x = (k + 1) * MIX_B."""
    x = (k + 1) * MIX_B
    x ^= x >> 31
    return x.bitwise_or_(1)


def mix(idx: torch.Tensor) -> torch.Tensor:
    """h(i) for an int64 tensor of word indices."""
    return mix_a(idx & (GROUP_WORDS - 1)).mul_(mix_b(idx >> GROUP_BITS))


@functools.lru_cache(maxsize=8)
def table_a(device: torch.device) -> torch.Tensor:
    """A(j) for j in [0, 2**16), cached per device (512 KiB)."""
    return mix_a(torch.arange(GROUP_WORDS, dtype=torch.int64, device=device))
