"""Delta encode: the one diff of the codec, of a bucket straight from the tensors it holds or of a
packed image (`encode_into_base`, one piece).

Packing a bucket and then comparing it reads the new bytes twice; here each piece (in the wire
dtype) is compared with its region of the base image in one pass that writes the changed words'
positions and new values and brings the base up to date. On CUDA that is one Triton launch for the
bucket (direct_kernels.py) whose blocks claim room in the patch with one atomic each (positions in
block order); elsewhere torch ops, positions sorted. One host sync per bucket (the changed count)
decides patch or dense; the base equals the new bytes afterwards, so a dense bucket is sent from it.
"""

from __future__ import annotations

from typing import Any

import torch

from ckpt_engine.delta import accel
from ckpt_engine.delta.layout import (
    PATCH_HEADER_BYTES,
    Row,
    align8,
    store_delta_sum,
    word_dtype,
    words_of,
    write_header,
)
from ckpt_engine.delta.mixing import mix

__all__ = ["SCATTER_BELOW", "BucketDiff", "capacity", "encode", "encode_into_base", "max_patch_bytes", "out_bytes"]

SCATTER_BELOW = 1 / 32
"""Most changed words, as a fraction of the bucket's, that a BucketDiff made without a limit may
carry (probes, tests). Senders take theirs from the engine option `delta_scatter_below` (1/4 by
default, pipeline/delta_bases.py); above this one they move buckets between the one-pass diff and
the codec with a margin (pipeline/delta_send.py)."""


