"""Megatron as a multi-sender weight source: each (pipeline stage, expert-parallel rank) sends its own.

A Megatron rank already holds whole HF tensors of its stage once TP is gathered within the stage,
and whole experts of its EP rank: nothing has to cross a stage or an EP group to be sent. So the
senders are one rank per (PP stage, EP rank), numbered `pp_rank * ep_size + ep_rank` (global rank
0 is sender 0, the sync's controller). Sender (s, r) owns, whole, every expert tensor of its own
experts in stage s's layers, and a byte-balanced share of stage s's dense tensors (attention,
norms, router, embeddings on the first stage, final norm and head on the last), which every EP
rank of the stage holds alike. Ownership follows from the stage spec lists (`stage_specs`, known
on every rank since construction) and the group sizes: no collective.

Supported layout: TP = expert-TP = 1 and no data-parallel replica besides the EP ranks (every
rank of the model world is then a sender). With TP > 1 the within-stage gather is a collective
that the TP ranks that do not send would have to walk in step with their sender, and the sync's
follower path makes every trainer rank a sender: such layouts report `num_senders = 1` (the
single-sender `iter_weights()` path stays as it is) and `owners()` / `local_piece()` raise a
ValueError that says why (`sharded_refusal`).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import torch

from ckpt_engine.manifest import TensorSpec
from ckpt_engine.ownership import OwnerMap, Shard

if TYPE_CHECKING:
    from ckpt_engine.trainer_adapters.megatron_export import MegatronExporter, _Item
    from ckpt_engine.trainer_adapters.megatron_groups import MegatronGroups

__all__ = ["MegatronShardedSource", "expert_index", "sharded_refusal", "stage_owners"]

_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")


def expert_index(name: str) -> int | None:
    """The global expert an HF tensor belongs to (`...mlp.experts.<e>....`), None for dense ones."""
    m = _EXPERT.search(name)
    return int(m.group(1)) if m else None


def sharded_refusal(groups: MegatronGroups, export_mode: str) -> str | None:
    """Why this layout cannot send per stage / per EP rank, or None when it can."""
    if export_mode != "gather_to_first":
        return (
            f"export_mode={export_mode!r} lists one stage's metadata only; multi-sender sync needs "
            "export_mode='gather_to_first'"
        )
    if groups.tp_size > 1 or groups.etp_size > 1:
        return (
            f"Megatron multi-sender sync supports tensor parallelism 1 only (got TP={groups.tp_size}, expert TP="
            f"{groups.etp_size}): the within-stage TP gather would need the non-sending TP ranks; use senders=rank0"
        )
    if groups.dp_size != groups.ep_size:
        return (
            f"Megatron multi-sender sync needs every rank to be a sender, but data parallelism {groups.dp_size} over "
            f"expert parallelism {groups.ep_size} leaves replicas that do not send; use senders=rank0"
        )
    return None


def stage_owners(stages: list[list[TensorSpec]], ep_size: int, num_experts: int) -> dict[str, list[Shard]]:
    """Whole-tensor owners of every stage's tensors (pure): expert e of stage s goes to sender
    s * ep_size + e // (num_experts / ep_size); the dense ones, largest first, to the stage's sender with
    the fewest bytes so far (ties: the lowest index): the same map on every rank, bytes balanced."""
    if ep_size > 1 and num_experts % ep_size:
        raise ValueError(f"{num_experts} experts do not split evenly over expert parallelism {ep_size}")
    per_rank = num_experts // ep_size if num_experts else 0
    out: dict[str, list[Shard]] = {}
    for stage, specs in enumerate(stages):
        load = [0] * ep_size
        dense = []
        for spec in specs:
            e = expert_index(spec.name)
            if e is None:
                dense.append(spec)
                continue
            r = e // per_rank
            load[r] += spec.nbytes
            out[spec.name] = [Shard(stage * ep_size + r, 0, spec.nbytes)]
        for spec in sorted(dense, key=lambda s: -s.nbytes):  # largest first (stable): a close balance
            r = min(range(ep_size), key=lambda i: (load[i], i))
            load[r] += spec.nbytes
            out[spec.name] = [Shard(stage * ep_size + r, 0, spec.nbytes)]
    return out


class MegatronShardedSource:
    """The `ShardedWeightSource` side of `MegatronTrainEngine` (mixed into it).

    The engine sets `exporter`, `groups`, `_stages` and `config` and calls `_init_senders()`.
    Pieces are this rank's own HF tensors converted locally (qkv split, [gate; up] split, vocab
    padding trimmed, wire dtype): no collective of any kind is issued to produce them. Each call
    converts from the live parameter (q, k and v each split the fused QKV again): no cached
    part can outlive an optimizer step, even after a sync that failed half-way.
    """

    exporter: MegatronExporter
    groups: MegatronGroups
    _stages: list[list[TensorSpec]]
    config: Any
    stable_pieces = False  # split/cast parts are temporaries

    def _init_senders(self) -> None:
        g = self.groups
        self.sharded_refusal = sharded_refusal(g, self.config.export_mode)
        if self.sharded_refusal is None:
            self.sender_index = g.pp_rank * g.ep_size + g.ep_rank
            self.num_senders = g.pp_size * g.ep_size
        else:
            self.sender_index, self.num_senders = 0, 1
        self._owners: dict[str, list[Shard]] | None = None
        self._pieces: dict[str, tuple[_Item, int]] | None = None

    def _check_layout(self) -> None:
        if self.sharded_refusal is not None:
            raise ValueError(self.sharded_refusal)

    def owners(self) -> OwnerMap:
        """Every tensor's one owner (whole tensors); the same on every rank, no collective."""
        self._check_layout()
        if self._owners is None:
            self._owners = stage_owners(self._stages, self.groups.ep_size, self.exporter.num_experts)
        return self._owners

    def _local_items(self) -> dict[str, tuple[_Item, int]]:
        """HF name -> (Megatron item, global expert or -1) for every tensor this rank holds."""
        if self._pieces is None:
            ex = self.exporter
            per_rank = ex.num_experts // self.groups.ep_size if ex.num_experts else 0
            pieces: dict[str, tuple[_Item, int]] = {}
            for it in ex.items:
                if it.expert:
                    e = self.groups.ep_rank * per_rank + it.local_expert
                    pieces.update({s.name: (it, e) for s in ex._expert_specs(it, e)})
                else:
                    pieces.update({s.name: (it, -1) for s in it.specs})
            self._pieces = pieces
        return self._pieces

    def local_piece(self, name: str) -> torch.Tensor:
        """This sender's tensor `name`, whole and HF-converted; ValueError for one it does not own."""
        owners = self.owners()
        if name not in owners:
            raise ValueError(f"{name!r} is not a tensor this Megatron model exports")
        owner = owners[name][0].sender
        if owner != self.sender_index:
            stage, ep_rank = divmod(owner, self.groups.ep_size)
            raise ValueError(
                f"{name}: sent by sender {owner} (stage {stage}, EP rank {ep_rank}), not by this rank "
                f"(sender {self.sender_index}: stage {self.groups.pp_rank}, EP rank {self.groups.ep_rank})"
            )
        item, e = self._local_items()[name]
        ex = self.exporter
        with torch.no_grad():  # converted afresh on every call: nothing is cached past a step
            for out, t in ex._convert(item, ex.local_tensor(item.param), ex._expert_specs(item, e) if e >= 0 else item.specs):
                if out == name:
                    return t
        raise AssertionError(f"{name}: its Megatron item did not produce it")  # _local_items maps names to their items
