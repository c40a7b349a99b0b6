"""`FSDP2Source`: the weights of a model sharded with FSDP2 (`torch.distributed.fsdp.fully_shard`).

Built from the sharded model itself, with no training engine: a Hugging Face causal LM (or a PEFT
model over one) whose root and any submodules are `FSDPModule`s over one 1-D mesh.

One sender (`iter_weights`): every rank gathers one FSDP unit at a time (`unshard()`), the next
unit's all-gather issued before the current one is consumed, so gathering overlaps the packer;
only rank 0 of the mesh streams. Many senders: every rank sends its own DTensor shards
(`fsdp2_shards.py`: a dim-0 shard is a row range, a fused expert shard whole experts; buffers
and unsharded parameters are replicated), with no collective.

Collective contract: every rank of the mesh walks `iter_weights()` to its end, in step.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ckpt_engine.manifest import TensorSpec
from ckpt_engine.planning.ownership import OwnerMap, Shard
from ckpt_engine.sources.export_plan import ExportEntry, emit_entry, plan_export
from ckpt_engine.sources.fsdp2_adapters import AdapterExport
from ckpt_engine.sources.fsdp2_shards import dim0_rows, own_rows, shard_owners
from ckpt_engine.sources.sharded import ShardedWeightSource
from ckpt_engine.sources.wire import DEFAULT_KEEP_FP32, WirePolicy, hf_config_of, tied_embeddings, torch_dtype

__all__ = ["FSDP2Source", "check_exportable", "fsdp2_units"]


def fsdp2_units(model: nn.Module) -> list[nn.Module]:
    """The FSDP units of a model sharded with `fully_shard`: the root first, then every other
    `FSDPModule` inside it (pre-order). ValueError when the root is not sharded."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        raise ValueError(f"FSDP2Source takes a model sharded with fully_shard (its root an FSDPModule), got {type(model).__name__}")
    return [model, *(m for m in model.modules() if isinstance(m, FSDPModule) and m is not model)]


def _mesh_of(model: nn.Module) -> Any:
    """The device mesh the model's sharded parameters live on (one set of ranks for all of them)."""
    from torch.distributed.tensor import DTensor

    meshes = [p.device_mesh for p in model.parameters() if isinstance(p, DTensor)]
    layouts = {(m.device_type, tuple(m.mesh.shape), tuple(m.mesh.flatten().tolist())) for m in meshes}
    if len(layouts) != 1:
        raise ValueError(f"FSDP2Source needs the parameters sharded over one device mesh, found {len(layouts)}")
    return meshes[0]


def check_exportable(model: nn.Module, *, adapter: str | None = None) -> None:
    """Raise the ValueError `FSDP2Source` would raise for `model`'s layout (fused experts with no
    rule, clashing names, an adapter with no LoRA tensors), on the model before it is sharded: a
    training engine calls it before `fully_shard`, so a bad model fails before any collective."""
    hf_config = hf_config_of(model, "FSDP2Source")
    entries = plan_export(
        model, [], model_type=hf_config.model_type, wire=WirePolicy(None, ()), buffers=True,
        tied_head=tied_embeddings(hf_config), who="FSDP2",
    )
    if adapter is not None:
        AdapterExport(model, adapter).entries(entries)


