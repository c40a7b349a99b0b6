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
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from ckpt_engine.manifest import TensorSpec
from ckpt_engine.planning.ownership import Shard
from ckpt_engine.trainer_adapters.base import LossFn, TrainEngine
from ckpt_engine.trainer_adapters.common import DEFAULT_KEEP_FP32, TrainConfig, WirePolicy, adamw_with_schedule, check_float_dtype, clip_and_step, dtype_name, hf_config_of, resume_schedule, torch_dtype
from ckpt_engine.trainer_adapters.hf_names import (
    clean_name,
    has_unhandled_fused_experts,
    unfuse_expert_specs,
    unfuse_experts,
)
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


@dataclass
class _Entry:
    """One exported parameter or buffer: where it lives and what it becomes on the wire."""

    unit: int  # index into FSDP2TrainEngine._units
    module: nn.Module
    attr: str
    is_buffer: bool
    name: str  # HF name before expert unfusing
    shape: tuple[int, ...]
    dtype: torch.dtype  # master dtype
    specs: list[TensorSpec] = field(default_factory=list)  # what goes on the wire (1, or one per expert part)
    expert_outputs: int = 0  # fused experts: wire tensors per expert (0: not a fused expert)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The per-layer FSDP units of a HF causal LM: modules of its `_no_split_modules` classes."""
    classes = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in classes]
    if not layers:
        inner = getattr(model, "model", None)
        layers = list(getattr(inner, "layers", []) or [])
    if not layers:
        raise ValueError(
            f"cannot find the decoder layers of {type(model).__name__}: it declares no _no_split_modules "
            "and has no model.layers; FSDP2TrainEngine wraps Hugging Face causal LMs (Qwen2/Llama family)"
        )
    return layers


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
        self._entries = self._plan_export(model, layers)  # bad layouts fail here, before any collective
        if self._adapters is not None:
            self._entries = self._adapters.entries(self._entries, _Entry)

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

    def _plan_export(self, model: nn.Module, layers: list[nn.Module]) -> list[_Entry]:
        """Every tensor the rollout needs, in HF state-dict order, with its owning FSDP unit."""
        unit_of = {id(m): i + 1 for i, m in enumerate(layers)}
        entries: list[_Entry] = []
        seen: set[int] = set()

        def walk(module: nn.Module, prefix: str, unit: int) -> None:
            unit = unit_of.get(id(module), unit)
            for attr, p in module._parameters.items():
                if p is None or id(p) in seen:
                    continue  # tied weights: HF checkpoints hold the first name only
                seen.add(id(p))
                entries.append(_Entry(unit, module, attr, False, clean_name(prefix + attr), tuple(p.shape), p.dtype))
            for attr, b in module._buffers.items():
                if b is None or attr in module._non_persistent_buffers_set or id(b) in seen:
                    continue
                seen.add(id(b))
                entries.append(_Entry(unit, module, attr, True, clean_name(prefix + attr), tuple(b.shape), b.dtype))
            for child_name, child in module._modules.items():
                if child is not None:
                    walk(child, f"{prefix}{child_name}.", unit)

        walk(model, "", 0)
        if self.tie_word_embeddings:
            entries = [e for e in entries if e.name != "lm_head.weight"]
        unhandled = has_unhandled_fused_experts(self.model_type, [e.name for e in entries])
        if unhandled:
            raise ValueError(
                f"cannot export fused MoE experts of model_type {self.model_type!r} (e.g. {unhandled[0]}): "
                "add a FusedExpertRule for it in ckpt_engine/trainer_adapters/hf_names.py"
            )
        for e in entries:
            parts = unfuse_expert_specs(self.model_type, e.name, e.shape)
            pairs = parts if parts is not None else [(e.name, e.shape)]
            e.expert_outputs = len(parts) // e.shape[0] if parts is not None and e.shape[0] else 0
            e.specs = [TensorSpec(n, dtype_name(self.wire_dtype(n, e.dtype)), s) for n, s in pairs]
        names = [s.name for e in entries for s in e.specs]
        if len(set(names)) != len(names):
            raise ValueError(f"{type(model).__name__}: exported names are not unique after removing wrapper prefixes")
        return entries

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

    def _emit(self, e: _Entry) -> Iterator[tuple[str, torch.Tensor]]:
        t = getattr(e.module, e.attr)
        if isinstance(t, torch.distributed.tensor.DTensor):  # not gathered (should not happen after unshard)
            t = t.full_tensor()
        want = torch_dtype(e.specs[0].dtype)
        if t.is_floating_point() and t.element_size() < torch.empty((), dtype=want).element_size():
            # Mixed precision gathered this param in a lower precision than the wire needs (e.g. a
            # keep-fp32 router gate under param_dtype=bf16): gather the master shard instead.
            t = self._master(e).full_tensor()
        parts = unfuse_experts(self.model_type, e.name, t)
        if parts is None:
            yield e.specs[0].name, t if t.dtype == want else t.to(want)
            return
        for spec, (name, part) in zip(e.specs, parts):
            yield name, part if part.dtype == torch_dtype(spec.dtype) else part.to(torch_dtype(spec.dtype))

    def _master(self, e: _Entry) -> Any:
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
        local = loss.detach().float().reshape(1).clone()
        total = local.clone()
        dist.all_reduce(total, group=self.group)
        return {"loss": total.item() / self.world_size, "local_loss": local.item()}

    def grad_norm(self) -> float:
        """Global L2 norm of the gradients: fp64 sums of squares of the local shards, all-reduced."""
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        for p in self.model.parameters():
            if p.grad is not None:
                g = p.grad.to_local() if isinstance(p.grad, torch.distributed.tensor.DTensor) else p.grad
                if g.numel():
                    sq += torch.linalg.vector_norm(g, dtype=torch.float64).square()
        dist.all_reduce(sq, group=self.group)
        return math.sqrt(sq.item())

    def optimizer_step(self) -> float:
        """Clip (by the global norm), step AdamW, zero grads; returns the pre-clip global grad norm.

        A non-finite norm skips the update (grads are dropped) on every rank alike.
        """
        norm = self.grad_norm()
        grads = [
            p.grad.to_local() if isinstance(p.grad, torch.distributed.tensor.DTensor) else p.grad
            for p in self.model.parameters()
            if p.grad is not None
        ]
        if clip_and_step(self.optimizer, grads, norm, self.config.max_grad_norm, self.global_step):
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
