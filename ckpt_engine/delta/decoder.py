"""Delta decode: validate a received patch completely, then apply it in place.

Nothing in a payload is trusted: every count must agree with the payload's exact length before
anything is allocated from it, positions must be in range, padding must be zero. A failure raises
PatchError naming the field. Positions are not required in order (a GPU encoder writes them in
tile order); a repeated one makes the receiver's checksum differ from the sender's.
"""

from __future__ import annotations

import torch

from ckpt_engine.delta.layout import (
    FORMAT_VERSION,
    HEADER,
    KIND_IDS,
    MAGIC,
    PATCH_HEADER_BYTES,
    DecodedPatch,
    PatchError,
    align8,
    view_or_copy,
    word_dtype,
    words_of,
)

__all__ = ["apply", "base_words", "decode"]


def _checked_positions(index: torch.Tensor, pad: torch.Tensor, num_words: int, check_range: bool) -> torch.Tensor:
    """Positions in range, as int64; with `check_range` False not even that: they stay the
    payload's int32 words (no copy), and the caller counts those outside its regions
    (ScatteredImage.swap_in) instead of a min/max pass and a host sync here."""
    if not check_range:  # the pad is checked by the caller (DecodedPatch.unchecked)
        return view_or_copy(index, torch.int32)
    positions = view_or_copy(index, torch.int32).to(torch.int64)
    checks = {"patch padding after the positions is not zero": pad.eq(0).all()}
    if positions.numel():
        checks["a position is negative"] = positions.min() >= 0
        checks[f"a position is >= num_words={num_words}"] = positions.max() < num_words
    for what, ok in zip(checks, torch.stack(list(checks.values())).tolist()):  # one host sync for every check
        if not ok:
            raise PatchError(what)
    return positions


def decode(
    payload: torch.Tensor, nbytes: int, word_bytes: int, *, check_range: bool = True, head: bytes | None = None
) -> DecodedPatch:
    """Validate a patch for an image of `nbytes` bytes in words of `word_bytes` and return its
    positions and values. Anything malformed raises PatchError before any allocation sized by an
    unchecked field. Two host syncs at most (the header, then every check at once).

    `check_range=False`: for an in-place receiver, which counts positions outside its regions anyway;
    positions come back unchecked as int32 (a view of the payload when aligned) and the padding check
    is left to it (`unchecked`, a device count that must be 0), with no host sync for it here.
    `head`: the payload's first PATCH_HEADER_BYTES bytes, when the caller has read them already.
    """
    wdt = word_dtype(word_bytes)
    if nbytes < 0 or nbytes % word_bytes:
        raise ValueError(f"nbytes={nbytes} must be >= 0 and a multiple of word_bytes={word_bytes}")
    if payload.dtype != torch.uint8 or payload.dim() != 1 or not payload.is_contiguous():
        raise PatchError(f"payload must be a 1-D uint8 tensor, got {payload.dtype} of shape {tuple(payload.shape)}")
    if payload.numel() < PATCH_HEADER_BYTES:
        raise PatchError(f"payload has {payload.numel()} bytes, shorter than the {PATCH_HEADER_BYTES}-byte header")
    with torch.profiler.record_function("ckpt_engine.delta.decode"):
        if head is None:
            head = payload[:PATCH_HEADER_BYTES].cpu().numpy().tobytes()
        elif len(head) != PATCH_HEADER_BYTES:
            raise PatchError(f"the caller's header copy has {len(head)} bytes, not {PATCH_HEADER_BYTES}")
        magic, version, kind_id, wb, reserved, num_words, num_changed, delta_sum = HEADER.unpack(head)
        if magic != MAGIC:
            raise PatchError(f"bad magic 0x{magic:08x}: not a ckpt-engine delta patch")
        if version != FORMAT_VERSION:
            raise PatchError(f"patch format version {version}, this codec reads {FORMAT_VERSION}")
        kind = {v: k for k, v in KIND_IDS.items()}.get(kind_id)
        if kind is None:
            raise PatchError(f"unknown patch kind {kind_id}")
        if wb != word_bytes or reserved != 0:
            raise PatchError(f"patch word_bytes={wb} (reserved byte {reserved}), expected {word_bytes} (reserved 0)")
        if num_words != nbytes // word_bytes:
            raise PatchError(f"patch is for {num_words} words, the image has {nbytes // word_bytes}")
        if not 0 <= num_changed <= num_words:
            raise PatchError(f"num_changed={num_changed} is outside [0, num_words={num_words}]")
        if num_words >= 2**31:
            raise PatchError(f"int32 positions cannot address {num_words} words")
        index_len = 4 * num_changed
        values_at = PATCH_HEADER_BYTES + align8(index_len)
        expected = values_at + num_changed * word_bytes
        if payload.numel() != expected:
            raise PatchError(
                f"payload has {payload.numel()} bytes, a {kind} patch of {num_changed} changed words of "
                f"{num_words} needs exactly {expected}"
            )
        index = payload[PATCH_HEADER_BYTES : PATCH_HEADER_BYTES + index_len]
        pad = payload[PATCH_HEADER_BYTES + index_len : values_at]
        positions = _checked_positions(index, pad, num_words, check_range)
        values = view_or_copy(payload[values_at:expected], wdt)
        unchecked = None
        if not check_range:
            unchecked = pad.ne(0).sum() if pad.numel() else torch.zeros((), dtype=torch.int64, device=payload.device)
        return DecodedPatch(positions, values, delta_sum, num_words, word_bytes, kind, unchecked)


def base_words(base: torch.Tensor, patch: DecodedPatch) -> torch.Tensor:
    """`base` as words, checked against the patch's image size and device."""
    bw = words_of(base, patch.word_bytes, "base")
    if bw.numel() != patch.num_words or base.device != patch.positions.device:
        raise ValueError(
            f"base has {bw.numel()} words on {base.device}, the patch is for {patch.num_words} words on {patch.positions.device}"
        )
    return bw


def apply(base: torch.Tensor, patch: DecodedPatch) -> None:
    """base[positions] = values, in place (words, so any dtype's bits are written unchanged)."""
    bw = base_words(base, patch)
    with torch.profiler.record_function("ckpt_engine.delta.apply"):
        bw.index_copy_(0, patch.positions.to(torch.int64), patch.values)  # int32 from decode(check_range=False)
