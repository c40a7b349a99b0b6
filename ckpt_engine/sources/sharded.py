"""Sharded weight sources: every trainer rank sends the bytes it owns, with no gather.

A multi-sender source is a `WeightSource` that also knows, without communicating, which byte
range of each tensor every sender holds (`owners`), and hands out its own piece of a tensor on
request (`local_piece`). The weight-sync group then has one sender per trainer rank; the planner
splits the work by ownership and the receivers reassemble full, HF-named tensors.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterator

import torch

from ckpt_engine.manifest import BucketManifest
from ckpt_engine.planning.ownership import OwnerMap
from ckpt_engine.sources.base import WeightSource, WeightWalk

__all__ = ["PieceWalk", "ShardedWeightSource", "even_rows", "iter_pieces", "piece_names"]


class ShardedWeightSource(WeightSource):
    """A weight source that sends from every trainer rank (`sync_rollout_weights(..., senders="all")`).

    `sender_index` / `num_senders`: this rank's place among the senders (one sender: it syncs as a
    plain `WeightSource`). `owners()`: the same map on every rank, no collective; tensors it leaves
    out are replicated and assigned by the planner. `local_piece(name)`: this rank's shard of a tensor
    (its bytes in row-major layout, any shape, wire dtype or a float dtype to cast from), or the whole
    tensor when replicated; called in plan order, once per piece, valid until the next call unless
    `stable_pieces`.
    """

    sender_index: int = 0
    num_senders: int = 1
    sends: bool = True
    """False on a TP helper: a rank with its sender's `sender_index` that joins no group and only
    walks its sender's gathers in step (`assist_piece`)."""
    collective_pieces: bool = False
    """Whether producing a piece is a collective with this sender's TP helpers: a sender's walk
    then runs to its end even after a failed send, and a ready round precedes every stream."""

    @property
    def stable_pieces(self) -> bool:
        """Whether every `local_piece` stays valid and unchanged for a whole sync (the transport
        may send from it without a copy). Defaults to `stable_tensors`; a source whose pieces
        are views while its `iter_weights()` gathers says so here."""
        return self.stable_tensors

    @property
    def sharded(self) -> bool:
        """Whether this source really sends from several ranks (`num_senders` > 1)."""
        return self.num_senders > 1

    def sharded_refusal(self) -> str | None:
        """Why this source cannot send from every rank in its layout (None: it can). Named in the
        error when a sync asks for many senders and `num_senders` is 1."""
        return None

    @abstractmethod
    def owners(self) -> OwnerMap:
        """Which byte range of every sharded tensor each sender holds; the same on every rank."""

    @abstractmethod
    def local_piece(self, name: str) -> torch.Tensor:
        """This rank's piece of `name` (see the class docstring)."""

    def assist_piece(self, name: str) -> None:
        """A TP helper's part of its sender's `local_piece(name)` (by default: the same call)."""
        self.local_piece(name)

    def piece_anchors(self) -> list[torch.Tensor] | None:
        """Inside a walk, the tensors every piece is a view of (see `PieceWalk.anchors`); None
        (the default) when the source cannot name them."""
        return None

    def begin_pieces(self) -> None:
        """A walk of this rank's pieces starts (the source may keep what it makes for one walk,
        e.g. casts, and must drop it before the next)."""

    def end_pieces(self) -> None:
        """The walk `begin_pieces` started ended (after its last piece, or a failure)."""


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
    """The (name, piece) pairs this rank sends, in the order of its buckets, as a `PieceWalk`; the
    source's `begin_pieces()` / `end_pieces()` hear when the walk starts and ends."""
    return PieceWalk(source, manifest)


class PieceWalk(WeightWalk):
    """One walk of a source's pieces (one generator per walk, so a caller that resumes iterating
    after a failure continues the same walk). `anchors()` starts a walk that produces no piece and
    returns the source's `piece_anchors()`, so a recorded copy plan may be replayed without walking
    (`pipeline/copy_plan.py`); `close()` ends it."""

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
        self.source.begin_pieces()
        try:
            for name in piece_names(self.manifest, self.source.sender_index):
                yield name, self.source.local_piece(name)
        finally:
            self.source.end_pieces()

    def anchors(self) -> list[torch.Tensor] | None:
        """Start a walk that produces no piece (call `close()` after the transfer) and return the
        source's anchors; None (and no walk started) when the source cannot name them."""
        self.source.begin_pieces()
        try:
            anchors = self.source.piece_anchors()
        except BaseException:
            self.close()
            raise
        if anchors is None:
            self.close()
            return None
        return list(anchors)

    def close(self) -> None:
        """End a walk `anchors()` started."""
        self.source.end_pieces()


def even_rows(rows: int, num_senders: int) -> list[int]:
    """torch's dim-0 split (FSDP2, `torch.chunk`): ceil-sized blocks, the last ones short or empty."""
    per = -(-rows // num_senders) if rows else 0
    return [max(0, min(per, rows - s * per)) for s in range(num_senders)]
