"""Delta decode: validate a received patch completely, then apply it in place.

Nothing in a payload is trusted: every count must agree with the payload's exact length before
anything is allocated from it, positions must be in range and strictly increasing, bitmask bits
must match the count, padding must be zero. A failure raises PatchError naming the field.
"""

from __future__ import annotations

import numpy as np
import torch

from ckpt_engine.delta import accel
from ckpt_engine.delta.layout import (
    CHUNK_WORDS,
    FORMAT_VERSION,
    HEADER,
    KIND_IDS,
    MAGIC,
    PATCH_HEADER_BYTES,
    DecodedPatch,
    PatchError,
    align8,
    index_bytes,
    max_patch_bytes,
    resolve_impl,
    view_or_copy,
    word_dtype,
    words_of,
)

__all__ = ["apply", "base_words", "decode"]


def _increasing(p: np.ndarray) -> bool:
    """Whether host positions strictly increase: one compiled pass, else numpy's compare."""
    if accel.numba_on():
        from ckpt_engine.delta import host_kernels

        return host_kernels.ordered(p, strict=True)
    return bool((p[1:] > p[:-1]).all())


def _unpack_bits(packed: torch.Tensor) -> torch.Tensor:
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed[:, None] >> shifts) & 1).bool().reshape(-1)


