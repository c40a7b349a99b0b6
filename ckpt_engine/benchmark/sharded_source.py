"""A full state dict on every rank, sent by every rank as if it were dim-0 sharded: the many-sender
source of `ckpt-engine bench --senders N` and of the tests (a real sharded trainer implements the
same `ShardedWeightSource` protocol over its own shards: `sources/fsdp2.py`, `sources/megatron.py`)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from ckpt_engine.manifest import TensorSpec
from ckpt_engine.planning.ownership import OwnerMap, row_shards
from ckpt_engine.sources.base import tensors_device
from ckpt_engine.sources.sharded import ShardedWeightSource, even_rows

__all__ = ["ShardedStateDictSource"]


class ShardedStateDictSource(ShardedWeightSource):
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
        self._pieces: dict[str, torch.Tensor] = {}  # the same view every sync: the sender skips re-checking it

    @property
    def device(self) -> torch.device | None:
        return tensors_device(self.weights.values())

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
