"""What each FSDP2 rank holds of every exported tensor, from the DTensor sharding alone.

FSDP2 shards dim 0 with `torch.chunk` semantics (ceil(rows / world) rows per rank, the last ones
fewer or none); rows [r0, r1) are bytes [r0 * row_bytes, r1 * row_bytes) of the flat wire image, so
ownership follows from the global shape and the world size. A transformers-5 fused expert tensor
becomes one checkpoint tensor per expert and output, each owned whole by the rank holding it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from ckpt_engine.manifest import TensorSpec
from ckpt_engine.planning.ownership import Shard, row_shards
from ckpt_engine.sources.sharded import even_rows

__all__ = ["dim0_rows", "expert_part", "fused_expert_shards", "own_rows", "row_start", "shard_owners"]


def dim0_rows(name: str, param: torch.Tensor, rank: int, world_size: int) -> list[int] | None:
    """Rows of dim 0 each rank of the FSDP mesh holds; None for a replicated tensor.

    Checks this rank's local shard against the computed split, so a torch that shards differently
    fails here, by name, instead of sending wrong bytes. Only plain dim-0 sharding maps to one
    contiguous byte range per rank: any other placement (a `shard_placement_fn` choosing dim > 0,
    strided shards) is a ValueError.
    """
    from torch.distributed.tensor import DTensor, Shard as ShardPlacement

    if not isinstance(param, DTensor):
        return None
    placements = tuple(param.placements)
    if all(p.is_replicate() for p in placements):
        return None
    if len(placements) != 1 or type(placements[0]) is not ShardPlacement or placements[0].dim != 0:
        raise ValueError(
            f"{name}: FSDP2 placement {placements} is not a plain dim-0 shard; multi-sender sync needs "
            "every rank's part to be a row range (drop the shard_placement_fn for this parameter)"
        )
    if param.dim() == 0:
        raise ValueError(f"{name}: a 0-dim parameter cannot be sharded on dim 0")
    rows = even_rows(param.shape[0], world_size)
    local = param.to_local()
    if local.shape[0] != rows[rank] or tuple(local.shape[1:]) != tuple(param.shape[1:]):
        raise RuntimeError(
            f"{name}: this rank's FSDP2 shard has shape {tuple(local.shape)}, but torch.chunk of "
            f"{tuple(param.shape)} over {world_size} ranks gives it {rows[rank]} rows"
        )
    return rows


def row_start(rows: Sequence[int], rank: int) -> int:
    """The first global row that `rank` holds."""
    return sum(rows[:rank])


def fused_expert_shards(specs: Sequence[TensorSpec], rows: Sequence[int], outputs: int) -> dict[str, list[Shard]]:
    """Owners of the per-expert tensors of one fused expert parameter: `specs` lists them expert
    by expert (`outputs` per expert), and expert e lives on the rank whose rows cover e."""
    owner_of: list[int] = [rank for rank, n in enumerate(rows) for _ in range(n)]
    if len(specs) != len(owner_of) * outputs:
        raise ValueError(f"{len(specs)} per-expert tensors do not match {len(owner_of)} experts x {outputs} outputs")
    return {s.name: [Shard(owner_of[i // outputs], 0, s.nbytes)] for i, s in enumerate(specs)}


def expert_part(local: torch.Tensor, index: int, outputs: int, first_expert: int) -> torch.Tensor:
    """Per-expert tensor `index` (in `fused_expert_shards` order) out of this rank's local experts:
    a view of the shard (the same split `unfuse_experts` applies to the full tensor)."""
    expert, part = divmod(index, outputs)
    return local[expert - first_expert].chunk(outputs, dim=0)[part]


def own_rows(name: str, local: torch.Tensor, rows: Sequence[int], rank: int, index: int, outputs: int) -> torch.Tensor:
    """What this rank sends of a dim-0 sharded tensor: its local rows, or, for a fused expert
    shard (`outputs` > 0), the expert `index` names; a ValueError when the rank holds none of it."""
    if outputs:
        first, expert = row_start(rows, rank), index // outputs
        if not first <= expert < first + rows[rank]:
            raise ValueError(f"{name}: expert {expert} is not on rank {rank}")
        return expert_part(local, index, outputs, first)
    if rows[rank] == 0:
        raise ValueError(f"{name}: rank {rank} holds none of its rows")
    return local


def shard_owners(entries: Iterable[tuple[Sequence[TensorSpec], int, Sequence[int] | None]]) -> dict[str, list[Shard]]:
    """The ownership map of a dim-0 sharded model from (specs, expert outputs, rows per rank) per
    parameter: row ranges, or whole experts of a fused expert tensor; replicated parameters (rows
    None) are left out, for the planner to give each to one rank."""
    owners: dict[str, list[Shard]] = {}
    for specs, expert_outputs, rows in entries:
        if rows is None:
            continue
        if expert_outputs:
            owners.update(fused_expert_shards(specs, rows, expert_outputs))
        else:
            owners[specs[0].name] = row_shards(specs[0], rows)
    return owners
