"""The installed-weight digests of many CUDA images in one Triton launch.

`installed.Folds` reads each image with a few torch ops (a gather, a view, a cast: ~25 us of launches
per tensor on a GPU), so a 7B model's 339 tensors cost ~10 ms per side of a check, against a ~30 ms
colocated sync. Here one program per image computes the same sampled positions, reads the words
through the image's own sizes and strides (any strided view: a fused QKV's rows, a TP slice) and
folds them: one launch and one read-back for every image of one element width. The result equals
`installed.digest` image by image (tests/test_installed_kernel.py, in Triton's interpreter on the
CPU and on a GPU), so either side of a check may use it. Imported where a fold runs on a GPU (it
needs Triton).
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ckpt_engine.delta.mixing import GROUP_BITS, GROUP_WORDS, MIX_A, MIX_B

__all__ = ["MAX_DIMS", "Folder", "Readback", "foldable"]

MAX_DIMS = 4
"""Images of up to this many dimensions are folded here (others by `installed.Folds`)."""
_BLOCK = 1024
_TL_WORDS = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}
"""The signed word each element width is read as (`installed.digest`'s words)."""


def foldable(view: torch.Tensor) -> bool:
    """Whether `Folder` takes `view` (its own dtype: no cast on the way)."""
    return view.dim() <= MAX_DIMS and view.numel() > 0 and view.element_size() in _TL_WORDS and not view.dtype.is_complex


class Folder:
    """The kernel's tables for `views` (each one's address, sizes and strides), ready to fold with
    any seed. Tables are kept by the views' geometry for the next `Folder` of the same views: both
    sides of a check fold the same tensors at every check and only the seed changes, so building
    them (~3 us of Python an image: ~1 ms for a 7B model) is paid once; a `Folder` then costs one
    pass over the views' shapes. Holds the views (the tables hold their addresses)."""

    def __init__(self, views: Sequence[torch.Tensor]) -> None:
        self.views = list(views)
        ptrs = tuple(map(torch.Tensor.data_ptr, self.views))
        rest = tuple(tuple(map(f, self.views)) for f in _GEOMETRY)  # C loops: ~4x faster than a tuple per view
        kept = _TABLES.pop(ptrs, None)  # by the addresses alone: hashing the whole geometry cost ~2x its compare
        tables = kept[1] if kept is not None and kept[0] == rest else _tables(self.views) if self.views else []
        _TABLES[ptrs] = (rest, tables)  # the latest last: the oldest goes first
        while len(_TABLES) > _KEPT:  # a pop: another thread's Folder may evict the same one
            _TABLES.pop(next(iter(_TABLES)), None)
        self._tables = tables
        self.dtypes: tuple[torch.dtype, ...] = rest[0]
        """Each view's dtype (a caller folding a cast image elsewhere checks it against these)."""

    def launch(self, seed: int, samples: int) -> list[tuple[list[int], torch.Tensor]]:
        """Enqueue `installed.digest(view, seed, samples)` of every view (each `foldable`, `samples`
        > 0) on the current stream, after whatever wrote the images there: one launch per element
        width, no host sync. Returns, per width, the views' indices and their digests (int64, on
        the views' device): a caller folding batches as they land reads them all back once."""
        if samples <= 0:
            raise ValueError("Folder folds sampled digests (samples > 0)")
        results: list[tuple[list[int], torch.Tensor]] = []
        if not self.views:
            return results
        with torch.cuda.device(self.views[0].device) if self.views[0].is_cuda else contextlib.nullcontext():  # Triton launches on the current device
            for index, width, table, _ in self._tables:
                folded = torch.empty(len(index), dtype=torch.int64, device=table.device)
                _fold[(len(index),)](table, folded, seed, samples, WORD=_TL_WORDS[width], DIMS=MAX_DIMS, BLOCK=_BLOCK)
                results.append((index, folded))
        return results

    def launch_all(self, seed: int, samples: int) -> torch.Tensor:
        """`launch`, every digest in one int64 tensor in the views' order, still on their device:
        one element width (a bf16 model) is the launch's own output; more are put in order on the
        device (kept index tensors), so a check reads every digest back with one copy."""
        launched = self.launch(seed, samples)
        if not launched:
            return torch.zeros(0, dtype=torch.int64)
        if len(launched) == 1:  # one width: its indices are every view, in order
            return launched[0][1]
        out = torch.empty(len(self.views), dtype=torch.int64, device=launched[0][1].device)
        for (_, _, _, order), (_, folded) in zip(self._tables, launched):
            out.index_copy_(0, order, folded)
        return out

    def fold(self, seed: int, samples: int) -> list[int]:
        """`launch_all`, read back at once (one host sync)."""
        return self.launch_all(seed, samples).tolist()

    def launch_behind(self, seed: int, samples: int) -> Readback:
        """`launch_all` on a high-priority stream of the views' device kept for it, behind the
        current stream's work queued so far (what wrote the images), its digests copied to pinned
        host memory behind the fold: the current stream's later work (a receive's closing wait on
        its copies) does not wait for the fold, and reading them back is one wait on that copy
        (`Readback.values`), no host sync of its own."""
        device = self.views[0].device
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(device))
        stream = _STREAMS.get(device.index)
        if stream is None:
            stream = _STREAMS[device.index] = torch.cuda.Stream(device, priority=-1)  # its blocks go between other work's
        stream.wait_event(ready)
        with torch.cuda.stream(stream):
            folded = self.launch_all(seed, samples)
            host = torch.empty(folded.shape, dtype=folded.dtype, pin_memory=True)
            host.copy_(folded, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        return Readback(host, done)


class Readback:
    """Digests on their way to pinned host memory (`Folder.launch_behind`): `values` once copied."""

    def __init__(self, host: torch.Tensor, done: torch.cuda.Event) -> None:
        self._host, self._done = host, done

    def values(self) -> list[int]:
        if not self._done.query():  # done by now, as a rule: no wait that hands the interpreter lock to another thread
            self._done.synchronize()  # the fold and its copy to the host, on their stream
        return self._host.tolist()


_GEOMETRY = (operator.attrgetter("dtype"), operator.attrgetter("shape"), torch.Tensor.stride)
_KEPT = 64
_TABLES: dict[tuple[int, ...], tuple[tuple, list[tuple[list[int], int, torch.Tensor, torch.Tensor]]]] = {}
"""The tables of the last `_KEPT` sets of views, by their addresses, with their dtypes, sizes and
strides (tables are used again only where all of these are equal, whether or not the tensors are the
same objects; no tensor is kept alive). A host rank folds a check's images in batches as they land
(`installed_held.FOLD_BATCHES`): every batch's tables are kept for the next check."""
_STREAMS: dict[int | None, torch.cuda.Stream] = {}
"""The stream `launch_behind` folds on, per device index."""
_PAD = {d: ((1,) * (MAX_DIMS - d), (0,) * (MAX_DIMS - d)) for d in range(MAX_DIMS + 1)}


def _tables(views: Sequence[torch.Tensor]) -> list[tuple[list[int], int, torch.Tensor, torch.Tensor]]:
    """Per element width: the images' indices, their table (a row per image: its first element's
    address, numel, sizes and strides left-padded to MAX_DIMS, then 1 where it is contiguous: read
    with no unravel) and their indices, both on their device."""
    by_width: dict[int, list[int]] = {}
    for i, v in enumerate(views):
        if not foldable(v):
            raise ValueError(f"image {i} ({v.dtype}, {v.dim()} dims, {v.numel()} elements) cannot be folded here")
        by_width.setdefault(v.element_size(), []).append(i)
    out = []
    for width, index in by_width.items():
        rows = []
        for i in index:
            v = views[i]
            ones, zeros = _PAD[v.dim()]
            rows.append((v.data_ptr(), v.numel(), *ones, *v.shape, *zeros, *v.stride(), int(v.is_contiguous())))
        device = views[0].device
        out.append((index, width, torch.tensor(rows, dtype=torch.int64).to(device), torch.tensor(index, dtype=torch.int64).to(device)))
    return out


_GROUP_BITS = tl.constexpr(GROUP_BITS)
_GROUP_MASK = tl.constexpr(GROUP_WORDS - 1)
_MIX_A = tl.constexpr(MIX_A)
_MIX_B = tl.constexpr(MIX_B)


@triton.jit
def _mix(idx):
    """h(idx) of `delta/mixing.py` in wrapping int64."""
    a = (((idx & _GROUP_MASK) + 1) * _MIX_A) & 0xFFFFFFFF
    a = (a >> 1) | 1
    x = ((idx >> _GROUP_BITS) + 1) * _MIX_B
    x = x ^ (x >> 31)
    return a * (x | 1)


@triton.jit(do_not_specialize=["seed", "samples"])
def _fold(table, out, seed, samples, WORD: tl.constexpr, DIMS: tl.constexpr, BLOCK: tl.constexpr):
    """One program per image: its K sampled positions (one per stratum, the first and last element
    always), read through its sizes and strides (a contiguous image at the position itself), each
    word times h(position + seed), summed."""
    m = tl.program_id(0)
    row = table + m * (3 + 2 * DIMS)
    base = tl.load(row).to(tl.pointer_type(WORD))
    n = tl.load(row + 1)
    contiguous = tl.load(row + 2 + 2 * DIMS)
    k = samples.to(tl.int64)
    s = seed.to(tl.int64)
    small = n <= k
    count = tl.where(small, n, k)
    acc = tl.zeros((BLOCK,), dtype=tl.int64)
    for start in range(0, count, BLOCK):
        i = start + tl.arange(0, BLOCK).to(tl.int64)
        live = i < count
        lo = i * n // k
        span = tl.maximum((i + 1) * n // k - lo, 1)
        r = _mix(i + s) % span
        r = tl.where(r < 0, r + span, r)
        pos = tl.where(small, i, lo + r)
        pos = tl.where((i == 0) & ~small, 0, pos)
        pos = tl.where((i == k - 1) & ~small, n - 1, pos)
        if contiguous != 0:  # most images (whole tensors, fused rows): the position is the offset
            offset = pos
        else:  # through the sizes and strides: ~8 of a sample's ~11 int64 divisions
            rest = pos
            offset = tl.zeros((BLOCK,), dtype=tl.int64)
            for d in tl.static_range(DIMS - 1, -1, -1):
                size = tl.load(row + 2 + d)
                stride = tl.load(row + 2 + DIMS + d)
                offset += (rest % size) * stride
                rest = rest // size
        words = tl.load(base + offset, mask=live, other=0).to(tl.int64)
        acc += tl.where(live, words * _mix(pos + s), 0)
    tl.store(out + m, tl.sum(acc, axis=0))
