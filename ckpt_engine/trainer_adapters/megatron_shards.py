"""Megatron as a multi-sender weight source: each (pipeline stage, expert-parallel rank) sends its own.

A Megatron rank already holds whole HF tensors of its stage once TP is gathered within the stage,
and whole experts of its EP rank: nothing has to cross a stage or an EP group to be sent. So the
senders are one rank per (PP stage, EP rank), numbered `pp_rank * ep_size + ep_rank` (global rank
0 is sender 0, the sync's controller). Sender (s, r) owns, whole, every expert tensor of its own
experts in stage s's layers, and a byte-balanced share of stage s's dense tensors (attention,
norms, router, embeddings on the first stage, final norm and head on the last), which every EP
rank of the stage holds alike. Ownership follows from the stage spec lists (`stage_specs`, known
on every rank since construction) and the group sizes: no collective.

With TP > 1 the TP shards are gathered within the stage, as the single-sender export does: TP
rank 0 of each (stage, EP rank) sends (`sends`), the other TP ranks are its TP helpers (same
`sender_index`, `sends = False`, not in the weight-sync group). A helper walks its sender's piece
sequence in step (`assist_piece`: the same TP all-gathers, no conversion). Since producing a
piece is then collective (`collective_pieces`), the sync layer adds a ready round before anything
streams (a rank that cannot take part stops every rank, by name) and a sender whose send fails
part-way finishes its walk, so its helpers are not left in a gather.

Supported layouts: no data-parallel replica besides the EP ranks (every rank of the model world
is then a sender or a TP helper of one); with TP > 1 also EP = 1 (with expert TP 1 Megatron's EP
groups cut across the TP groups), and expert TP = 1 whenever the model has experts (experts
split over expert TP are not gathered here). Other layouts report `num_senders = 1` (the
single-sender `iter_weights()` path stays as it is) and `owners()` / `local_piece()` raise a
ValueError that says why (`sharded_refusal`).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import torch

from ckpt_engine.manifest import TensorSpec
from ckpt_engine.planning.ownership import OwnerMap, Shard
from ckpt_engine.sources.sharded import ShardedWeightSource

if TYPE_CHECKING:
    from ckpt_engine.trainer_adapters.megatron_export import MegatronExporter, _Item
    from ckpt_engine.trainer_adapters.megatron_groups import MegatronGroups

__all__ = ["MegatronShardedSource", "expert_index", "sharded_refusal", "stage_owners"]

_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")


def expert_index(name: str) -> int | None:
    """The global expert an HF tensor belongs to (`...mlp.experts.<e>....`), None for dense ones."""
    m = _EXPERT.search(name)
    return int(m.group(1)) if m else None


def sharded_refusal(groups: MegatronGroups, export_mode: str, num_experts: int = 0) -> str | None:
    """Why this layout cannot send per stage / per EP rank, or None when it can."""
    if export_mode != "gather_to_first":
        return (
            f"export_mode={export_mode!r} lists one stage's metadata only; multi-sender sync needs "
            "export_mode='gather_to_first'"
        )
    if num_experts and groups.etp_size > 1:
        return (
            f"Megatron multi-sender sync supports expert tensor parallelism 1 only (got expert TP={groups.etp_size}): "
            "experts split over expert TP are not gathered per sender; use senders=rank0"
        )
    if groups.tp_size > 1 and groups.ep_size > 1:
        return (
            f"Megatron multi-sender sync supports TP > 1 with expert parallelism 1 only (got TP={groups.tp_size}, EP="
            f"{groups.ep_size}): a TP group's ranks then hold different experts (expert TP 1) or split them "
            "(expert TP > 1); use senders=rank0"
        )
    if groups.dp_size != groups.ep_size:
        return (
            f"Megatron multi-sender sync needs every rank to be a sender or a TP helper of one, but data parallelism "
            f"{groups.dp_size} over expert parallelism {groups.ep_size} leaves replicas that do not send; use senders=rank0"
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


class MegatronShardedSource(ShardedWeightSource):
    """The `ShardedWeightSource` that `MegatronTrainEngine` extends.

    The engine sets `exporter`, `groups`, `_stages` and `config` and calls `_init_senders()`.
    Pieces are this sender's own HF tensors: with TP > 1 gathered over the stage's TP group (its
    TP helpers walk the same gathers, `assist_piece`), then converted locally (qkv split,
    [gate; up] split, vocab padding trimmed, wire dtype); no collective crosses a stage or an EP
    group. Each call gathers and converts from the live parameter (q, k and v each gather and
    split the fused QKV again): no cached part can outlive an optimizer step, even after a sync
    that failed half-way.
    """

    exporter: MegatronExporter
    groups: MegatronGroups
    _stages: list[list[TensorSpec]]
    config: Any
    stable_pieces = False  # split/cast parts are temporaries

    def _init_senders(self) -> None:
        g = self.groups
        self._refusal = sharded_refusal(g, self.config.export_mode, self.exporter.num_experts)
        if self._refusal is None:
            self.sender_index = g.pp_rank * g.ep_size + g.ep_rank
            self.num_senders = g.pp_size * g.ep_size
            self.sends = g.tp_rank == 0  # the other TP ranks are this sender's TP helpers
            self.collective_pieces = g.tp_size > 1  # pieces are TP gathers: a sender's walk must run to its end
        else:
            self.sender_index, self.num_senders = 0, 1
            self.sends, self.collective_pieces = True, False
        self._owners: dict[str, list[Shard]] | None = None
        self._pieces: dict[str, tuple[_Item, int]] | None = None

    def sharded_refusal(self) -> str | None:
        """Why this layout cannot send from every rank (e.g. TP with EP), or None."""
        return self._refusal

    def _check_layout(self) -> None:
        if self._refusal is not None:
            raise ValueError(self._refusal)

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

    def _gathered(self, name: str) -> tuple[_Item, int, torch.Tensor | list[torch.Tensor]]:
        """`name`'s Megatron item, its global expert (-1: dense) and the item's TP-gathered tensor.

        The checks come first and are the same on every TP rank of the sender (same stage, same
        plan), so a request they refuse is refused by all of them before any gather."""
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
        with torch.no_grad():  # TP size 1 (and expert TP 1 for experts): the local tensor, no collective
            return item, e, ex._gather_tp(item, ex.local_tensor(item.param), self.groups.etp if item.expert else self.groups.tp)

    def local_piece(self, name: str) -> torch.Tensor:
        """This sender's tensor `name`, whole and HF-converted; ValueError for one it does not own.
        With TP > 1 a collective on the TP group: its helpers call `assist_piece(name)` in step."""
        item, e, full = self._gathered(name)
        ex = self.exporter
        with torch.no_grad():  # converted afresh on every call: nothing is cached past a step
            for out, t in ex._convert(item, full, ex._expert_specs(item, e) if e >= 0 else item.specs):
                if out == name:
                    return t
        raise AssertionError(f"{name}: its Megatron item did not produce it")  # _local_items maps names to their items

    def assist_piece(self, name: str) -> None:
        """A TP helper's part of its sender's `local_piece(name)`: the same TP gather, nothing kept."""
        self._gathered(name)
