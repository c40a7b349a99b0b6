"""Per-bucket copy plans kept across syncs, so a sync of thousands of tensors runs no Python per tensor.

A MoE's ~19,000 tensors cost more host time per sync (looking up each piece, building its views)
than the link needs to move them. What a bucket copies only changes with the plan or with where
the tensors live, so it is worked out once and replayed: one batched copy per bucket on each side.
A plan stays valid only while each anchor (the tensors every planned view points into) has the
address, shape, strides and dtype it had when the plan was built; the plan keeps its anchors
alive, so their memory cannot be handed to another tensor behind its back.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ckpt_engine.sources.base import WeightWalk

__all__ = ["BucketReceive", "BucketSend", "ReceivePlan", "SendPlan", "anchors_of", "anchors_unmoved", "close_walk", "coalesce", "layout_of", "optional_layout"]


def layout_of(tensors: Sequence[torch.Tensor]) -> tuple[Hashable, ...]:
    """Where `tensors` live: their addresses, shapes, strides, dtypes and devices, one tuple per
    attribute in the tensors' order (a replayed plan checks this every sync: at a 30B MoE's
    thousands of anchors, one pass per attribute took a quarter of the host time of a tuple per
    tensor)."""
    return (
        tuple([t.data_ptr() for t in tensors]), tuple([t.shape for t in tensors]), tuple([t.stride() for t in tensors]),
        tuple([t.dtype for t in tensors]), tuple([t.device for t in tensors]),
    )


def _bytes_view(t: torch.Tensor, nbytes: int) -> torch.Tensor:
    """`nbytes` bytes of `t`'s storage from `t`'s first byte, as a flat uint8 tensor."""
    offset = t.storage_offset() * t.element_size()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage(), offset, (nbytes,), (1,))


def coalesce(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The copies dsts[i] <- srcs[i], with each run of pairs that are back to back in memory on both
    sides (contiguous, same dtype, the next one starting where this one ends in the same storage)
    merged into one byte copy, and pairs that are already the same memory dropped. Built once per
    plan, so the per-pair checks here cost nothing per sync."""
    out_d: list[torch.Tensor] = []
    out_s: list[torch.Tensor] = []
    run: list[tuple[torch.Tensor, torch.Tensor]] = []

    def flush() -> None:
        if not run:
            return
        if len(run) == 1:
            out_d.append(run[0][0])
            out_s.append(run[0][1])
        else:
            nbytes = sum(d.numel() * d.element_size() for d, _ in run)
            out_d.append(_bytes_view(run[0][0], nbytes))
            out_s.append(_bytes_view(run[0][1], nbytes))
        run.clear()

    def mergeable(d: torch.Tensor, s: torch.Tensor) -> bool:
        return d.dtype == s.dtype and d.is_contiguous() and s.is_contiguous() and d.device == s.device and d.numel() > 0

    def follows(prev: torch.Tensor, nxt: torch.Tensor) -> bool:
        return (
            prev.data_ptr() + prev.numel() * prev.element_size() == nxt.data_ptr()
            and prev.untyped_storage().data_ptr() == nxt.untyped_storage().data_ptr()
        )

    for d, s in zip(dsts, srcs):
        if d.numel() == 0:
            continue
        if d.data_ptr() == s.data_ptr() and d.dtype == s.dtype and d.shape == s.shape and d.stride() == s.stride():
            continue  # already in place (a receiver reassembled it in its destination)
        if not mergeable(d, s):
            flush()
            out_d.append(d)
            out_s.append(s)
            continue
        if run and not (follows(run[-1][0], d) and follows(run[-1][1], s)):
            flush()
        run.append((d, s))
    flush()
    return out_d, out_s


@dataclass
class BucketSend:
    """How a sender moves one bucket, decided once per plan.

    `kind`: "packed" (copy `srcs` into `dsts`, then broadcast the buffer), "message" (broadcast
    `msgs[0]` straight from the source's memory) or "grouped" (copy `srcs` into `dsts`, then one
    coalesced group of per-tensor messages `msgs`)."""

    kind: str
    dsts: list[torch.Tensor] = field(default_factory=list)
    srcs: list[torch.Tensor] = field(default_factory=list)
    msgs: list[torch.Tensor] = field(default_factory=list)
    nbytes: int = -1
    """The bucket's bytes once known (-1: not yet)."""


