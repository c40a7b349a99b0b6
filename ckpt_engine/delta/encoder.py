"""Delta encode: compare two byte images word by word and write the patch of the changed words.

Three implementations of one layout (layout.py): fused Triton kernels on CUDA (kernels.py), numpy
views on CPU (host.py), and plain torch ops anywhere else. Each makes one host sync at most, to
learn the changed count that picks the encoding and the patch size.
"""

from __future__ import annotations

import numpy as np
import torch

from ckpt_engine.delta import host
from ckpt_engine.delta.layout import (
    CHUNK_WORDS,
    KIND_IDS,
    PATCH_HEADER_BYTES,
    align8,
    index_bytes,
    patch_kind_sizes,
    resolve_impl,
    store_delta_sum,
    word_dtype,
    words_of,
    write_header,
)
from ckpt_engine.delta.mixing import mix

__all__ = ["encode", "encode_into_base", "pack_bits"]

_PACK_MULT = 0x0102040810204080  # eight 0/1 bytes of an int64 -> one byte, byte j to bit j


def _plan(num_words: int, word_bytes: int, num_changed: int, kind: str | None) -> tuple[str, int] | None:
    sizes = patch_kind_sizes(num_words, word_bytes, num_changed)
    if kind is None:
        kind = min(sizes, key=lambda k: (sizes[k], k != "bitmask"))
    elif kind == "positions64":
        sizes[kind] = PATCH_HEADER_BYTES + align8(num_changed * 8) + num_changed * word_bytes
    elif kind not in sizes:
        raise ValueError(f"kind={kind!r} is not possible for {num_words} words; choose from {sorted(sizes)}")
    if sizes[kind] >= num_words * word_bytes:
        return None
    return kind, sizes[kind]


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """bool[L] -> uint8[ceil(L/8)], bit j of byte k = mask[8k+j]; extra bits are zero."""
    pad = (-mask.numel()) % 8
    if pad:
        mask = torch.cat([mask, mask.new_zeros(pad)])
    x = mask.view(torch.uint8).view(torch.int64)
    return ((x * _PACK_MULT) >> 56).bitwise_and_(255).to(torch.uint8)


