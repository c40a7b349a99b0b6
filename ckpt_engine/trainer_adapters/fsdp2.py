"""FSDP2 (`torch.distributed.fsdp.fully_shard`) training engine over a Hugging Face causal LM.

Each decoder layer is one FSDP unit, the root (embeddings, final norm, LM head) another. Training
is plain data parallelism over one explicit process group (or 1-D device mesh): every rank runs
`forward_backward` on its own micro-batch, FSDP2 averages the gradients with a reduce-scatter.

Export (`iter_weights`) gathers a whole FSDP unit with one all-gather (`unshard()`), yields its
parameters under their Hugging Face checkpoint names, then reshards; the next unit's all-gather
is issued before the current one is consumed, so gathering overlaps the consumer (the bucket
packer). Collective contract: every rank of the group calls every public method in the same
order; only rank 0 (`is_sender`) streams what `iter_weights` yields.

With many senders (`ckpt_engine.sources.sharded.ShardedWeightSource`) every rank sends its own
shards instead: `owners()` says which rows of each tensor each rank holds (from the DTensor
sharding, no collective) and `local_piece(name)` hands out this rank's rows; nothing is gathered
(`fsdp2_source.py`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from ckpt_engine.manifest import TensorSpec
from ckpt_engine.planning.ownership import Shard
from ckpt_engine.trainer_adapters.base import LossFn, TrainEngine
from ckpt_engine.trainer_adapters.common import (
    DEFAULT_KEEP_FP32, TrainConfig, WirePolicy, adamw_with_schedule, check_float_dtype, clip_and_step, global_grad_norm, hf_config_of,
    mean_loss, resume_schedule, torch_dtype,
)
from ckpt_engine.trainer_adapters.export_plan import ExportEntry, decoder_layers, emit_entry, plan_export
from ckpt_engine.trainer_adapters.fsdp2_source import FSDP2ShardedSource
from ckpt_engine.trainer_adapters.fsdp2_adapters import AdapterExport

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["FSDP2Config", "FSDP2TrainEngine", "DEFAULT_KEEP_FP32"]

logger = logging.getLogger(__name__)

@dataclass(kw_only=True)
class FSDP2Config(TrainConfig):
    """Optimizer, schedule and export settings (`TrainConfig`) plus FSDP2 sharding settings."""

    param_dtype: str | None = None
    """FSDP2 mixed precision: dtype of the all-gathered params used in forward (None: master dtype)."""
    reduce_dtype: str | None = None
    """FSDP2 mixed precision: dtype of the gradient reduce-scatter (None: param_dtype)."""
    reshard_after_forward: bool = True
    prefetch_export: bool = True
    """In `iter_weights`, issue unit k+1's all-gather before unit k is consumed."""
    weights: str = "full"
    """What a sync exports: "full" (every tensor the rollout needs) or "adapters" (only the PEFT
    LoRA adapter `adapter` of a `peft.PeftModel`, in PEFT's saved layout: `lora_format.py`)."""
    adapter: str = "default"
    """The PEFT adapter a `weights="adapters"` sync exports."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.weights not in ("full", "adapters"):
            raise ValueError(f"{type(self).__name__}.weights must be 'full' or 'adapters', got {self.weights!r}")
        for fname in ("param_dtype", "reduce_dtype"):
            check_float_dtype(f"{type(self).__name__}.{fname}", getattr(self, fname))


class FSDP2TrainEngine(FSDP2ShardedSource, TrainEngine):
    """Data-parallel FSDP2 training of a HF causal LM, and its weight source for the rollout.

    `model` must be an unsharded `transformers` causal LM with identical initial weights on every
    rank (same seed or loaded from the same checkpoint), already on `device`. Exactly one of
    `process_group` and `mesh` says which ranks shard it; the default group is never assumed.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        config: FSDP2Config | None = None,
        process_group: dist.ProcessGroup | None = None,
        mesh: DeviceMesh | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        """`device`: where the sharded model lives (default: the model's device). A model built on
        the meta device is sharded as is; call `materialize()` before training or exporting."""
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        self.config = config if config is not None else FSDP2Config()
        if (process_group is None) == (mesh is None):
            raise ValueError("FSDP2TrainEngine needs exactly one of process_group or mesh (the default group is never assumed)")
        hf_config = hf_config_of(model, "FSDP2TrainEngine")
        self.model_type: str = hf_config.model_type
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        device = torch.device(device) if device is not None else next(model.parameters()).device
        if device.type == "meta":
            raise ValueError("FSDP2TrainEngine(device=...) must name a real device when the model is on the meta device")
        self.device = device
        self._wire = WirePolicy(self.config.wire_dtype, self.config.keep_fp32_patterns)
        layers = decoder_layers(model)
        self._adapters = AdapterExport(model, self.config.adapter) if self.config.weights == "adapters" else None
        self._entries = plan_export(  # bad layouts fail here, before any collective
            model, layers, model_type=self.model_type, wire=self._wire, buffers=True, tied_head=self.tie_word_embeddings, who="FSDP2",
        )
        if self._adapters is not None:
            self._entries = self._adapters.entries(self._entries)

        if mesh is None:
            assert process_group is not None
            mesh = DeviceMesh.from_group(process_group, device.type)
        if mesh.ndim != 1:
            raise ValueError(f"FSDP2TrainEngine shards over a 1-D mesh (plain FSDP), got a {mesh.ndim}-D mesh")
        self.mesh = mesh
        self.group: dist.ProcessGroup = mesh.get_group()
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.is_sender = self.rank == 0
        self.sender_index = self.rank  # multi-sender sync: every trainer rank sends its shards
        self.num_senders = self.world_size
        self._pieces = {s.name: (e, i) for e in self._entries for i, s in enumerate(e.specs)}
        self._owners: dict[str, list[Shard]] | None = None
        self._rows: dict[int, list[int] | None] = {}  # id(entry) -> rows per rank (None: replicated)
        self._fsdp_params: dict[tuple[int, str], Any] | None = None
        self._sync_cache: dict[tuple[int, Any], torch.Tensor] = {}  # this walk's local tensors and casts
        self._walking = False  # between begin_pieces and end_pieces: the cache is used
        self._few_casts: bool | None = None

        mp = MixedPrecisionPolicy(
            param_dtype=torch_dtype(self.config.param_dtype) if self.config.param_dtype else None,
            reduce_dtype=torch_dtype(self.config.reduce_dtype) if self.config.reduce_dtype else None,
        )
        for layer in layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=self.config.reshard_after_forward)
        fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=self.config.reshard_after_forward)
        self.model = model
        self._units: list[nn.Module] = [model, *layers]
        self.optimizer, self.scheduler = adamw_with_schedule(model, self.config)
        self.global_step = 0
        logger.info(
            "FSDP2 engine: %s, %d units over %d ranks, %d exported tensors",
            self.model_type, len(self._units), self.world_size, sum(len(e.specs) for e in self._entries),
        )

    def materialize(self, init: Any = None) -> None:
        """Allocate a meta-device model's shards on `device` and initialize them (local, no collective).

        `init(name, local_shard)` fills each parameter's local shard in place (default: normal(0, 0.02),
        norms 1); buffers are recomputed by the modules' own `reset_parameters`/rotary init only if
        they define one, so use this for shapes-only work (benchmarks) or load a checkpoint after it.
        """
        self.model.to_empty(device=self.device)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                local = p.to_local() if isinstance(p, torch.distributed.tensor.DTensor) else p
                if init is not None:
                    init(name, local)
                elif "norm" in name:
                    local.fill_(1.0)
                else:
                    local.normal_(0.0, 0.02)

    # --- export plan ---------------------------------------------------------------------------
    def wire_dtype(self, name: str, dtype: torch.dtype) -> torch.dtype:
        """The dtype `name` travels in: keep-fp32 policy first, then `wire_dtype` for floats."""
        return self._wire.dtype_for(name, dtype)

    def metadata(self) -> list[TensorSpec]:
        """HF checkpoint name, wire dtype and global shape of every exported tensor (local, no gather)."""
        return [s for e in self._entries for s in e.specs]

    # --- export --------------------------------------------------------------------------------
    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors under HF names, one unit all-gather at a time; every rank of the group walks it.

        A yielded tensor may alias the unit's all-gather buffer: it is valid until the next item is
        requested (clone it to keep it). Every rank must walk the same distance (normally to the end):
        the walk issues collectives.
        """
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
                    pending[first] = units[first].unshard(async_op=True)
                for e in self._entries:
                    if e.unit != 0 and e.unit != active:
                        if active is not None:
                            units[active].reshard()
                            active = None
                        handle = pending.pop(e.unit, None)
                        if handle is None:
                            handle = units[e.unit].unshard(async_op=True)
                        active = e.unit
                        if self.config.prefetch_export:
                            following = next(upcoming, None)
                            if following is not None:
                                pending[following] = units[following].unshard(async_op=True)
                        else:
                            next(upcoming, None)
                        handle.wait()
                    yield from self._emit(e)
            finally:
                # Every rank issued the same all-gathers: waiting on them here is safe even when the
                # consumer stops early; resharding is local.
                for u, handle in pending.items():
                    handle.wait()
                    units[u].reshard()
                if active is not None:
                    units[active].reshard()
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
        from torch.distributed.fsdp import FSDPModule

        unit = self._units[e.unit]
        assert isinstance(unit, FSDPModule)
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

    # --- training ------------------------------------------------------------------------------
    def forward_backward(self, batch: dict[str, torch.Tensor], loss_fn: LossFn) -> dict[str, float]:
        """Forward and backward on this rank's micro-batch; collective (FSDP2 gathers and reduces).

        Returns this rank's loss and the mean over the group ('loss'). Gradients accumulate over
        calls until `optimizer_step()`; FSDP2 averages them over ranks.
        """
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
        logits = self.model(**inputs, use_cache=False).logits
        loss = loss_fn(logits, batch)
        loss.backward()
        return mean_loss(loss, self.group, self.world_size)

    def grad_norm(self) -> float:
        """Global L2 norm of the gradients: fp64 sums of squares of the local shards, all-reduced."""
        return global_grad_norm(self._local_grads(), self.group, self.device)

    def _local_grads(self) -> list[torch.Tensor]:
        return [
            p.grad.to_local() if isinstance(p.grad, torch.distributed.tensor.DTensor) else p.grad
            for p in self.model.parameters()
            if p.grad is not None
        ]

    def optimizer_step(self) -> float:
        """Clip (by the global norm), step AdamW, zero grads; returns the pre-clip global grad norm.

        A non-finite norm skips the update (grads are dropped) on every rank alike.
        """
        norm = self.grad_norm()
        if clip_and_step(self.optimizer, self._local_grads(), norm, self.config.max_grad_norm, self.global_step):
            self.global_step += 1
        return norm

    def lr_scheduler_step(self) -> None:
        self.scheduler.step()

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def train_mode(self) -> None:
        self.model.train()

    def eval_mode(self) -> None:
        self.model.eval()

    # --- checkpoint ----------------------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        trainer = {
            "global_step": torch.tensor(self.global_step, dtype=torch.int64),
            "scheduler_step": torch.tensor(self.scheduler.last_epoch, dtype=torch.int64),
        }
        return {"model": model_sd, "optimizer": optim_sd, "trainer": trainer}

    def save_checkpoint(self, path: str) -> None:
        """Sharded DCP checkpoint of model, optimizer, step and schedule; every rank calls it."""
        import torch.distributed.checkpoint as dcp

        dcp.save(self._state(), checkpoint_id=path, process_group=self.group)
        logger.info("saved FSDP2 checkpoint at step %d to %s", self.global_step, path)

    def load_checkpoint(self, path: str) -> None:
        """Load what `save_checkpoint` wrote (any world size DCP can reshard to); every rank calls it."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = self._state()
        dcp.load(state, checkpoint_id=path, process_group=self.group)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        self.global_step = int(state["trainer"]["global_step"])
        resume_schedule(self.optimizer, self.scheduler, self.config, int(state["trainer"]["scheduler_step"]))
        logger.info("loaded FSDP2 checkpoint from %s at step %d", path, self.global_step)