def _nonzero(mask: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of set entries; with the count known, no host sync on accelerators."""
    if mask.device.type != "cpu" and hasattr(torch, "nonzero_static"):
        try:
            return torch.nonzero_static(mask, size=count).reshape(-1)
        except (RuntimeError, NotImplementedError):  # no device kernel in this torch: sync instead
            pass
    return mask.nonzero().reshape(-1)


def _popcount(b: torch.Tensor) -> torch.Tensor:
    """Set bits per byte of a uint8 tensor (uint8 wrapping arithmetic, no lookup table)."""
    x = b - ((b >> 1) & 0x55)
    x = (x & 0x33) + ((x >> 2) & 0x33)
    return (x + (x >> 4)) & 0x0F


def _group_counts(index: torch.Tensor, group_bytes: int) -> torch.Tensor:
    """Set bits in each run of `group_bytes` bytes of a bitmask, int64."""
    pad = (-index.numel()) % group_bytes
    pc = _popcount(index)
    if pad:
        pc = torch.cat([pc, pc.new_zeros(pad)])
    return pc.reshape(-1, group_bytes).sum(1, dtype=torch.int64)


def _fail_first(flags: list[int], names: list[str]) -> None:
    for ok, what in zip(flags, names):
        if not ok:
            raise PatchError(what)


def _bitmask_positions(index: torch.Tensor, pad: torch.Tensor, num_words: int, num_changed: int, how: str) -> torch.Tensor:
    tail_bits = num_words % 8
    if how == "host":
        return _bitmask_positions_host(index.numpy(), pad.numpy(), num_words, num_changed)
    checks = [pad.eq(0).all()]
    names = ["patch padding after the bitmask is not zero"]
    if tail_bits:
        checks.append(index[-1:].bitwise_right_shift(tail_bits).eq(0).all())
        names.append(f"bitmask has bits set past word {num_words}")
    device = index.device
    if how == "triton":
        from ckpt_engine.delta import kernels
    group_bytes = (kernels.BLOCK_WORDS if how == "triton" else CHUNK_WORDS) // 8
    counts = _group_counts(index, group_bytes)
    checks.append(counts.sum() == num_changed)
    names.append(f"bitmask has a different number of set bits than the header's num_changed={num_changed}")
    flags = torch.stack(checks).to(torch.int64)
    if how == "triton":
        _fail_first(flags.tolist(), names)
        positions = torch.empty(num_changed, dtype=torch.int64, device=device)
        offsets = torch.cumsum(counts, 0) - counts
        kernels.compact(index, index.numel(), counts, offsets, positions_out=positions)
        return positions
    both = torch.cat([flags, counts]).tolist()  # one host sync for checks and chunk counts
    _fail_first(both[: len(names)], names)
    positions = torch.empty(num_changed, dtype=torch.int64, device=device)
    at = 0
    for k, c in enumerate(both[len(names) :]):
        if c:
            bits = _unpack_bits(index[k * group_bytes : (k + 1) * group_bytes])
            positions[at : at + c].copy_(_nonzero(bits, c) + k * CHUNK_WORDS)
            at += c
    return positions


def _bitmask_positions_host(index: np.ndarray, pad: np.ndarray, num_words: int, num_changed: int) -> torch.Tensor:
    if pad.any():
        raise PatchError("patch padding after the bitmask is not zero")
    if num_words % 8 and index[-1] >> (num_words % 8):
        raise PatchError(f"bitmask has bits set past word {num_words}")
    if int(np.bitwise_count(index).sum(dtype=np.int64)) != num_changed:
        raise PatchError(f"bitmask has a different number of set bits than the header's num_changed={num_changed}")
    positions = np.empty(num_changed, dtype=np.int64)
    group_bytes = CHUNK_WORDS // 8
    at = 0
    for k in range(0, index.size, group_bytes):
        local = np.flatnonzero(np.unpackbits(index[k : k + group_bytes], bitorder="little"))
        positions[at : at + local.size] = local + k * 8
        at += local.size
    return torch.from_numpy(positions)


def _checked_positions(index: torch.Tensor, pad: torch.Tensor, kind: str, num_words: int, how: str, check_range: bool = True) -> torch.Tensor:
    """Positions in range; sorted kinds strictly increasing. A scatter32 patch is only range-checked
    (its order is the encoder's block order; the checksum catches a corrupted position), and with
    `check_range` False not even that: its positions stay the payload's int32 words (no copy), and
    the caller counts those outside its regions (ScatteredImage.swap_in) instead of a min/max pass
    and a host sync here."""
    if kind == "scatter32" and not check_range:  # the pad is checked by the caller (DecodedPatch.unchecked)
        return view_or_copy(index, torch.int32)
    narrow = view_or_copy(index, torch.int64 if kind == "positions64" else torch.int32)
    keep32 = kind == "positions32" and not check_range and how == "host" and accel.numba_on()
    positions = narrow if keep32 else narrow.to(torch.int64)  # int32 for a caller that takes them (no widened copy)
    names = ["patch padding after the positions is not zero"]
    if positions.numel():
        names += ["a position is negative", f"a position is >= num_words={num_words}"]
        if kind != "scatter32":
            names += ["positions are not strictly increasing"]
    if how == "host":
        p = positions.numpy()
        flags = [not pad.numpy().any()]
        if p.size:
            if kind == "scatter32":
                flags += [p.min() >= 0, p.max() < num_words]
            else:
                increasing = _increasing(p)
                flags += [p[0] >= 0, p[-1] < num_words, increasing]
        _fail_first(flags, names)
        return positions
    checks = [pad.eq(0).all()]
    if positions.numel():
        if kind == "scatter32":
            checks += [positions.min() >= 0, positions.max() < num_words]
        else:
            checks += [positions[0] >= 0, positions[-1] < num_words, (positions[1:] > positions[:-1]).all()]
    _fail_first(torch.stack(checks).tolist(), names)
    return positions


def decode(
    payload: torch.Tensor, nbytes: int, word_bytes: int, *, impl: str = "auto", check_range: bool = True, head: bytes | None = None
) -> DecodedPatch:
    """Validate a patch for an image of `nbytes` bytes in words of `word_bytes` and return its
    positions and values. Anything malformed raises PatchError before any allocation sized by an
    unchecked field: every count must agree with the payload's exact length. Two host syncs at
    most (the header, then every check at once).

    `check_range=False` is for a caller that counts the positions outside its own regions anyway
    (an in-place receiver: regions end at or before num_words, so a position < 0 or >= num_words
    is outside every one): a scatter32 patch's positions are then not range-checked here and come
    back as int32 (a view of the payload when aligned), and the zero padding after them is left
    to the caller too (`unchecked`, a device count that must be 0): no host sync here for it.
    A positions32 patch on a CPU with numba is checked as always but its positions stay int32.
    `head`: the payload's first PATCH_HEADER_BYTES bytes, when the caller has read them already
    (on a stream of its choice); they are checked like any other."""
    wdt = word_dtype(word_bytes)
    max_patch_bytes(nbytes, word_bytes)
    if payload.dtype != torch.uint8 or payload.dim() != 1 or not payload.is_contiguous():
        raise PatchError(f"payload must be a 1-D uint8 tensor, got {payload.dtype} of shape {tuple(payload.shape)}")
    if payload.numel() < PATCH_HEADER_BYTES:
        raise PatchError(f"payload has {payload.numel()} bytes, shorter than the {PATCH_HEADER_BYTES}-byte header")
    how = resolve_impl(payload.device, impl)
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
        if kind in ("positions32", "scatter32") and num_words >= 2**31:
            raise PatchError(f"int32 positions cannot address {num_words} words")
        index_len = index_bytes(kind, num_words, num_changed)
        values_at = PATCH_HEADER_BYTES + align8(index_len)
        expected = values_at + num_changed * word_bytes
        if payload.numel() != expected:
            raise PatchError(
                f"payload has {payload.numel()} bytes, a {kind} patch of {num_changed} changed words of "
                f"{num_words} needs exactly {expected}"
            )
        index = payload[PATCH_HEADER_BYTES : PATCH_HEADER_BYTES + index_len]
        pad = payload[PATCH_HEADER_BYTES + index_len : values_at]
        if kind == "bitmask":
            positions = _bitmask_positions(index, pad, num_words, num_changed, how)
        else:
            positions = _checked_positions(index, pad, kind, num_words, how, check_range)
        values = view_or_copy(payload[values_at:expected], wdt)
        unchecked = None
        if kind == "scatter32" and not check_range:
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


def apply(base: torch.Tensor, patch: DecodedPatch, *, impl: str = "auto") -> None:
    """base[positions] = values, in place (words, so any dtype's bits are written unchanged)."""
    bw = base_words(base, patch)
    with torch.profiler.record_function("ckpt_engine.delta.apply"):
        if resolve_impl(base.device, impl) == "host":
            bw.numpy()[patch.positions.numpy()] = patch.values.numpy()
        else:
            bw.index_copy_(0, patch.positions, patch.values)