@dataclass
class SendPlan:
    """A sender's buckets, replayable while its plan digest and its anchors stay as recorded."""

    digest: str
    views: Any
    """The engine's buffer views the plan packs into (replaced when the buffers are)."""
    anchors: list[torch.Tensor]
    layout: tuple[Hashable, ...]
    buckets: dict[int, BucketSend]

    def matches(self, digest: str, views: Any, anchors: Sequence[torch.Tensor]) -> bool:
        """Whether this plan may be replayed for `anchors` (what the source holds now) into the
        buffers behind `views`."""
        return digest == self.digest and views is self.views and anchors_unmoved(self.anchors, self.layout, anchors)


def anchors_unmoved(held: Sequence[torch.Tensor], layout: tuple[Hashable, ...], anchors: Sequence[torch.Tensor]) -> bool:
    """Whether a plan built over `held` (then laid out as `layout`) may be replayed for `anchors`,
    what the source holds now: neither the plan's own tensors (storage swapped or resized) nor the
    source's moved."""
    if len(anchors) != len(held) or layout_of(held) != layout:
        return False
    return all(a is b for a, b in zip(anchors, held)) or layout_of(anchors) == layout


def anchors_of(weights: Iterable[tuple[str, torch.Tensor]]) -> list[torch.Tensor] | None:
    """A walk's anchors (`WeightWalk.anchors`, sources/base.py), or None when the weights cannot
    name them (a plain iterator: every sync then walks it tensor by tensor)."""
    return weights.anchors() if isinstance(weights, WeightWalk) else None


def close_walk(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """End a walk that `anchors_of` started (`WeightWalk.close`); nothing for a plain iterator."""
    if isinstance(weights, WeightWalk):
        weights.close()


@dataclass
class BucketReceive:
    """What a receiver does with one bucket read from its buffer, decided once per plan: the whole
    tensors it yields (views of the buffer), and the chunks it copies into their reassembly
    tensors (coalesced), each with the full tensor to yield once its last chunk is in."""

    whole: list[tuple[str, torch.Tensor]]
    chunk_dsts: list[torch.Tensor]
    chunk_srcs: list[torch.Tensor]
    chunks: list[tuple[str, int, torch.Tensor]]
    """(name, chunk bytes, the full tensor's view)."""


@dataclass
class ReceivePlan:
    """A receiver's buckets, replayable while the plan digest, its buffer views, its reassembly
    tensors and the loader's destinations of chunked tensors stay as recorded."""

    digest: str
    views: Any
    assembly: Any
    anchors: list[torch.Tensor | None]
    layout: tuple[Hashable, ...]
    buckets: dict[int, BucketReceive] = field(default_factory=dict)
    chunk_bytes: dict[str, int] = field(default_factory=dict)
    """Bytes of each chunked tensor: a sync counts them down as chunks land."""
    nbytes: dict[int, int] = field(default_factory=dict)
    """Bytes of each bucket read from a buffer (manifest index -> bytes)."""

    def matches(self, digest: str, views: Any, assembly: Any, anchors: Sequence[torch.Tensor | None]) -> bool:
        """Whether this plan may be replayed: same digest, the same buffer views and reassembly
        tensors (objects the engine replaces when it drops them), destinations where they were."""
        return (
            digest == self.digest and views is self.views and assembly is self.assembly and len(anchors) == len(self.anchors)
            and optional_layout(anchors) == self.layout and optional_layout(self.anchors) == self.layout
        )


def optional_layout(tensors: Sequence[torch.Tensor | None]) -> tuple[Hashable, ...]:
    """Where `tensors` live, some entries None (no tensor there): (address, shape, strides, dtype,
    device) of each, in order (a receiver's destinations: hundreds, not a sender's thousands of anchors)."""
    return tuple(None if t is None else (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device) for t in tensors)