def _nonzero(mask: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of set entries; with the count known, no host sync on accelerators."""
    if mask.device.type != "cpu" and hasattr(torch, "nonzero_static"):
        try:
            return torch.nonzero_static(mask, size=count).reshape(-1)
        except (RuntimeError, NotImplementedError):  # no device kernel in this torch: sync instead
            pass
    return mask.nonzero().reshape(-1)


def _sections(out: torch.Tensor, kind: str, num_words: int, num_changed: int, word_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(index section bytes, values view) of a patch laid out in `out`."""
    index_len = index_bytes(kind, num_words, num_changed)
    values_at = PATCH_HEADER_BYTES + align8(index_len)
    index = out[PATCH_HEADER_BYTES : PATCH_HEADER_BYTES + index_len]
    out[PATCH_HEADER_BYTES + index_len : values_at].zero_()
    values = out[values_at : values_at + num_changed * word_bytes].view(word_dtype(word_bytes))
    return index, values


def _encode(
    base: torch.Tensor, new: torch.Tensor, word_bytes: int, out: torch.Tensor, kind: str | None, impl: str, update_base: bool
) -> int | None:
    bw = words_of(base, word_bytes, "base")
    nw = words_of(new, word_bytes, "new")
    if base.numel() != new.numel() or base.device != new.device:
        raise ValueError(f"base ({base.numel()} bytes on {base.device}) and new ({new.numel()} bytes on {new.device}) must match")
    if out.dtype != torch.uint8 or out.dim() != 1 or not out.is_contiguous() or out.device != new.device:
        raise ValueError(f"out must be a contiguous 1-D uint8 tensor on {new.device}")
    if out.storage_offset() % 8:
        raise ValueError(f"out must start at a multiple of 8 bytes of its storage, starts at {out.storage_offset()}")
    if kind is not None and kind not in KIND_IDS:
        raise ValueError(f"kind must be None or one of {sorted(KIND_IDS)}, got {kind!r}")
    how = resolve_impl(new.device, impl)
    if how == "triton":
        return _encode_triton(bw, nw, word_bytes, out, kind, update_base)
    if how == "host":
        return _encode_host(bw, nw, word_bytes, out, kind, update_base)
    return _encode_torch(bw, nw, word_bytes, out, kind, update_base)


def _finish(out: torch.Tensor, n: int, delta: torch.Tensor) -> int:
    store_delta_sum(out, delta)
    return n


def _check_out(out: torch.Tensor, n: int) -> None:
    if out.numel() < n:
        raise ValueError(f"out has {out.numel()} bytes, the patch needs {n}: size it with max_patch_bytes()")


def _encode_torch(bw: torch.Tensor, nw: torch.Tensor, word_bytes: int, out: torch.Tensor, kind: str | None, update_base: bool) -> int | None:
    num_words = bw.numel()
    starts = range(0, num_words, CHUNK_WORDS)
    counts = torch.zeros(max(len(starts), 1), dtype=torch.int64, device=bw.device)
    for k, s in enumerate(starts):
        counts[k] = torch.ne(bw[s : s + CHUNK_WORDS], nw[s : s + CHUNK_WORDS]).sum()
    chunk_counts = counts.tolist()  # the one host sync
    num_changed = int(sum(chunk_counts))
    plan = _plan(num_words, word_bytes, num_changed, kind)
    if plan is None:
        return None
    kind, n = plan
    _check_out(out, n)
    write_header(out, kind, word_bytes, num_words, num_changed)
    index, values = _sections(out, kind, num_words, num_changed, word_bytes)
    positions = None if kind == "bitmask" else index.view(torch.int32 if kind == "positions32" else torch.int64)
    delta = torch.zeros((), dtype=torch.int64, device=bw.device)
    at = 0
    for k, s in enumerate(starts):
        c = chunk_counts[k]
        if kind == "bitmask":
            e = min(s + CHUNK_WORDS, num_words)
            if c:
                mask = torch.ne(bw[s:e], nw[s:e])
                index[s // 8 : (e + 7) // 8].copy_(pack_bits(mask))
            else:
                index[s // 8 : (e + 7) // 8].zero_()
        if not c:
            continue
        if kind != "bitmask":
            mask = torch.ne(bw[s : s + CHUNK_WORDS], nw[s : s + CHUNK_WORDS])
        local = _nonzero(mask, c)
        new_vals = nw[s:].index_select(0, local)
        old_vals = bw[s:].index_select(0, local)
        pos = local + s
        values[at : at + c].copy_(new_vals)
        if positions is not None:
            positions[at : at + c].copy_(pos)
        delta += (mix(pos).mul_(new_vals.to(torch.int64) - old_vals.to(torch.int64))).sum()
        if update_base:
            bw[s : s + CHUNK_WORDS].index_copy_(0, local, new_vals)
        at += c
    return _finish(out, n, delta)


def _encode_host(bw: torch.Tensor, nw: torch.Tensor, word_bytes: int, out: torch.Tensor, kind: str | None, update_base: bool) -> int | None:
    num_words = bw.numel()
    b, n_ = bw.numpy(), nw.numpy()
    scratch = np.empty(min(host.CHUNK_WORDS, max(num_words, 1)), dtype=bool)
    chunk_counts = host.chunk_counts(b, n_, scratch)
    num_changed = sum(chunk_counts)
    plan = _plan(num_words, word_bytes, num_changed, kind)
    if plan is None:
        return None
    kind, n = plan
    _check_out(out, n)
    write_header(out, kind, word_bytes, num_words, num_changed)
    index, values = _sections(out, kind, num_words, num_changed, word_bytes)
    index_np, values_np = index.numpy(), values.numpy()
    positions = None if kind == "bitmask" else index_np.view(np.int32 if kind == "positions32" else np.int64)
    delta = 0
    at = 0
    for k, c in enumerate(chunk_counts):
        s = k * host.CHUNK_WORDS
        e = min(s + host.CHUNK_WORDS, num_words)
        if not c:
            if kind == "bitmask":
                index_np[s // 8 : (e + 7) // 8] = 0
            continue
        local = host.changed_in(b[s:e], n_[s:e], scratch)
        if kind == "bitmask":
            index_np[s // 8 : (e + 7) // 8] = np.packbits(scratch[: e - s], bitorder="little")
        new_vals = n_[s:e].take(local)
        pos = local + s
        values_np[at : at + c] = new_vals
        if positions is not None:
            positions[at : at + c] = pos
        delta += host.weighted_diff_sum(pos, new_vals, b[s:e].take(local))
        if update_base:
            b[s:e][local] = new_vals
        at += c
    return _finish(out, n, torch.tensor(host.wrap64(delta), dtype=torch.int64))


def _encode_triton(bw: torch.Tensor, nw: torch.Tensor, word_bytes: int, out: torch.Tensor, kind: str | None, update_base: bool) -> int | None:
    from ckpt_engine.delta import kernels

    num_words = bw.numel()
    late_delta = kernels.DELTA_IN_COMPACT  # over the changed words in pass two, or every word in pass one
    counts, partial_delta, mask = kernels.compare_pack(bw, nw, with_delta=not late_delta)
    offsets = torch.cumsum(counts, 0)
    num_changed = int(offsets[-1].item()) if offsets.numel() else 0  # the one host sync
    plan = _plan(num_words, word_bytes, num_changed, kind)
    if plan is None:
        return None
    kind, n = plan
    _check_out(out, n)
    offsets -= counts
    write_header(out, kind, word_bytes, num_words, num_changed)
    index, values = _sections(out, kind, num_words, num_changed, word_bytes)
    mask_bytes = (num_words + 7) // 8
    positions = None
    if kind == "bitmask":
        index.copy_(mask[:mask_bytes])
    else:
        positions = index.view(torch.int32 if kind == "positions32" else torch.int64)
    late = kernels.compact(
        mask,
        mask_bytes,
        counts,
        offsets,
        new_w=nw,
        values_out=values,
        positions_out=positions,
        base_w=bw if update_base else None,
        old_w=bw if late_delta else None,
    )
    return _finish(out, n, (late if late_delta else partial_delta).sum())


def encode(
    base: torch.Tensor, new: torch.Tensor, word_bytes: int, out: torch.Tensor, *, kind: str | None = None, impl: str = "auto"
) -> int | None:
    """Write the patch turning `base` into `new` into `out[:n]` and return n, or None when no patch
    would be smaller than `new` (send dense). `kind` forces "bitmask", "positions32" or
    "positions64" (tests); `impl` forces "host" (numpy, CPU), "torch" or "triton" (CUDA). `out`
    must hold max_patch_bytes() bytes and start 8-byte aligned. One host sync (the changed count)."""
    with torch.profiler.record_function("ckpt_engine.delta.encode"):
        return _encode(base, new, word_bytes, out, kind, impl, update_base=False)


def encode_into_base(
    base: torch.Tensor, new: torch.Tensor, word_bytes: int, out: torch.Tensor, *, kind: str | None = None, impl: str = "auto"
) -> int | None:
    """`encode`, then make `base` equal `new` by scattering only the changed words (a full copy
    when the answer is None, i.e. the caller sends dense): the sender's base stays current."""
    with torch.profiler.record_function("ckpt_engine.delta.encode_into_base"):
        n = _encode(base, new, word_bytes, out, kind, impl, update_base=True)
        if n is None:
            base.copy_(new)
        return n
