"""`MegatronSource`: the weights of a megatron-core `GPTModel` (TP/PP/EP), under Hugging Face names.

Built from one rank's model chunk and the HF config of its family, with no training engine; the
process groups come from `pg_collection` or `megatron.core.parallel_state`. The conversion
itself (naming plan, TP/EP gathers, HF -> Megatron load) is `megatron_export.py`.

Many senders: once TP is gathered within a stage, a rank holds whole HF tensors of its stage and
whole experts of its EP rank, so nothing crosses a stage or an EP group. The senders are one rank
per (PP stage, EP rank), `pp_rank * ep_size + ep_rank`: each owns its experts whole and a
byte-balanced share of its stage's dense tensors, from the stage spec lists alone (no collective).
With TP > 1, TP rank 0 sends and the other TP ranks are helpers (`sends = False`) that walk the
same TP gathers in step (`assist_piece`); producing a piece is then collective
(`collective_pieces`), so the sync layer adds a ready round and a failed sender finishes its walk.

Supported layouts: no data-parallel replica besides the EP ranks; with TP > 1 also EP = 1, and
expert TP = 1 whenever the model has experts. Other layouts report `num_senders = 1` and say why
in `sharded_refusal`.

Collective contract: every rank of the model-parallel world builds the source and walks
`iter_weights()` to its end, in step.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ckpt_engine.manifest import TensorSpec
from ckpt_engine.planning.ownership import OwnerMap, Shard
from ckpt_engine.sources.megatron_export import MegatronExporter, walk_to_first_stage
from ckpt_engine.sources.megatron_groups import MegatronGroups
from ckpt_engine.sources.sharded import ShardedWeightSource
from ckpt_engine.sources.wire import DEFAULT_KEEP_FP32, WirePolicy

if TYPE_CHECKING:
    from ckpt_engine.sources.megatron_export import _Item

__all__ = ["EXPORT_MODES", "MegatronSource", "expert_index", "sharded_refusal", "single_sender", "stage_owners"]

EXPORT_MODES = ("gather_to_first", "per_stage")

_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")


def expert_index(name: str) -> int | None:
    """The global expert an HF tensor belongs to (`...mlp.experts.<e>....`), None for dense ones."""
    m = _EXPERT.search(name)
    return int(m.group(1)) if m else None


def single_sender(g: MegatronGroups, export_mode: str) -> bool:
    """Whether this rank yields tensors to stream with one sender per export: the first TP/DP/EP
    rank of every stage ("per_stage") or of the first stage only ("gather_to_first")."""
    first_of_stage = g.tp_rank == 0 and g.dp_rank == 0 and g.ep_rank == 0
    return first_of_stage and (export_mode == "per_stage" or g.pp_rank == 0)


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


class MegatronSource(ShardedWeightSource):
    """The weights of one rank's megatron-core `GPTModel` chunk, under HF checkpoint names.

    `keep_fp32`: regexes of names that travel as float32 (MoE router gates by default).
    `export_mode`: "gather_to_first" (rank 0 yields every stage's tensors, broadcast over the
    pipeline group) or "per_stage" (each stage's first rank sends its own). `local_tensor(param)`:
    this TP rank's full shard of a parameter (Megatron-FSDP gathers its data-parallel shards).
    Building it is a collective over the pipeline group (the stages' specs are exchanged).

    Each piece is gathered and converted from the live parameter on every call, never cached, so no
    part can outlive an optimizer step, even after a sync that failed half-way.
    """

    stable_pieces = False  # split/cast parts are temporaries

    def __init__(
        self,
        model: nn.Module,
        hf_config: Any,
        *,
        pg_collection: Any = None,
        dtype: torch.dtype | str | None = None,
        keep_fp32: Sequence[str] = DEFAULT_KEEP_FP32,
        export_mode: str = "gather_to_first",
        local_tensor: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        if export_mode not in EXPORT_MODES:
            raise ValueError(f"export_mode must be one of {EXPORT_MODES}, got {export_mode!r}")
        self.model = model
        self.hf_config = hf_config
        self.export_mode = export_mode
        self.groups = MegatronGroups.from_megatron(pg_collection)
        self.exporter = MegatronExporter(model, hf_config, WirePolicy(dtype, keep_fp32), self.groups, local_tensor=local_tensor)
        self._stages = self.exporter.stage_specs()
        self.is_sender = single_sender(self.groups, export_mode)
        g = self.groups
        self._refusal = sharded_refusal(g, export_mode, self.exporter.num_experts)
        if self._refusal is None:
            self.sender_index = g.pp_rank * g.ep_size + g.ep_rank
            self.num_senders = g.pp_size * g.ep_size
            self.sends = g.tp_rank == 0  # the other TP ranks are this sender's TP helpers
            self.collective_pieces = g.tp_size > 1  # pieces are TP gathers: a sender's walk must run to its end
        self._owners: dict[str, list[Shard]] | None = None
        self._pieces: dict[str, tuple[_Item, int]] | None = None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def metadata(self) -> list[TensorSpec]:
        """Every stage's specs ("gather_to_first") or this stage's ("per_stage"); no tensor gathers."""
        if self.export_mode == "per_stage":
            return list(self._stages[self.groups.pp_rank])
        return [s for stage in self._stages for s in stage]

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF tensors; every rank walks it. TP/EP gathers on the owning stage, then a PP broadcast."""
        if self.export_mode == "per_stage":
            yield from self.exporter.iter_local()
            return
        yield from walk_to_first_stage(self.exporter, self._stages, self.groups, self.device)

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
