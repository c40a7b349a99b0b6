"""Patch format of the delta codec: header, section sizes and the checks shared by encode and decode.

Layout (little-endian, every section 8-byte aligned from the patch start):
  header (PATCH_HEADER_BYTES = 32): magic u32 | version u8 | kind u8 | word_bytes u8 | 0 u8 |
      num_words i64 | num_changed i64 | delta_sum i64
  index: kind 4 ("scatter32") = distinct int32 word positions, zero-padded to 8 bytes, in no
         order a reader may rely on (tile order from the GPU diff)
  values: num_changed words of `word_bytes` (their NEW bits), in the order of the index

One format: the bitmask and sorted-position kinds (1-3) were retired with the two-pass encoder
(docs/delta.md); buckets of 2**31 words or more always go dense.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

from ckpt_engine.copies import put_int64s_
from ckpt_engine.delta import accel

__all__ = [
    "FORMAT_VERSION",
    "HEADER",
    "KIND_IDS",
    "MAGIC",
    "PATCH_HEADER_BYTES",
    "DecodedPatch",
    "PatchError",
    "Row",
    "align8",
    "resolve_impl",
    "store_delta_sum",
    "view_or_copy",
    "word_dtype",
    "words_of",
    "write_header",
]

PATCH_HEADER_BYTES = 32
FORMAT_VERSION = 1
Row = tuple[int, int, int]
"""(data pointer, length in words, first bucket word) of one piece a patch is diffed from."""
MAGIC = 0x50444B43  # b"CKDP" read as a little-endian u32
HEADER = struct.Struct("<IBBBBqqq")
KIND_IDS = {"scatter32": 4}
CHUNK_WORDS = 1 << 22  # torch path: 4 Mi words a chunk keeps temporaries near 64 MiB at most
_WORD_DTYPES = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class PatchError(ValueError):
    """A patch payload is malformed or hostile; the message says which field is wrong."""


@dataclass(frozen=True)
class DecodedPatch:
    """A validated patch. `values` is a view into the payload: keep the payload until applied."""

    positions: torch.Tensor  # word indices in [0, num_words): int64 (int32 with decode(check_range=False))
    values: torch.Tensor  # word_dtype(word_bytes), one per position
    delta_sum: int  # the sender's sum of h(i) * (new_i - old_i), as a signed int64
    num_words: int
    word_bytes: int
    kind: str
    unchecked: torch.Tensor | None = None
    """decode(check_range=False): a 0-d device count that must be 0 (nonzero padding bytes), left
    for the caller to confirm with its own checks instead of a host sync in decode."""


def word_dtype(word_bytes: int) -> torch.dtype:
    """The signed integer dtype that views an image as words of `word_bytes` bytes."""
    try:
        return _WORD_DTYPES[word_bytes]
    except (KeyError, TypeError):
        raise ValueError(f"word_bytes must be one of 1, 2, 4, 8, got {word_bytes!r}") from None


def align8(n: int) -> int:
    """`n` rounded up to a multiple of 8: every patch section starts 8-byte aligned."""
    return (n + 7) & ~7


def words_of(t: torch.Tensor, word_bytes: int, name: str) -> torch.Tensor:
    """A flat uint8 image viewed as signed words; ValueError naming `name` when it cannot be."""
    dtype = word_dtype(word_bytes)
    if t.dtype != torch.uint8 or t.dim() != 1 or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous 1-D uint8 tensor, got {t.dtype} of shape {tuple(t.shape)}")
    if t.numel() % word_bytes:
        raise ValueError(f"{name} has {t.numel()} bytes, not a multiple of word_bytes={word_bytes}")
    try:
        return t.view(dtype)
    except RuntimeError as exc:
        raise ValueError(f"{name} is not aligned to word_bytes={word_bytes}: {exc}") from None


def view_or_copy(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """View bytes as `dtype`; copy first when the slice is not aligned for it."""
    try:
        return t.view(dtype)
    except RuntimeError:
        return t.clone().view(dtype)


def resolve_impl(device: torch.device, impl: str) -> str:
    """Resolve `impl` ("auto", "torch", "triton") for a device: auto picks the fused Triton
    kernels on CUDA when importable, plain torch ops elsewhere (a CPU included)."""
    if impl not in ("auto", "torch", "triton"):
        raise ValueError(f"impl must be 'auto', 'torch' or 'triton', got {impl!r}")
    if impl == "triton" and not accel.triton_on(device):
        raise ValueError(f"impl='triton' needs CUDA and Triton; device is {device}")
    if impl == "auto":
        return "triton" if accel.triton_on(device) else "torch"
    return impl


def write_header(out: torch.Tensor, kind: str, word_bytes: int, num_words: int, num_changed: int) -> None:
    """Header fields but delta_sum, without a host sync (copies.put_int64s_)."""
    head = HEADER.pack(MAGIC, FORMAT_VERSION, KIND_IDS[kind], word_bytes, 0, num_words, num_changed, 0)
    fields = [int.from_bytes(head[8 * i : 8 * i + 8], "little", signed=True) for i in range(3)]
    put_int64s_(out[: PATCH_HEADER_BYTES - 8].view(torch.int64), fields)


def store_delta_sum(out: torch.Tensor, delta: torch.Tensor) -> None:
    """Put the (device-side) delta sum in the header without a host sync."""
    out[PATCH_HEADER_BYTES - 8 : PATCH_HEADER_BYTES].view(torch.int64).copy_(delta.reshape(1))


def header_fields(payload: torch.Tensor) -> tuple[int, int]:
    """(num_changed, delta_sum) of a patch this side encoded (one 32-byte device-to-host copy):
    a sender that already holds the patch needs no decode to learn the checksum change."""
    raw = bytes(payload[:PATCH_HEADER_BYTES].cpu().numpy().tobytes())
    fields = HEADER.unpack(raw)
    return fields[6], fields[7]
