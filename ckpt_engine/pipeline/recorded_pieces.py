"""A delta sender's pieces as one walk of a stable source found them, replayed while the source's
anchors stay where they were.

A patch sync of a 30B MoE's thousands of tensors spent more host time walking the source (a
generator step, a name and a pointer check per tensor) than its diff kernels took on the device:
the sync was paced by the host. A source that names its anchors (`WeightWalk.anchors`: the
tensors every piece is a view of) lets the sender skip that walk, as the dense sender's recorded
copies do (`copy_plan.SendPlan`): one walk is recorded, every entry's source view and each bucket's
rows of the one-launch diff; later syncs check the anchors once and take everything from the
record. Only a walk whose every source was the caller's own memory (no conversion temporary) is
recorded.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from ckpt_engine.delta.layout import Row
from ckpt_engine.manifest import TensorMeta
from ckpt_engine.pipeline.copy_plan import anchors_unmoved, layout_of
from ckpt_engine.pipeline.piece_reader import PieceReader, Pieces, Seen

__all__ = ["PieceRecorder", "RecordedPieces"]

_Key = tuple[str, int]
"""An entry: its tensor's name and its chunk's offset within the tensor."""


class RecordedPieces(Pieces):
    """One recorded walk: each entry's source and whether it was in the wire layout, and per bucket
    (step ordinal) the rows of its one-launch diff when every entry was diffed from its source."""

    def __init__(
        self, digest: str, anchors: list[torch.Tensor], sources: dict[_Key, tuple[torch.Tensor, bool]], rows: dict[int, list[Row]]
    ) -> None:
        self.digest = digest
        self.anchors = anchors
        self.layout: tuple[Hashable, ...] = layout_of(anchors)
        self.sources = sources
        self.rows = rows

    def matches(self, digest: str, anchors: Sequence[torch.Tensor]) -> bool:
        """Whether this record may be replayed for the source's `anchors` now (same plan; the
        anchors neither replaced nor moved, nor their storage swapped)."""
        return digest == self.digest and anchors_unmoved(self.anchors, self.layout, anchors)

    def source(self, e: TensorMeta) -> tuple[torch.Tensor, bool]:
        return self.sources[(e.name, e.chunk_offset)]

    def same_as_last(self, entries: Sequence[TensorMeta], seen: Seen | None) -> bool:
        """Always, for a stretch recorded from this walk: the anchors have not moved."""
        return seen is not None and len(seen) == len(entries)

    def recorded_rows(self, ordinal: int) -> list[Row] | None:
        return self.rows.get(ordinal)

    def keep_rows(self, ordinal: int, rows: list[Row]) -> None:
        """Rows found while replaying (a bucket's first one-pass diff may come syncs after the
        walk was recorded) hold as long as the record does."""
        self.rows[ordinal] = list(rows)


class PieceRecorder(Pieces):
    """A walk (`PieceReader`) that records what it yields, for `RecordedPieces`."""

    def __init__(self, reader: PieceReader) -> None:
        self.reader = reader
        self.sources: dict[_Key, tuple[torch.Tensor, bool]] = {}
        self.rows: dict[int, list[Row]] = {}
        self.replayable = True
        """False once a source was a conversion temporary of this walk."""

    def source(self, e: TensorMeta) -> tuple[torch.Tensor, bool]:
        src, own = self.reader.source(e)
        if not (own or e.is_whole):  # a chunk that is not `own` is a conversion temporary
            self.replayable = False
        self.sources[(e.name, e.chunk_offset)] = (src, own)
        return src, own

    def same_as_last(self, entries: Sequence[TensorMeta], seen: Seen | None) -> bool:
        if not self.reader.same_as_last(entries, seen):
            return False
        assert seen is not None
        for e, (ref, _ptr) in zip(entries, seen):
            t = ref()
            assert t is not None  # the walk just yielded it
            self.sources[(e.name, e.chunk_offset)] = (t, True)  # a stretch holds only own whole tensors
        return True

    def keep_rows(self, ordinal: int, rows: list[Row]) -> None:
        self.rows[ordinal] = list(rows)

    def recorded(self, digest: str, anchors: list[torch.Tensor]) -> RecordedPieces | None:
        """The record, or None when it cannot be replayed."""
        if not self.replayable:
            return None
        return RecordedPieces(digest, anchors, self.sources, self.rows)
