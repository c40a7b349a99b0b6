"""Sharded weight sources: every trainer rank sends the bytes it owns, with no gather.

A multi-sender source is a `WeightSource` that also knows, without communicating, which byte
range of each tensor every sender holds (`owners`), and hands out its own piece of a tensor on
request (`local_piece`). The weight-sync group then has one sender per trainer rank; the planner
splits the work by ownership and the receivers reassemble full, HF-named tensors.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Protocol, runtime_checkable

import torch

from ckpt_engine.manifest import BucketManifest, TensorSpec
from ckpt_engine.planning.ownership import OwnerMap, row_shards

__all__ = ["PieceWalk", "ShardedStateDictSource", "ShardedWeightSource", "iter_pieces", "piece_names"]


@runtime_checkable
class ShardedWeightSource(Protocol):
    """What `sync_rollout_weights(..., senders="all")` needs from each trainer rank.

    `sender_index` / `num_senders`: this rank's place among the senders (trainer rank order).
    `owners()`: the same map on every rank (pure; no collective). Tensors it leaves out are
    replicated on every rank; the planner assigns them. `local_piece(name)`: this rank's shard of
    a tensor it owns (its bytes in the tensor's row-major layout, any shape, wire dtype or a float
    dtype to cast from), or the whole tensor when it is replicated. Called in plan order, once per
    piece; the tensor may be freed after the next call unless `stable_tensors` is true. Optional:
    `piece_anchors()`, inside a walk, the tensors every piece is a view of (see `PieceWalk`).
    """

    sender_index: int
    num_senders: int

    def metadata(self) -> list[TensorSpec]: ...

    def owners(self) -> OwnerMap: ...

    def local_piece(self, name: str) -> torch.Tensor: ...


def piece_names(manifest: BucketManifest, sender: int) -> Iterator[str]:
    """The tensors sender `sender` sends, once each, in the order of its buckets (a tensor split
    over buckets is one piece)."""
    last = None
    for bucket in manifest.sender_buckets(sender):
        for e in bucket.entries:
            if e.name != last:
                last = e.name
                yield e.name


def iter_pieces(source: ShardedWeightSource, manifest: BucketManifest) -> PieceWalk:
    """The (name, piece) pairs this rank sends, in the order of its buckets, as a `PieceWalk`. A
    source with `begin_pieces()` / `end_pieces()` hooks hears when the walk starts and ends (it may
    keep what it made for one walk, e.g. casts, and must drop it before the next)."""
    return PieceWalk(source, manifest)


class PieceWalk:
    """One walk of a source's pieces: iterating it yields (name, piece) pairs (one generator per
    walk, so a caller that resumes iterating after a failure continues the same walk).

    A source with `piece_anchors()` also lets a transport skip the walk: `anchors()` starts it
    without producing a single piece and returns the tensors every piece is a view of, so a
    transport that recorded its copies from these pieces at an earlier sync may replay them while
    the anchors stay where they were (`backends/copy_plan.py`); `close()` ends it."""

    def __init__(self, source: ShardedWeightSource, manifest: BucketManifest) -> None:
        self.source, self.manifest = source, manifest
        self._gen: Iterator[tuple[str, torch.Tensor]] | None = None

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self._gen is None:
            self._gen = self._walk()
        return self._gen

    def __next__(self) -> tuple[str, torch.Tensor]:
        return next(iter(self))

    def _walk(self) -> Iterator[tuple[str, torch.Tensor]]:
        self._hook("begin_pieces")
        try:
            for name in piece_names(self.manifest, self.source.sender_index):
                yield name, self.source.local_piece(name)
        finally:
            self._hook("end_pieces")

    def _hook(self, name: str) -> None:
        fn = getattr(self.source, name, None)
        if callable(fn):
            fn()

    def anchors(self) -> list[torch.Tensor] | None:
        """Start a walk that produces no piece (call `close()` after the transfer) and return the
        source's anchors; None when the source cannot name them."""
        get = getattr(self.source, "piece_anchors", None)
        if not callable(get):
            return None
        self._hook("begin_pieces")
        try:
            return list(get())
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """End a walk `anchors()` started."""
        self._hook("end_pieces")


def even_rows(rows: int, num_senders: int) -> list[int]:
    """torch's dim-0 split (FSDP2, `torch.chunk`): ceil-sized blocks, the last ones short or empty."""
    per = -(-rows // num_senders) if rows else 0
    return [max(0, min(per, rows - s * per)) for s in range(num_senders)]


class ShardedStateDictSource:
    """A full state dict held on every rank, sent as if dim-0 sharded: each rank sends its row
    block of every tensor of 2+ dims (the rest is replicated). For `ckpt-engine bench --senders N`
    and tests; a real sharded trainer implements the same protocol over its own shards."""

    stable_tensors = True

    def __init__(
        self, weights: Mapping[str, torch.Tensor], sender_index: int, num_senders: int, dtype: torch.dtype | None = None,
        keep_dtype: frozenset[str] = frozenset(),
    ) -> None:
        if not 0 <= sender_index < num_senders:
            raise ValueError(f"sender_index must be in [0, {num_senders}), got {sender_index}")
        self.weights = dict(weights)
        self.sender_index, self.num_senders = sender_index, num_senders
        self.dtype, self.keep_dtype = dtype, keep_dtype
        self.is_sender = True
        self._pieces: dict[str, torch.Tensor] = {}  # the same view every sync: the sender skips re-checking it

    def _wire(self, name: str, t: torch.Tensor) -> torch.dtype:
        return self.dtype if self.dtype is not None and t.is_floating_point() and name not in self.keep_dtype else t.dtype

    def metadata(self) -> list[TensorSpec]:
        return [TensorSpec(n, str(self._wire(n, t)).removeprefix("torch."), tuple(t.shape)) for n, t in self.weights.items()]

    def owners(self) -> OwnerMap:
        out = {}
        for spec in self.metadata():
            if len(spec.shape) >= 2:
                out[spec.name] = row_shards(spec, even_rows(spec.shape[0], self.num_senders))
        return out

    def local_piece(self, name: str) -> torch.Tensor:
        piece = self._pieces.get(name)
        if piece is None:
            t = self.weights[name]
            if t.dim() >= 2 and self.num_senders > 1:
                rows = even_rows(t.shape[0], self.num_senders)
                start = sum(rows[: self.sender_index])
                t = t[start : start + rows[self.sender_index]]
            piece = self._pieces[name] = t
        return piece

    def piece_anchors(self) -> list[torch.Tensor]:
        """The tensors every piece is a view of (see `PieceWalk.anchors`)."""
        return list(self.weights.values())

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.weights.items()
