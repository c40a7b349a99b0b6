"""`MegatronFSDP2Source`: the weights of a HF causal LM sharded by Megatron-FSDP2's per-module `fully_shard`.

Megatron-FSDP2 (`megatron_fsdp.experimental.fully_shard`, megatron-fsdp >= 0.6.1) packs each
module's parameters of one dtype into flat buffers (`DBuffer`: main weights, model weights, main
grads). Built from the sharded model and its units (root first), with no training engine; every
unit on one 1-D mesh with `Flat` placements (plain FSDP).

One sender (`iter_weights`): pending all-gathers are finished and their buffers dropped first (a
prefetch left by an interrupted forward would hold the weights of before the last step); then each
unit is gathered on the all-gather stream, the next one issued before the current is consumed.
A parameter's local piece is a DBuffer range, not DTensor's `Shard(0)` chunk, so `full_tensor()`
would misplace its rows and is never called.

Many senders: tensor i starts at element `layout.tensor_to_offset[i]` of a buffer padded to
`layout.size`, and rank r holds elements [r * size / world, (r + 1) * size / world). The layout
aligns tensors and rank boundaries to whole rows, so each rank holds one contiguous (uneven, often
empty) row range of each tensor, known from the layout alone: nothing is gathered.

Needs CUDA; importing this module never fails. Collective contract: every rank of the mesh walks
`iter_weights()` to its end, in step.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ckpt_engine.manifest import TensorSpec
from ckpt_engine.planning.ownership import OwnerMap, Shard
from ckpt_engine.sources.export_plan import ExportEntry, emit_entry, plan_export
from ckpt_engine.sources.fsdp2_shards import expert_part, own_rows, shard_owners
from ckpt_engine.sources.sharded import ShardedWeightSource
from ckpt_engine.sources.wire import DEFAULT_KEEP_FP32, WirePolicy, hf_config_of, torch_dtype

__all__ = ["MegatronFSDP2Source", "dbuffer_rows", "flat_rows"]

logger = logging.getLogger(__name__)


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


class MegatronFSDP2Source(ShardedWeightSource):
    """The weights of a Megatron-FSDP2-sharded HF causal LM, under HF checkpoint names.

    `units`: the modules `fully_shard` was called on (default: the root, then every submodule with
    `parameter_groups`); `process_group`: the ranks of its 1-D mesh; `dtype` / `keep_fp32` as for
    `FSDP2Source`. Every rank is a sender; `owners()` and `local_piece()` are local.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        process_group: dist.ProcessGroup,
        units: Sequence[nn.Module] | None = None,
        dtype: torch.dtype | str | None = None,
        keep_fp32: Sequence[str] = DEFAULT_KEEP_FP32,
    ) -> None:
        hf_config = hf_config_of(model, "MegatronFSDP2Source")
        self.model = model
        self.model_type: str = hf_config.model_type
        self.units: list[Any] = list(units) if units is not None else [
            model, *(m for m in model.modules() if m is not model and hasattr(m, "parameter_groups"))
        ]
        if not self.units or self.units[0] is not model:
            raise ValueError("MegatronFSDP2Source: units must start with the root model")
        self._device = next(model.parameters()).device
        self.group = self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.is_sender = self.rank == 0
        self.sender_index = self.rank  # many senders: every rank sends its own rows
        self.num_senders = self.world_size
        self._entries = plan_export(
            model, self.units[1:], model_type=self.model_type, wire=WirePolicy(dtype, keep_fp32), buffers=False, tied_head=False,
            who="Megatron-FSDP2",
        )
        self._locate_entries()
        self._pieces = {s.name: (i, k) for i, e in enumerate(self._entries) for k, s in enumerate(e.specs)}
        self._owners: dict[str, list[Shard]] | None = None
        self._rows: dict[int, list[int] | None] = {}

    def _locate_entries(self) -> None:
        """Map every entry to (parameter group, index in it): where its main weight lives."""
        where: dict[tuple[int, str], tuple[Any, int]] = {}
        for unit in self.units:
            for group in unit.parameter_groups:
                for i, fqn in enumerate(group.parameter_names):
                    owner_name, _, attr = fqn.rpartition(".")
                    owner = unit.get_submodule(owner_name) if owner_name else unit
                    where[(id(owner), attr)] = (group, i)
        missing = [e.name for e in self._entries if (id(e.module), e.attr) not in where]
        if missing:
            raise RuntimeError(f"Megatron-FSDP2 did not take ownership of {missing[0]} (and {len(missing) - 1} more)")
        self._where = [where[(id(e.module), e.attr)] for e in self._entries]

    @property
    def device(self) -> torch.device:
        return self._device

    def metadata(self) -> list[TensorSpec]:
        """HF checkpoint name, wire dtype and global shape of every exported tensor (local, no gather)."""
        return [s for e in self._entries for s in e.specs]

    # --- one sender: the gathering walk ------------------------------------------------------
    def finish_pending_gathers(self) -> int:
        """Finish every unit's outstanding all-gather and drop its gathered copy; returns how many.

        A prefetch no forward consumed keeps its gathered buffer, which Megatron-FSDP2 would reuse
        (stale after an optimizer step). Local: each rank waits on work it issued.
        """
        current = torch.cuda.current_stream(self._device)
        stale = 0
        for unit in self.units:
            event = unit._unshard_event
            if event is not None:
                current.wait_event(event)
                unit._reshard_parameter_groups()
                stale += 1
        if stale:
            logger.info("finished %d pending Megatron-FSDP2 all-gathers before export", stale)
        return stale

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors under HF names, one unit gather at a time (collective: every rank walks it to
        the same point). A yielded tensor aliases the unit's gather buffer until the next is requested."""
        self.finish_pending_gathers()
        units = self.units
        context = units[0].context
        current = torch.cuda.current_stream(self._device)
        context.allgather_stream.wait_stream(current)  # gathers read what the optimizer just wrote
        order = list(dict.fromkeys(e.unit for e in self._entries if e.unit != 0))
        upcoming = iter(order)
        gathered: list[int] = []
        with torch.no_grad():
            try:
                units[0]._unshard_parameter_groups()  # the root stays gathered for the whole walk
                gathered.append(0)
                current.wait_event(units[0]._unshard_event)
                first = next(upcoming, None)
                if first is not None:
                    units[first]._unshard_parameter_groups()
                    gathered.append(first)
                active: int | None = None
                for i, e in enumerate(self._entries):
                    if e.unit != 0 and e.unit != active:
                        if active is not None:
                            units[active]._reshard_parameter_groups()
                            gathered.remove(active)
                        active = e.unit
                        if active not in gathered:  # a unit visited twice (not HF order): gather again
                            units[active]._unshard_parameter_groups()
                            gathered.append(active)
                        following = next(upcoming, None)
                        if following is not None:
                            units[following]._unshard_parameter_groups()  # prefetch on the all-gather stream
                            gathered.append(following)
                        current.wait_event(units[active]._unshard_event)
                    yield from self._emit(i, e)
            finally:
                # Every rank issued the same gathers; releasing is local and ordered after the consumer.
                for u in gathered:
                    units[u]._reshard_parameter_groups()

    def _emit(self, i: int, e: ExportEntry) -> Iterator[tuple[str, torch.Tensor]]:
        t = getattr(e.module, e.attr)
        want = torch_dtype(e.specs[0].dtype)
        if t.is_floating_point() and t.element_size() < torch.empty((), dtype=want).element_size():
            t = self._main_full(i)  # e.g. a keep-fp32 router gate under bf16 compute: the main weight
        yield from emit_entry(self.model_type, e, t)

    def _main_full(self, i: int) -> torch.Tensor:
        """Entry i's full main (optimizer) weight: its group's main buffer gathered (collective)."""
        from megatron_fsdp.experimental import Replicate

        group, index = self._where[i]
        return group.main_weight.redistribute([Replicate()] * group.mesh.ndim).get_local_tensor(index)

    # --- many senders: this rank's own rows, no collective ------------------------------------
    @property
    def stable_pieces(self) -> bool:
        """Whether every piece is a view of a persistent buffer in its wire dtype (no cast)."""
        return all(torch_dtype(s.dtype) == e.dtype for e in self._entries for s in e.specs)

    def owners(self) -> OwnerMap:
        """Each rank's rows of the flat buffers (whole experts of a fused expert tensor), from the
        layouts alone; replicated tensors are left out (the planner assigns them)."""
        if self._owners is None:
            self._owners = shard_owners((e.specs, e.expert_outputs, self._rows_of(i)) for i, e in enumerate(self._entries))
        return self._owners

    def local_piece(self, name: str) -> torch.Tensor:
        """This rank's part of `name` in its wire dtype (its rows, one of its experts, or the whole
        tensor when replicated); no all-gather."""
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