class FSDP2Source(ShardedWeightSource):
    """The weights of an FSDP2-sharded HF causal LM, under HF checkpoint names.

    `process_group`: default, the group of the 1-D mesh its parameters live on (never the default
    group by assumption). `keep_fp32`: regexes of names that travel as float32 whatever `dtype` says
    (MoE router gates by default). `adapter`: export only this PEFT adapter's LoRA tensors and config.
    `prefetch`: issue unit k+1's all-gather before unit k is consumed.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        process_group: dist.ProcessGroup | None = None,
        dtype: torch.dtype | str | None = None,
        keep_fp32: Sequence[str] = DEFAULT_KEEP_FP32,
        adapter: str | None = None,
        prefetch: bool = True,
    ) -> None:
        self._units: list[nn.Module] = fsdp2_units(model)
        hf_config = hf_config_of(model, "FSDP2Source")
        self.model = model
        self.model_type: str = hf_config.model_type
        self.prefetch = prefetch
        mesh = _mesh_of(model)
        if mesh.ndim != 1:
            raise ValueError(f"FSDP2Source reads a model sharded over a 1-D mesh (plain FSDP), got a {mesh.ndim}-D mesh")
        group: dist.ProcessGroup = process_group if process_group is not None else mesh.get_group()
        if dist.get_world_size(group) != mesh.size():
            raise ValueError(f"process_group has {dist.get_world_size(group)} ranks, the model is sharded over {mesh.size()}")
        self.group = self.process_group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.is_sender = self.rank == 0
        self.sender_index = self.rank  # many senders: every rank sends its own shards
        self.num_senders = self.world_size
        self.wire = WirePolicy(dtype, keep_fp32)
        tied = tied_embeddings(hf_config)
        self._adapters = AdapterExport(model, adapter) if adapter is not None else None
        self._entries = plan_export(
            model, self._units[1:], model_type=self.model_type, wire=self.wire, buffers=True, tied_head=tied, who="FSDP2",
        )
        if self._adapters is not None:
            self._entries = self._adapters.entries(self._entries)
        self._pieces = {s.name: (e, i) for e in self._entries for i, s in enumerate(e.specs)}
        self._owners: dict[str, list[Shard]] | None = None
        self._rows: dict[int, list[int] | None] = {}  # id(entry) -> rows per rank (None: replicated)
        self._fsdp_params: dict[tuple[int, str], Any] | None = None
        self._sync_cache: dict[tuple[int, Any], torch.Tensor] = {}  # this walk's local tensors and casts
        self._walking = False  # between begin_pieces and end_pieces: the cache is used
        self._few_casts: bool | None = None

    @property
    def device(self) -> torch.device:
        """Where this rank's shards live (read at each call: a meta model is materialized later)."""
        p = next(self.model.parameters())
        return p.to_local().device if isinstance(p, torch.distributed.tensor.DTensor) else p.device

    def metadata(self) -> list[TensorSpec]:
        """HF name, wire dtype and global shape of every exported tensor (local, no gather)."""
        return [s for e in self._entries for s in e.specs]

    # --- one sender: the gathering walk ------------------------------------------------------
    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors under HF names, one unit all-gather at a time (collective: every rank walks it to
        the same point). A yielded tensor may alias the gather buffer until the next is requested."""
        from torch.distributed.fsdp import FSDPModule

        if self._adapters is not None:  # a few small tensors: gathered one by one, the base stays sharded
            yield from self._adapters.iter_weights(self._entries, self._master)
            return
        units = self._units
        order = list(dict.fromkeys(e.unit for e in self._entries if e.unit != 0))  # first-use order
        root = units[0]
        assert isinstance(root, FSDPModule)
        pending: dict[int, Any] = {}
        active: int | None = None
        with torch.no_grad():
            root.unshard()  # the root (embeddings, norm, head) stays gathered for the whole walk
            try:
                upcoming = iter(order)
                first = next(upcoming, None)
                if first is not None:
                    pending[first] = units[first].unshard(async_op=True)  # type: ignore[operator]
                for e in self._entries:
                    if e.unit != 0 and e.unit != active:
                        if active is not None:
                            units[active].reshard()  # type: ignore[operator]
                            active = None
                        handle = pending.pop(e.unit, None)
                        if handle is None:
                            handle = units[e.unit].unshard(async_op=True)  # type: ignore[operator]
                        active = e.unit
                        following = next(upcoming, None)
                        if following is not None and self.prefetch:
                            pending[following] = units[following].unshard(async_op=True)  # type: ignore[operator]
                        handle.wait()
                    yield from self._emit(e)
            finally:
                # Every rank issued the same all-gathers: waiting on them here is safe even when the
                # consumer stops early; resharding is local.
                for u, handle in pending.items():
                    handle.wait()
                    units[u].reshard()  # type: ignore[operator]
                if active is not None:
                    units[active].reshard()  # type: ignore[operator]
                root.reshard()

    def _emit(self, e: ExportEntry) -> Iterator[tuple[str, torch.Tensor]]:
        t = getattr(e.module, e.attr)
        if isinstance(t, torch.distributed.tensor.DTensor):  # not gathered (should not happen after unshard)
            t = t.full_tensor()
        want = torch_dtype(e.specs[0].dtype)
        if t.is_floating_point() and t.element_size() < torch.empty((), dtype=want).element_size():
            # Mixed precision gathered this param in a lower precision than the wire needs (e.g. a
            # keep-fp32 router gate under param_dtype=bf16): gather the master shard instead.
            t = self._master(e).full_tensor()
        yield from emit_entry(self.model_type, e, t)

    def _master(self, e: ExportEntry) -> Any:
        unit = self._units[e.unit]
        for group in self._param_groups([unit]):
            for fp in group.fsdp_params:
                if fp._module_info.module is e.module and fp._module_info.param_name == e.attr:
                    return fp.sharded_param
        raise RuntimeError(f"{e.name}: no FSDP parameter found for it")

    @staticmethod
    def _param_groups(units: list[nn.Module]) -> list[Any]:
        groups: list[Any] = []
        for unit in units:
            state = unit._get_fsdp_state()  # type: ignore[operator]
            # torch >= 2.13 keeps a list of param groups per state; torch 2.11 a single optional one.
            found = getattr(state, "_fsdp_param_groups", None)
            if found is None:
                single = getattr(state, "_fsdp_param_group", None)
                found = [single] if single is not None else []
            groups.extend(found)
        return groups

    # --- many senders: this rank's own shards, no collective -----------------------------------
    @property
    def stable_pieces(self) -> bool:
        """Whether every `local_piece` stays valid for a whole sync. Views of the shard are; casts are
        too when few bytes need one (kept until the next walk); a model whose every tensor needs a cast
        (fp32 masters, bf16 wire) is not: keeping its casts would hold a second copy of the shard."""
        return self._cast_few()

    def begin_pieces(self) -> None:
        """A walk starts: forget the last one's local tensors and refresh its casts in place (same
        memory every sync, so a transport's copy plan over them stays valid)."""
        casts = {k: v for k, v in self._sync_cache.items() if k[1] is not None}
        self._sync_cache.clear()
        self._walking = True
        if not casts:
            return
        by_id = {id(e): e for e in self._entries}
        with torch.no_grad():
            for (eid, want), cast in casts.items():
                e = by_id.get(eid)
                local = self._local_of(e) if e is not None else None
                if local is not None and local.shape == cast.shape and cast.dtype == want:
                    cast.copy_(local)
                    self._sync_cache[(eid, want)] = cast

    def piece_anchors(self) -> list[torch.Tensor]:
        """Inside a walk: the tensors every `local_piece` of this walk is a view of (each entry's
        local tensor, then the kept casts), for `PieceWalk.anchors`."""
        if not self._walking:
            raise RuntimeError("piece_anchors() is only valid inside a walk: call begin_pieces() first")
        out = [self._local_tensor(e) for e in self._entries]  # read every sync: ~1 us per parameter
        out += [t for k, t in self._sync_cache.items() if k[1] is not None]
        return out

    def _local_tensor(self, e: ExportEntry) -> torch.Tensor:
        """An entry's local tensor object itself (what a DTensor's `to_local()` views; a plain
        tensor as is), read without an autograd call."""
        t = self._sharded(e) if self._rows_of(e) is not None else getattr(e.module, e.attr)
        return t._local_tensor if isinstance(t, torch.distributed.tensor.DTensor) else t

    def end_pieces(self) -> None:
        """The walk is over: its casts stay alive (the transport may still read them), but a
        `local_piece` outside a walk never sees them (it may come after an optimizer step)."""
        self._walking = False

    def _cast_few(self) -> bool:
        """Whether the bytes this rank casts per sync are few: at most 1/32 of its shards' wire
        bytes (keeping them between syncs then costs little memory)."""
        if self._few_casts is None:
            cast = total = 0
            for e in self._entries:
                local = self._local_of(e, cache=False)
                for s in e.specs:
                    nbytes = local.numel() // max(1, len(e.specs)) * getattr(torch, s.dtype).itemsize
                    total += nbytes
                    cast += nbytes if getattr(torch, s.dtype) != local.dtype else 0
            self._few_casts = cast * 32 <= total
        return self._few_casts

    def _local_of(self, e: ExportEntry, cache: bool = True) -> torch.Tensor:
        """An entry's local tensor (its shard, or the whole replicated tensor), looked up once per sync:
        `DTensor.to_local` is an autograd call, and a fused expert tensor serves every expert."""
        key = (id(e), None)
        cache = cache and self._walking
        found = self._sync_cache.get(key) if cache else None
        if found is None:
            if self._rows_of(e) is None:
                found = getattr(e.module, e.attr)
                if isinstance(found, torch.distributed.tensor.DTensor):
                    found = found.to_local()  # replicated DTensor: every rank holds the whole tensor
            else:
                found = self._sharded(e).to_local()
            found = found.detach()
            if cache:
                self._sync_cache[key] = found
        return found

    def owners(self) -> OwnerMap:
        """Each rank's dim-0 rows (uneven, possibly none) and whole experts, computed locally; buffers
        and unsharded parameters are left out (replicated: the planner assigns them)."""
        if self._owners is None:
            self._owners = shard_owners((e.specs, e.expert_outputs, self._rows_of(e)) for e in self._entries)
        return self._owners

    def local_piece(self, name: str) -> torch.Tensor:
        """This rank's part of `name` in its wire dtype (a view of its shard or a cast, one of its
        experts, or the whole replicated tensor); no collective."""
        found = self._pieces.get(name)
        if found is None:
            raise ValueError(f"{name!r} is not a tensor this FSDP2 model exports (see metadata())")
        e, index = found
        spec = e.specs[index]
        want = getattr(torch, spec.dtype)
        rows = self._rows_of(e)
        t = self._local_of(e)
        with torch.no_grad():
            if t.dtype != want and self._walking and self._cast_few():  # cast the whole local tensor once per walk
                key = (id(e), want)
                cast = self._sync_cache.get(key)
                if cast is None:
                    cast = self._sync_cache[key] = t.to(want)
                t = cast
            if rows is not None:
                t = own_rows(name, t, rows, self.rank, index, e.expert_outputs)
            return t if t.dtype == want else t.to(want)

    def _rows_of(self, e: ExportEntry) -> list[int] | None:
        key = id(e)
        if key not in self._rows:
            self._rows[key] = None if e.is_buffer else dim0_rows(e.name, self._sharded(e), self.rank, self.world_size)
        return self._rows[key]

    def _sharded(self, e: ExportEntry) -> Any:
        """The parameter's sharded (master) form, whether or not the module is unsharded now."""
        if self._fsdp_params is None:
            self._fsdp_params = {}
            for group in self._param_groups(self._units):
                for fp in group.fsdp_params:
                    self._fsdp_params[(id(fp._module_info.module), fp._module_info.param_name)] = fp
        fp = self._fsdp_params.get((id(e.module), e.attr))
        return fp.sharded_param if fp is not None else getattr(e.module, e.attr)

