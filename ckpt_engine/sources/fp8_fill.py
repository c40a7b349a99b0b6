"""A replayed FP8 walk that writes each bucket's bytes into the sender's slot itself (issue 41).

Why: the replayed walk (`fp8_walk.py`) still made two result views a quantized weight, and the
sender then checked each and packed it (`PieceReader.fresh_entries`, a batched copy a bucket):
on 2xH200 a Qwen3-30B-A3B (12 layers) FP8 sync spent 45 ms in the walk and 7.5 ms in the pack
against 24 ms on the link. Where the sender offers its buckets (`fp8/direct.py`) and the source's
walk was recorded (a stable source, from its second sync on), each bucket is filled by one grouped
launch that writes every weight's codes and scales at their offsets in the slot (`IntoLaunch`),
the tensors sent as they are copied there in one batched copy (or, where the sender posts a
message per entry, lent: sent from their own memory), and the walk yields one `FILLED` item for
the bucket: no views a weight, no pack. A bucket's fill is worked out at the first such
sync (`_build`, with the checks the sender would make) and kept per bucket layout; later syncs only
check that the source yields tensors of the same names where and as they were (`_Fill.same`).
Anything else (another tensor, a moved one, a bucket not offered) ends the filling there: the rest
walks as usual and the sender packs it, and a changed source is recorded anew by its next sync.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import chain, islice
from typing import Any

import torch

from ckpt_engine.fp8.direct import FILLED, Ask, Offer
from ckpt_engine.fp8.layout import BLOCK
from ckpt_engine.fp8.quantize import quantize_block_fp8
from ckpt_engine.sources.fp8_walk import GroupKernel, IntoLaunch, Quantized, Walker, tensor_layout, to_wire
from ckpt_engine.sources.wire import torch_dtype

__all__ = ["Fills", "fill_walk"]

_NOTHING = torch.empty(0)
"""What a `FILLED` item carries (the bucket's bytes are already in the slot)."""


@dataclass
class Fills:
    """The fills of one bucket layout (`key`: `Offer.key`), by bucket index; `refused`: a bucket of
    this layout cannot be filled (a tensor to cast, say): its walks replay and the sender packs."""

    key: str
    by_bucket: dict[int, _Fill] = field(default_factory=dict)
    refused: bool = False


@dataclass
class _Fill:
    """How one bucket is filled: the source's items it takes (names, addresses and layouts; never
    the tensors: a fill must not keep a trainer's tensors alive), the grouped launch into the slot,
    the copies of tensors sent as they are (per dtype: destination entries, items), the tensors
    sent as they are from their own memory (entry, item: `Ask.lend`), weights quantized alone
    (item, plan, codes entry, scales entry or -1: the scales open the next bucket), and the entry of
    the last bucket's straddling weight's scales (-1: none)."""

    names: tuple[str, ...]
    ptrs: list[int]
    layout: tuple[list[Any], ...]
    launch: IntoLaunch | None
    grouped: int
    copies: list[tuple[list[int], list[int]]]
    lends: list[tuple[int, int]]
    alone: list[tuple[int, Quantized, int, int]]
    pending_at: int

    def same(self, names: tuple[str, ...], ts: tuple[torch.Tensor, ...]) -> bool:
        """Whether the items are those the fill was made for: names, addresses and layouts (shapes,
        dtypes, contiguity), in passes over the bucket that run in C (a 30B-A3B bucket holds ~700
        weights). Not the objects: the launch reads addresses, and another tensor of that layout at
        that address is the input the yielded one is; copies and lone quantizes take the objects."""
        return names == self.names and list(map(torch.Tensor.data_ptr, ts)) == self.ptrs and tensor_layout(ts) == self.layout

    def run(self, ask: Ask, ts: Sequence[torch.Tensor], pending: tuple[str, torch.Tensor] | None) -> tuple[str, torch.Tensor] | None:
        """Write the bucket into `ask.slot`; the scales this bucket leaves for the next one, if any."""
        dsts = ask.dsts
        if self.launch is not None:
            self.launch.run(ask.slot)
        for at, of in self.copies:
            torch._foreach_copy_([dsts[i] for i in at], [ts[j] for j in of])
        for lent_at, j in self.lends:
            ask.lent[lent_at] = ts[j]
        if self.pending_at >= 0:
            assert pending is not None  # `_build` only plans it where the last bucket left scales
            dsts[self.pending_at].copy_(pending[1])
        left = None
        for j, plan, codes_at, scales_at in self.alone:
            q, s = quantize_block_fp8(ts[j], BLOCK)
            dsts[codes_at].copy_(q.view(plan.shape))
            if scales_at >= 0:
                dsts[scales_at].copy_(s)
            else:
                left = (plan.scale, s)
        return left


def fill_walk(walker: Walker, fills: Fills, offer: Offer, it: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The walk of a recorded stable source for a sender that offers its buckets: each bucket asked
    for is filled and yields one `FILLED` item; a pull that asks for none (a bucket of chunks, or
    the walk's end) yields one item as the sender reads it, a quantized weight's codes and then its
    scales (quantized alone). A bucket that cannot be filled is yielded as its items, and so is
    the rest of the walk."""
    counts, quantized = walker.counts, walker.quantized
    pending: tuple[str, torch.Tensor] | None = None  # a weight's scales, the next item the sender reads
    items: list[tuple[str, torch.Tensor]] = []
    changed = False
    while True:
        ask, offer.ask = offer.ask, None
        if ask is None:
            if pending is not None:
                item, pending = pending, None
                yield item
                continue
            got = next(it, None)
            if got is None:
                return
            plan = quantized.get(got[0])
            if plan is None:
                yield got
                continue
            t = got[1]
            codes, scales = walker.alone(plan, t if t.dtype is plan.dtype and t.shape == plan.shape else to_wire(plan.spec, t))
            pending = scales
            yield codes
            continue
        fill = fills.by_bucket.get(ask.index)
        if fill is None:
            items = []
            fill = _build(walker, ask, it, items, pending)
            if fill is None:
                fills.refused = True  # not a bucket this layout can fill: later walks replay and pack
                break
            fills.by_bucket[ask.index] = fill
            ts = tuple(t for _, t in items)
        else:
            items = list(islice(it, len(fill.names)))
            names, ts = zip(*items) if items else ((), ())
            if not fill.same(names, ts) or (pending is None) != (fill.pending_at < 0):
                fills.by_bucket.clear()  # the source changed: made anew at a later sync
                changed = True
                break
            counts.replayed += fill.launch is not None
        pending = fill.run(ask, ts, pending)
        counts.launches += fill.launch is not None
        counts.grouped += fill.grouped
        counts.alone += len(fill.alone)
        counts.filled += 1
        counts.lent += len(fill.lends)
        yield FILLED, _NOTHING
    walker.missed = walker.missed or changed or fills.refused  # the record is stale: the next walk records anew
    if pending is not None:
        yield pending
    yield from walker.walk(chain(items, it))


def _build(
    walker: Walker, ask: Ask, it: Iterator[tuple[str, torch.Tensor]], taken: list[tuple[str, torch.Tensor]],
    pending: tuple[str, torch.Tensor] | None,
) -> _Fill | None:
    """A bucket's fill, taking its items from `it` into `taken`, with the checks the sender makes of
    a fresh walk's bucket (names in order, shapes, wire dtypes); None where the bucket is not one a
    fill can write exactly (a tensor to cast, an item the entries do not expect): `taken` then
    holds what was read, to be walked as usual."""
    if ask.slot.dtype != torch.uint8 or ask.slot.dim() != 1:
        return None  # slots made elsewhere, not a byte buffer a launch writes into
    entries, dsts, base, device, size = ask.entries, ask.dsts, ask.slot.data_ptr(), ask.slot.device, ask.slot.numel()
    quantized, kernel_of = walker.quantized, walker.kernel_of
    ts: list[torch.Tensor] = []
    names: list[str] = []
    ws: list[torch.Tensor] = []
    codes_at: list[int] = []
    scales_at: list[int] = []
    copies: dict[torch.dtype, tuple[list[int], list[int]]] = {}
    lends: list[tuple[int, int]] = []
    alone: list[tuple[int, Quantized, int, int]] = []
    key: tuple[GroupKernel, torch.dtype, torch.device] | None = None
    pending_at = -1
    i, n = 0, len(entries)
    if n and pending is not None and entries[0].name == pending[0]:
        pending_at, i = 0, 1
    elif pending is not None:
        return None
    while i < n:
        e = entries[i]
        item = next(it, None)
        if item is None:
            return None
        taken.append(item)
        name, t = item
        if name != e.name:
            return None
        plan = quantized.get(name)
        if plan is None:
            if t.shape != e.shape or t.dtype is not torch_dtype(e.dtype):
                return None
            if ask.lend and t.device == device and t.is_contiguous():
                lends.append((i, len(ts)))  # sent from its own memory (`same` keeps its address and layout)
            else:
                at, of = copies.setdefault(t.dtype, ([], []))
                at.append(i)
                of.append(len(ts))
        else:
            if t.dtype is not plan.dtype or t.shape != plan.shape or t.device != device:
                return None  # a cast to the wire dtype (a new tensor every walk), or weights where the slot is not
            both = i + 1 < n and entries[i + 1].name == plan.scale
            k = kernel_of(t)
            here = (k, t.dtype, t.device)
            q_off = dsts[i].data_ptr() - base
            s_off = dsts[i + 1].data_ptr() - base if both else 0
            # codes and scales both in this bucket, within the slot the launch writes (views of other memory go alone)
            inside = both and 0 <= q_off and q_off + dsts[i].nbytes <= size and 0 <= s_off and s_off + dsts[i + 1].nbytes <= size
            if inside and k is not None and (key is None or here == key) and k.groupable(t) and q_off % 16 == 0 and s_off % 4 == 0:
                key = (k, t.dtype, t.device)
                ws.append(t)
                codes_at.append(q_off)
                scales_at.append(s_off)
            else:  # not for the grouped kernel, or its scales open the next bucket
                alone.append((len(ts), plan, i, i + 1 if both else -1))
            i += both
        names.append(name)
        ts.append(t)
        i += 1
    launch = key[0].plan_into(ws, codes_at, scales_at) if key is not None else None
    return _Fill(
        tuple(names), [t.data_ptr() for t in ts], tensor_layout(ts), launch, len(ws),
        list(copies.values()), lends, alone, pending_at,
    )
