"""FSDP2 (`torch.distributed.fsdp.fully_shard`) training engine over a Hugging Face causal LM.

Each decoder layer is one FSDP unit, the root (embeddings, final norm, LM head) another. Training
is plain data parallelism over one explicit process group (or 1-D device mesh): every rank runs
`forward_backward` on its own micro-batch, FSDP2 averages the gradients with a reduce-scatter.

The engine's weights, as a sync reads them, are `self.source`: an `FSDP2Source` built from the
sharded model (`ckpt_engine.sources.fsdp2`), which gathers unit by unit for one sender or hands
out each rank's own shards for many. Collective contract: every rank of the group calls every
public method in the same order.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from ckpt_engine.sources.fsdp2 import FSDP2Source, check_exportable
from ckpt_engine.sources.wire import check_float_dtype, hf_config_of, torch_dtype
from ckpt_engine.trainer.engines.base import LossFn, TrainEngine
from ckpt_engine.trainer.engines.common import (
    TrainConfig, adamw_with_schedule, clip_and_step, decoder_layers, global_grad_norm, mean_loss, resume_schedule,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["FSDP2Config", "FSDP2TrainEngine"]

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


class FSDP2TrainEngine(TrainEngine):
    """Data-parallel FSDP2 training of a HF causal LM; `source` is its weights for the rollout.

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
        hf_config_of(model, "FSDP2TrainEngine")
        check_exportable(model, adapter=self.config.adapter if self.config.weights == "adapters" else None)  # before sharding
        device = torch.device(device) if device is not None else next(model.parameters()).device
        if device.type == "meta":
            raise ValueError("FSDP2TrainEngine(device=...) must name a real device when the model is on the meta device")
        self.device = device
        layers = decoder_layers(model)
        if mesh is None:
            assert process_group is not None
            mesh = DeviceMesh.from_group(process_group, device.type)
        if mesh.ndim != 1:
            raise ValueError(f"FSDP2TrainEngine shards over a 1-D mesh (plain FSDP), got a {mesh.ndim}-D mesh")
        self.mesh = mesh
        self.group: dist.ProcessGroup = mesh.get_group()
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)

        mp = MixedPrecisionPolicy(
            param_dtype=torch_dtype(self.config.param_dtype) if self.config.param_dtype else None,
            reduce_dtype=torch_dtype(self.config.reduce_dtype) if self.config.reduce_dtype else None,
        )
        for layer in layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=self.config.reshard_after_forward)
        fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=self.config.reshard_after_forward)
        self.model = model
        self.source = FSDP2Source(
            model, process_group=self.group, dtype=self.config.wire_dtype, keep_fp32=self.config.keep_fp32_patterns,
            adapter=self.config.adapter if self.config.weights == "adapters" else None, prefetch=self.config.prefetch_export,
        )
        self.optimizer, self.scheduler = adamw_with_schedule(model, self.config)
        self.global_step = 0
        logger.info(
            "FSDP2 engine: %s, %d units over %d ranks, %d exported tensors",
            self.source.model_type, len(layers) + 1, self.world_size, len(self.source.metadata()),
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
