"""What each Megatron-FSDP2 rank holds of every exported tensor, read from its flat buffers.

Megatron-FSDP2 packs a unit's parameters of one dtype into one flat buffer (`DBuffer`): tensor i
starts at element `layout.tensor_to_offset[i]` of a global buffer padded to `layout.size`, and
rank r of a `Flat` (sharded) placement holds elements [r * size / world, (r + 1) * size / world).
The layout aligns every tensor and every rank boundary to whole rows, so each rank holds one
contiguous row range of each tensor: uneven, and often none at all (a tensor lies wholly inside
one rank's range). That split is not DTensor's `Shard(0)` (torch.chunk) split, which is why the
parameters' `full_tensor()` would misplace rows; ownership here comes from the buffer layout
alone, which every rank holds, so no rank asks another and nothing is gathered.

A rank's piece of a tensor is a view of its local buffer (the compute weights that the gathering
`iter_weights` path gathers, or the main weights where that path takes them), cast to the wire
dtype. Fused MoE experts (dim 0 = experts) are owned whole, expert by expert, as with FSDP2.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from ckpt_engine.planning.ownership import OwnerMap, Shard
from ckpt_engine.sources.sharded import ShardedWeightSource
from ckpt_engine.trainer_adapters.common import torch_dtype
from ckpt_engine.trainer_adapters.export_plan import ExportEntry
from ckpt_engine.trainer_adapters.fsdp2_shards import expert_part, own_rows, shard_owners

__all__ = ["MegatronFSDP2ShardedSource", "dbuffer_rows", "flat_rows"]


def flat_rows(name: str, offset: int, shape: Sequence[int], buffer_numel: int, world_size: int) -> list[int]:
    """Rows of dim 0 that each rank holds of a tensor at element `offset` of a flat buffer of
    `buffer_numel` elements split into `world_size` equal, consecutive ranges (pure).

    ValueError when the numbers describe no valid row-aligned layout (a rank boundary inside a
    row, a tensor past the buffer's end): sending such a split would put bytes in wrong rows.
    """
    if world_size < 1:
        raise ValueError(f"{name}: world_size must be >= 1, got {world_size}")
    if len(shape) == 0:
        raise ValueError(f"{name}: a 0-dim tensor has no rows to shard")
    if buffer_numel < 0 or buffer_numel % world_size:
        raise ValueError(f"{name}: a flat buffer of {buffer_numel} elements does not split evenly over {world_size} ranks")
    row = math.prod(shape[1:])
    numel = row * shape[0]
    if row <= 0 and numel:
        raise ValueError(f"{name}: shape {tuple(shape)} has empty rows")
    if offset < 0 or offset + numel > buffer_numel:
        raise ValueError(f"{name}: elements [{offset}, {offset + numel}) lie outside the flat buffer of {buffer_numel}")
    per = buffer_numel // world_size
    rows = []
    for rank in range(world_size):
        lo, hi = max(offset, rank * per), min(offset + numel, (rank + 1) * per)
        n = max(0, hi - lo)
        if n and ((lo - offset) % row or n % row):
            raise ValueError(
                f"{name}: rank {rank} holds elements [{lo - offset}, {lo - offset + n}) of it, not whole rows of {row}"
            )
        rows.append(n // row if n else 0)
    return rows


def dbuffer_rows(name: str, buffer: Any, index: int, world_size: int) -> list[int] | None:
    """Rows each rank holds of logical tensor `index` of a Megatron-FSDP2 `DBuffer`; None when
    every rank holds all of it (`Replicate`). Only a single `Flat` axis (plain FSDP) is a row
    split; any other placement is a ValueError naming the tensor."""
    from megatron_fsdp.experimental import Flat, Replicate

    placements = tuple(buffer.placements)
    if all(isinstance(p, Replicate) for p in placements):
        return None
    if len(placements) != 1 or not isinstance(placements[0], Flat):
        raise ValueError(
            f"{name}: Megatron-FSDP2 placement {placements} is not one Flat axis; multi-sender sync needs every "
            "rank's part to be a row range of its flat buffer"
        )
    layout = buffer.layout
    return flat_rows(name, layout.tensor_to_offset[index], tuple(layout.tensor_shapes[index]), layout.size, world_size)


class MegatronFSDP2ShardedSource(ShardedWeightSource):
    """The `ShardedWeightSource` that `MegatronFSDP2TrainEngine` extends.

    The engine sets `_entries` (export plan), `_where` (each entry's parameter group and index
    in it), `rank` and `world_size`, then calls `_init_senders()`. `owners()` and
    `local_piece()` are local: no collective of any kind. Every trainer rank is a sender
    (`sender_index` = its rank in the mesh).
    """

    _entries: list[ExportEntry]
    _where: list[tuple[Any, int]]
    rank: int
    world_size: int

    def _init_senders(self) -> None:
        self.sender_index = self.rank
        self.num_senders = self.world_size
        self._pieces = {s.name: (i, k) for i, e in enumerate(self._entries) for k, s in enumerate(e.specs)}
        self._owners: dict[str, list[Shard]] | None = None
        self._rows: dict[int, list[int] | None] = {}

    @property
    def stable_pieces(self) -> bool:
        """Whether every piece is a view of a persistent buffer in its wire dtype (no cast): the
        transport may then send from it without a copy."""
        return all(torch_dtype(s.dtype) == e.dtype for e in self._entries for s in e.specs)

    def owners(self) -> OwnerMap:
        """Which byte range of every exported tensor each trainer rank holds: its rows of the
        flat buffer (uneven, a rank may hold none), whole experts of a fused expert tensor. The
        same map on every rank, from the buffer layouts alone; replicated tensors are left out
        (the planner gives each to one rank)."""
        if self._owners is None:
            self._owners = shard_owners((e.specs, e.expert_outputs, self._rows_of(i)) for i, e in enumerate(self._entries))
        return self._owners

    def local_piece(self, name: str) -> torch.Tensor:
        """This rank's part of `name` in its wire dtype: its rows (a view of its flat buffer, or
        the cast of one), one of its own experts, or the whole tensor when replicated. Local only:
        no all-gather. Asking for a tensor this rank holds no part of is a ValueError."""
        found = self._pieces.get(name)
        if found is None:
            raise ValueError(f"{name!r} is not a tensor this Megatron-FSDP2 model exports (see metadata())")
        i, k = found
        e = self._entries[i]
        want = torch_dtype(e.specs[k].dtype)
        rows = self._rows_of(i)
        local = self._local_rows(i, rows)
        if rows is None:  # replicated: every rank holds all of it
            t = expert_part(local, k, e.expert_outputs, 0) if e.expert_outputs else local
        else:
            t = own_rows(name, local, rows, self.rank, k, e.expert_outputs)
        with torch.no_grad():
            return t.detach() if t.dtype == want else t.detach().to(want)

    def _rows_of(self, i: int) -> list[int] | None:
        if i not in self._rows:
            group, index = self._where[i]
            self._rows[i] = dbuffer_rows(self._entries[i].name, group.model_weight, index, self.world_size)
        return self._rows[i]

    def _local_rows(self, i: int, rows: list[int] | None) -> torch.Tensor:
        """Entry i's rows in this rank's buffer: the compute weights, or the main weights where
        the compute dtype is narrower than the wire's (as the gathering path exports them).
        Checked against the computed split, so a layout read wrongly fails here, by name."""
        e = self._entries[i]
        group, index = self._where[i]
        want = torch_dtype(e.specs[0].dtype)
        narrow = e.dtype.is_floating_point and e.dtype.itemsize < want.itemsize
        buffer = group.main_weight if narrow else group.model_weight
        local = buffer.get_local_tensor(index)
        expected = tuple(e.shape) if rows is None else (rows[self.rank], *e.shape[1:])
        per = buffer.layout.size // self.world_size
        if tuple(local.shape) != expected or (rows is not None and buffer.offset != self.rank * per):
            raise RuntimeError(
                f"{e.name}: this rank's Megatron-FSDP2 buffer holds shape {tuple(local.shape)} at element {buffer.offset}, "
                f"but its flat layout gives rank {self.rank} shape {expected} at element {self.rank * per}"
            )
        return local
