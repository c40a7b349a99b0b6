"""Bucket checksums for `verify=True`: the same function on sender and receiver.

On CPU it is CRC-32 (zlib); on accelerators a position-weighted sum of 32-bit words computed on
the device, so verification never copies a bucket to the host.
"""

from __future__ import annotations

import zlib

import torch

__all__ = ["CHECKSUM_BYTES", "bucket_checksum"]

CHECKSUM_BYTES = 16  # two int64 words travel after the bucket's data
_CHUNK_WORDS = 1 << 24


def bucket_checksum(data: torch.Tensor) -> torch.Tensor:
    """Checksum of a flat uint8 tensor whose length is a multiple of 8; returns int64[2] on its device."""
    if data.dtype != torch.uint8 or data.dim() != 1 or data.numel() % 8:
        raise ValueError("bucket_checksum takes a 1-D uint8 tensor whose length is a multiple of 8")
    if data.device.type == "cpu":
        crc = zlib.crc32(data.numpy().data)
        return torch.tensor([crc, data.numel()], dtype=torch.int64)
    words = data.view(torch.int32)
    total = torch.zeros(2, dtype=torch.int64, device=data.device)
    for start in range(0, words.numel(), _CHUNK_WORDS):
        w = words[start : start + _CHUNK_WORDS].to(torch.int64)
        idx = torch.arange(start + 1, start + 1 + w.numel(), device=data.device, dtype=torch.int64)
        total[0] += w.sum()
        total[1] += (w * (idx % 65521)).sum()
    return total