def capacity(nbytes: int, word_bytes: int, scatter_below: float = SCATTER_BELOW) -> int:
    """Most changed words a scatter32 patch of an `nbytes` image may carry: `scatter_below` of its
    words, and few enough that the patch is smaller than the image."""
    if not 0 < scatter_below <= 1:
        raise ValueError(f"scatter_below must be in (0, 1], got {scatter_below!r}")
    num_words = nbytes // word_bytes
    return max(0, min(int(num_words * scatter_below), (nbytes - PATCH_HEADER_BYTES - 8) // (4 + word_bytes)))


def out_bytes(nbytes: int, word_bytes: int, scatter_below: float = SCATTER_BELOW) -> int:
    """Bytes of the `out` buffer a BucketDiff of an `nbytes` bucket needs (a sixteenth of a bf16
    bucket at the default, plus a little): header, positions, then room for the new values."""
    cap = capacity(nbytes, word_bytes, scatter_below)
    return PATCH_HEADER_BYTES + align8(4 * cap) + 8 + align8(cap * word_bytes)


def max_patch_bytes(nbytes: int, word_bytes: int) -> int:
    """Size of an `out` buffer that any patch of an `nbytes` image fits in (a patch is only kept
    when smaller than the image, so a little more than `nbytes`)."""
    word_dtype(word_bytes)
    if nbytes < 0 or nbytes % word_bytes:
        raise ValueError(f"nbytes={nbytes} must be >= 0 and a multiple of word_bytes={word_bytes}")
    return out_bytes(nbytes, word_bytes, 1.0)


def encode_into_base(base: torch.Tensor, new: torch.Tensor, word_bytes: int, out: torch.Tensor) -> int | None:
    """Write the patch turning `base` into `new` into `out[:n]` and return n, or None when no patch
    smaller than `new` fits `out` (send dense); `base` equals `new` afterwards either way (the
    sender's base stays current). One pass over both images (BucketDiff over one piece); one host
    sync (the changed count)."""
    bw, nw = words_of(base, word_bytes, "base"), words_of(new, word_bytes, "new")
    if base.numel() != new.numel() or base.device != new.device:
        raise ValueError(f"base ({base.numel()} bytes on {base.device}) and new ({new.numel()} bytes on {new.device}) must match")
    if out.dtype != torch.uint8 or out.dim() != 1 or out.device != new.device or out.storage_offset() % 8:
        raise ValueError(f"out must be a 1-D uint8 tensor on {new.device} starting 8-byte aligned")
    num_words = nw.numel()
    below = 1.0
    if out.numel() < out_bytes(new.numel(), word_bytes, below):  # as many changed words as `out` can hold
        below = max((out.numel() - PATCH_HEADER_BYTES - 24) // (4 + word_bytes) / max(num_words, 1), 1e-12)
    if not num_words or num_words >= 2**31 or out.numel() < out_bytes(new.numel(), word_bytes, below):
        base.copy_(new)
        return None
    with torch.profiler.record_function("ckpt_engine.delta.encode_into_base"):
        diff = BucketDiff(out, new.numel(), word_bytes, below)
        diff.add(nw, bw, 0)
        size, _delta, _count = diff.finish()
    return size


def encode(base: torch.Tensor, new: torch.Tensor, word_bytes: int, out: torch.Tensor) -> int | None:
    """`encode_into_base` that leaves `base` as it is (it diffs a copy)."""
    return encode_into_base(base.clone(), new, word_bytes, out)


class BucketDiff:
    """One bucket's patch, built piece by piece into `out` (>= out_bytes(), 8-aligned).

    `add` each piece (its new words, its base words, its first word's index in the bucket), or on
    CUDA `add_pieces` all of them at once (one launch), optionally `seal` (queue the count's copy
    to the host and return an event to wait on, so the next bucket's kernels can be queued first),
    then `finish` returns the patch size (None: the bucket goes dense), the patch's delta sum (0-d
    int64 on the device) and the changed count; a count above `cap` means "too many for a scatter
    patch". Positions go to the front of `out` after the header, new values behind them until the
    count is known."""

    def __init__(self, out: torch.Tensor, nbytes: int, word_bytes: int, scatter_below: float = SCATTER_BELOW) -> None:
        need = out_bytes(nbytes, word_bytes, scatter_below)
        if out.dtype != torch.uint8 or out.dim() != 1 or out.numel() < need or out.storage_offset() % 8:
            raise ValueError(f"out must be a 1-D uint8 tensor of >= {need} bytes starting 8-byte aligned")
        if nbytes % word_bytes or nbytes // word_bytes >= 2**31:
            raise ValueError(f"a bucket of {nbytes} bytes cannot be diffed in words of {word_bytes} bytes with int32 positions")
        self.out, self.nbytes, self.word_bytes = out, nbytes, word_bytes
        self.num_words = nbytes // word_bytes
        self.scatter_below = scatter_below
        self.cap = capacity(nbytes, word_bytes, scatter_below)
        self.device = out.device
        self._fused = accel.triton_on(self.device)
        self._pinned: torch.Tensor | None = None
        wdt = word_dtype(word_bytes)
        self._values_at = PATCH_HEADER_BYTES + align8(4 * self.cap) + 8
        if self.cap:
            self._positions = out[PATCH_HEADER_BYTES : PATCH_HEADER_BYTES + 4 * self.cap].view(torch.int32)
            self._values = out[self._values_at : self._values_at + self.cap * word_bytes].view(wdt)
        else:  # a bucket too small for any patch: count only
            self._positions = torch.empty(0, dtype=torch.int32, device=self.device)
            self._values = torch.empty(0, dtype=wdt, device=self.device)
        if self._fused:  # the count (int32, low half of word 0) and the delta sum (word 1): one fill
            self._state = torch.zeros(2, dtype=torch.int64, device=self.device)
            self._counter = self._state.view(torch.int32)[:1]
            self._delta_t = self._state[1]
        else:
            self._count = 0
            self._delta_t = torch.zeros((), dtype=torch.int64, device=self.device)

    def add(self, new_words: torch.Tensor, base_words: torch.Tensor, first: int) -> None:
        """Diff one piece: `new_words` and `base_words` are 1-D word views of equal length; the
        base region becomes the new words."""
        if new_words.dtype != base_words.dtype:
            raise ValueError(f"piece at word {first}: new ({new_words.dtype}) and base ({base_words.dtype}) words differ in type")
        self._check_piece(new_words, base_words, first)
        if not new_words.numel():
            return
        if self._fused:
            from ckpt_engine.delta import kernels

            kernels.diff_into(new_words, base_words, first, self._counter, self._delta_t, self._positions, self._values)
        else:
            self._add_torch(new_words, base_words, first)

    def _check_piece(self, new: torch.Tensor, base: torch.Tensor, first: int) -> None:
        if new.numel() != base.numel():
            raise ValueError(f"piece at word {first}: new ({new.numel()} words) and base ({base.numel()} words) differ in length")
        if not 0 <= first <= self.num_words - new.numel():
            raise ValueError(f"piece of {new.numel()} words at word {first} is outside the bucket's {self.num_words}")

    @property
    def fused(self) -> bool:
        """Whether pieces go through the Triton kernels (then `add_pieces` takes raw rows)."""
        return self._fused

    def add_pieces(self, rows: list[Row], base_words: torch.Tensor, cache: dict[str, Any] | None = None) -> None:
        """Diff every piece of `rows` ((data pointer, length in words, first bucket word), the
        words of this bucket's word type) against the bucket's whole base image `base_words` in
        one launch (CUDA only: direct_kernels.py). The launch reads the pieces' memory when it
        runs, so it must stay as it is until then. `cache`: kept by the caller per bucket."""
        if not self._fused:
            raise RuntimeError("add_pieces runs the Triton kernel; on this device add each piece with add()")
        if base_words.numel() != self.num_words or base_words.element_size() != self.word_bytes:
            raise ValueError(f"base image of {base_words.numel()} {base_words.dtype} words for a bucket of {self.num_words} words of {self.word_bytes} bytes")
        if cache is None or cache.get("rows_words") != self.num_words or cache.get("rows") != rows:  # checked when cached
            for _ptr, n, first in rows:
                if not 0 <= first <= self.num_words - n:
                    raise ValueError(f"piece of {n} words at word {first} is outside the bucket's {self.num_words}")
        from ckpt_engine.delta import direct_kernels

        direct_kernels.diff_pieces(rows, base_words, self._counter, self._delta_t, self._positions, self._values, cache)
        if cache is not None:
            cache["rows_words"] = self.num_words

    def _add_torch(self, new: torch.Tensor, base: torch.Tensor, first: int) -> None:
        local = torch.ne(new, base).nonzero().reshape(-1)  # a host sync off CUDA's fused kernel
        c = local.numel()
        if not c:
            return
        vals = new.index_select(0, local)
        pos = local + first
        at = self._count
        if at + c <= self.cap:
            self._positions[at : at + c].copy_(pos)
            self._values[at : at + c].copy_(vals)
        self._delta_t += mix(pos).mul_(vals.to(torch.int64) - base.index_select(0, local).to(torch.int64)).sum()
        base.index_copy_(0, local, vals)
        self._count += c

    def seal(self) -> torch.cuda.Event | None:
        """Queue the changed count's copy to pinned host memory; the returned event (CUDA only)
        completes when it has landed, so `finish` does not wait for work queued after this."""
        if not self._fused or self.device.type != "cuda":
            return None
        self._pinned = torch.empty(1, dtype=torch.int32, pin_memory=True)
        self._pinned.copy_(self._counter, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return event

    def finish(self) -> tuple[int | None, torch.Tensor, int]:
        """(patch bytes or None for dense, the patch's delta sum, changed words). After `seal` and
        its event, no wait; otherwise one host sync."""
        if self._fused:
            count = int(self._pinned.item()) if self._pinned is not None else int(self._counter.item())
            delta = self._delta_t
        else:
            count, delta = self._count, self._delta_t
        if count > self.cap:
            return None, delta, count
        index_at = PATCH_HEADER_BYTES + 4 * count
        values_at = PATCH_HEADER_BYTES + align8(4 * count)
        size = values_at + count * self.word_bytes
        if size >= self.nbytes:
            return None, delta, count
        write_header(self.out, "scatter32", self.word_bytes, self.num_words, count)
        self.out[index_at:values_at].zero_()
        src = self._values[:count].view(torch.uint8)
        if count:
            if size > self._values_at:  # the move overlaps its source
                src = src.clone()
            self.out[values_at:size].copy_(src)
        store_delta_sum(self.out, delta)
        return size, delta, count
