"""`FSDP2ShardedSource`: the `ShardedWeightSource` that `FSDP2TrainEngine` extends: every rank sends its own shards.

The engine sets `_entries` (export plan: module, attribute, HF specs, expert outputs), `_pieces`
(name -> entry and index), `_units`, `rank` and `world_size`, and the caches below; `owners()`
and `local_piece()` are local: no collective of any kind. A dim-0 shard is a row range of the HF
tensor; a fused expert shard holds whole experts; buffers and unsharded parameters are replicated.
"""

from __future__ import annotations

from typing import Any

import torch

from ckpt_engine.planning.ownership import OwnerMap, Shard
from ckpt_engine.sources.sharded import ShardedWeightSource
from ckpt_engine.trainer_adapters.export_plan import ExportEntry
from ckpt_engine.trainer_adapters.fsdp2_shards import dim0_rows, own_rows, shard_owners

__all__ = ["FSDP2ShardedSource"]


class FSDP2ShardedSource(ShardedWeightSource):
    """The sharded source FSDP2TrainEngine extends."""

    _entries: list[ExportEntry]
    _pieces: dict[str, tuple[ExportEntry, int]]
    _owners: dict[str, list[Shard]] | None
    _rows: dict[int, list[int] | None]
    _fsdp_params: dict[tuple[int, str], Any] | None
    _sync_cache: dict[tuple[int, Any], torch.Tensor]
    _walking: bool
    _few_casts: bool | None
    _units: list[Any]
    _param_groups: Any  # the engine's static lookup of FSDP2 parameter groups per unit
    rank: int
    world_size: int

    @property
    def stable_pieces(self) -> bool:
        """Whether every `local_piece` stays valid and unchanged for a whole sync: the transport
        may then send from it without a copy, and pack a bucket's pieces in one batched copy. A
        view of the shard is; a piece cast to its wire dtype is too when few bytes need a cast
        (e.g. a bf16 model whose router is kept fp32): those casts are made once per sync and
        kept until the next one begins. A model whose every tensor needs a cast (fp32 masters
        with a bf16 wire) is not stable: keeping its casts would hold a second copy of the shard.
        (Not `stable_tensors`: that flag describes `iter_weights`, whose tensors are not stable.)"""
        return self._cast_few()

    def begin_pieces(self) -> None:
        """A sync's walk of its pieces starts (called by `iter_pieces`): forget the last one's
        local tensors, and bring its casts up to date in place (same memory every sync, so a
        transport's copy plan that reads them stays valid; a cast whose local tensor changed
        shape or dtype is dropped and made anew when asked for)."""
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
        """The walk is over: its casts stay alive (the transport may still read them) until the
        next walk begins, but a `local_piece` outside a walk never sees them (it may come after an
        optimizer step)."""
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
        """The rank's local tensor of an entry (its shard, or the whole replicated tensor), looked
        up once per sync: `DTensor.to_local` is an autograd call, and a fused expert tensor serves
        every expert."""
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
        """Which byte range of every exported tensor each trainer rank holds; the same map on every
        rank, computed locally (no collective). Dim-0 FSDP2 shards are row ranges (uneven splits
        and ranks with no rows included); a fused expert's per-expert tensors are owned whole by
        the rank holding that expert; buffers and unsharded parameters are left out (replicated:
        the planner gives each to one rank). A tied embedding is one tensor, with one set of owners."""
        if self._owners is None:
            self._owners = shard_owners((e.specs, e.expert_outputs, self._rows_of(e)) for e in self._entries)
        return self._owners

    def local_piece(self, name: str) -> torch.Tensor:
        """This rank's part of `name` in its wire dtype: its rows of a sharded tensor (a view of the
        local DTensor shard, or its cast), one of its own experts, or the whole replicated tensor.
        Local only: no all-gather, no collective. Only ranks `owners()` (or the plan, for replicated
        tensors) names may ask for a tensor."""
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

