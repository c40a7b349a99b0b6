"""Walks a sender's weight source along its own manifest entries.

One yielded tensor per piece the sender owns (the whole tensor with one sender, else its shard or
a replicated tensor it slices), and for each entry the bytes it sends from it.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from itertools import chain, islice
from typing import Any

import torch

from ckpt_engine.fp8.direct import FILLED, Ask, Offer
from ckpt_engine.pipeline.wire_views import SourceMismatch, checked_weight, flat_bytes, has_wire_layout, next_item, next_weight
from ckpt_engine.sources.wire import torch_dtype
from ckpt_engine.engine import SendStats
from ckpt_engine.manifest import TensorMeta

__all__ = ["Known", "PieceReader", "Seen", "Stamp", "stamp", "unchanged"]


Stamp = tuple["weakref.ref[torch.Tensor]", int, tuple[int, ...], torch.dtype]
"""A yielded tensor as a sync saw it: the object (weakly: a source of temporaries must not be kept
alive), its data pointer, its strides (a square matrix whose `.data` became its own transpose keeps
pointer and shape) and its dtype (a re-view of the same bytes as another dtype of the same size keeps
pointer, shape and strides)."""
Known = dict[str, tuple[Stamp, bool]]
"""Per whole entry, the stamp of the tensor a source yielded for it at the last sync and whether it
was in the wire layout (kept by the engine per plan, for sources whose tensors stay valid)."""
Seen = list[Stamp]
"""A stretch of whole entries' tensors as the last sync yielded them: what `PieceReader.same_as_last`
compares a new walk against."""


def stamp(t: torch.Tensor) -> Stamp:
    return (weakref.ref(t), t.data_ptr(), t.stride(), t.dtype)


def take_known(
    it: Iterator[tuple[str, torch.Tensor]], e: TensorMeta, known: Known, own: Callable[[torch.Tensor], bool]
) -> tuple[str, torch.Tensor, bool]:
    """The source's next (name, tensor) for whole entry `e`, and whether it is sendable from its own
    memory (`own`): checked against `e` and recorded in `known`, unless it is the tensor `known`
    recorded last time, where and as it was."""
    name, t = next_item(it, e)
    hit = known.get(e.name)
    if hit is not None and unchanged(name, t, e, hit[0]):
        return name, t, hit[1]
    checked_weight(name, t, e)
    known[e.name] = (stamp(t), own(t))
    return name, t, known[e.name][1]


def unchanged(name: str, t: torch.Tensor, e: TensorMeta, s: Stamp) -> bool:
    """Whether `t`, yielded as `name` for entry `e`, is the very tensor stamped `s` at the last sync,
    where and as it was then: its checks against `e` held then and still hold."""
    return t is s[0]() and name == e.name and t.data_ptr() == s[1] and t.shape == e.shape and t.stride() == s[2] and t.dtype is s[3]


class PieceReader:
    """Walks the weight source along one sender's entries: one yielded tensor per piece it owns
    (the whole tensor, or its shard), and the bytes of each entry within it.

    `known`: a trainer's source yields the same parameter objects every sync; a whole entry whose
    yielded tensor is the very object checked last time, at the same data pointer and shape, skips
    the checks (on a 30B MoE's ~19,000 tensors they cost more host time than the sync's kernels)."""

    def __init__(
        self, it: Iterator[tuple[str, torch.Tensor]], sched: Any, sender: int, device: torch.device, stats: SendStats, known: Known | None = None
    ) -> None:
        self.it, self.sched, self.sender, self.device, self.stats = it, sched, sender, device, stats
        self.current: torch.Tensor | None = None
        self.flat: torch.Tensor | None = None
        self.flat_is_source = False  # `flat` aliases the caller's tensor (no conversion temporary)
        self.base = 0
        self.known = known
        self.held: tuple[str, torch.Tensor] | None = None
        """An item `filled` took that was not a filled bucket: the first of `fresh_entries`'."""

    def source(self, e: TensorMeta) -> tuple[torch.Tensor, bool]:
        """(what entry `e` sends, whether that is the caller's own memory in the wire layout)."""
        if self.known is not None and e.is_whole:
            srcs, owns = self.whole_entries([e])
            return srcs[0], owns[0]
        key = (self.sender, e.name)
        start = self.sched.piece_start[key]
        if e.chunk_offset == start:
            piece = self.sched.piece_bytes[key]
            t0 = time.perf_counter()
            self.current = next_weight(self.it, e, None if piece == e.nbytes else piece)
            self.stats.export_s += time.perf_counter() - t0
            self.flat = None
            # Byte 0 of what was yielded: the tensor's own for a whole (replicated) tensor, the
            # piece's start for a shard.
            self.base = 0 if tuple(self.current.shape) == e.shape else start
        current = self.current
        assert current is not None
        if e.is_whole:
            return current, has_wire_layout(current, e, self.device)
        if self.flat is None:
            converted = current.to(device=self.device, dtype=torch_dtype(e.dtype)).contiguous()
            self.flat_is_source = converted.data_ptr() == current.data_ptr()
            self.flat = flat_bytes(converted)
        lo = e.chunk_offset - self.base
        # Never a conversion temporary: on CUDA the allocator could hand its memory to the next
        # allocation while the collective still reads it.
        return self.flat[lo : lo + e.chunk_size], self.flat_is_source

    def whole_entries(self, entries: Sequence[TensorMeta]) -> tuple[list[torch.Tensor], list[bool]]:
        """`source` for a run of whole entries with `known`, in one loop: each entry's tensor and
        whether it is sendable from its own memory, with the same checks (a known tensor that is
        `unchanged` skips them). A 30B MoE bucket holds hundreds of entries; the per-entry calls
        of `source` cost about as much host time as the checks themselves."""
        known, it, device = self.known, self.it, self.device
        assert known is not None
        srcs: list[torch.Tensor] = []
        owns: list[bool] = []
        t0 = time.perf_counter()
        for e in entries:
            name, t = next_item(it, e)
            hit = known.get(e.name)
            if hit is None or not unchanged(name, t, e, hit[0]):
                checked_weight(name, t, e)
                hit = known[e.name] = (stamp(t), has_wire_layout(t, e, device))
            srcs.append(t)
            owns.append(hit[1])
        self.stats.export_s += time.perf_counter() - t0
        if srcs:
            self.current, self.flat, self.base = srcs[-1], None, 0
        return srcs, owns

    def filled(self, offer: Offer, ask: Ask) -> bool:
        """Offer bucket `ask` to the walk (`fp8/direct.py`): whether the walk wrote it into the slot
        itself (then nothing of it is read, checked or packed here). Otherwise the item it yielded
        is `held` for `fresh_entries`."""
        offer.ask = ask
        t0 = time.perf_counter()
        try:
            item = next(self.it, None)
        finally:
            offer.ask = None
            self.stats.export_s += time.perf_counter() - t0
        if item is not None and item[0] == FILLED:
            return True
        self.held = item
        return False

    def fresh_entries(self, entries: Sequence[TensorMeta], dsts: Sequence[torch.Tensor]) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
        """A bucket of whole entries from a walk of new tensors (`WeightWalk.fresh`: the FP8 wire's
        codes and scales), in one loop: the copies into `dsts`, one (destinations, sources) pair of
        lists per (wire dtype, yielded dtype), each list one batched copy. The checks are `source`'s
        (name, shape, a castable dtype); a tensor of its wire dtype passes them on its name, shape
        and dtype alone (every piece is copied, so its layout and device do not matter), and a
        fresh tensor is never the slot's own memory (no aliasing to skip). A 30B-A3B FP8 bucket
        holds ~1,400 such tensors; the per-entry calls of `source` and `batched_copy_`'s per-pair
        sorting cost more host time than the checks."""
        it = self.it if self.held is None else chain([self.held], self.it)
        self.held = None
        dtypes: dict[str, torch.dtype] = {}
        groups: dict[tuple[torch.dtype, torch.dtype], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        t = None
        t0 = time.perf_counter()
        for e, dst in zip(entries, dsts):
            try:
                name, t = next(it)
            except StopIteration:
                raise SourceMismatch(f"the weight source ended before {e.name!r}, which its metadata lists") from None
            wire = dtypes.get(e.dtype)
            if wire is None:
                wire = dtypes[e.dtype] = torch_dtype(e.dtype)
            dtype = t.dtype
            if name != e.name or t.shape != e.shape or dtype is not wire:
                checked_weight(name, t, e)  # raises on a wrong name, shape or dtype kind; a float cast is copied
            pair = groups.get((wire, dtype))
            if pair is None:
                pair = groups[(wire, dtype)] = ([], [])
            pair[0].append(dst)
            pair[1].append(t)
        self.stats.export_s += time.perf_counter() - t0
        if t is not None:
            self.current, self.flat, self.base = t, None, 0
        return list(groups.values())

    def same_as_last(self, entries: Sequence[TensorMeta], seen: Seen | None) -> bool:
        """Whether the source now yields, for these whole entries, the very tensors `seen` recorded
        (`remember`) at the same pointers and shapes: then they are taken from the source and the
        caller reuses what it derived from them last time. Otherwise nothing is taken and each
        entry goes through `source` as usual. One pass with no per-entry bookkeeping: a 30B MoE
        bucket holds hundreds of expert tensors, and the per-entry walk cost more host time than
        the bucket's diff kernel."""
        if seen is None or not entries or len(seen) != len(entries):
            return False
        t0 = time.perf_counter()
        items = list(islice(self.it, len(entries)))
        same = len(items) == len(entries) and all(unchanged(name, t, e, s) for (name, t), e, s in zip(items, entries, seen))
        if not same:
            self.it = chain(items, self.it)
            return False
        self.current, self.flat, self.base = items[-1][1], None, 0
        self.stats.export_s += time.perf_counter() - t0
        return True

    @staticmethod
    def remember(tensors: Sequence[torch.Tensor]) -> Seen:
        """What `same_as_last` compares against: each tensor's stamp."""
        return [stamp(t) for t in tensors]
