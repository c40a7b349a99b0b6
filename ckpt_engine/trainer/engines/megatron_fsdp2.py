"""Megatron-FSDP2 training engine: a Hugging Face causal LM sharded by Megatron's per-module `fully_shard`.

Megatron-FSDP2 (`megatron_fsdp.experimental.fully_shard(module, mesh, placements,
mixed_precision_policy)`, megatron-fsdp >= 0.6.1) shards each module's parameters into flat
per-dtype buffers (`DBuffer`): main (optimizer) weights, model (compute) weights and main grads,
laid out row-aligned with uneven per-rank ranges. It all-gathers a module on a dedicated stream
before its forward/backward, prefetches the next module in static forward/backward order,
reduce-scatters gradients asynchronously on a second stream, and (through
`fully_shard_optimizer`) copies the updated main weights back into the model-weight buffers after
`optimizer.step()`.

Units: one per decoder layer, the root (embeddings, final norm, LM head) one more, sharded
bottom-up as the API requires. Placements are plain FSDP over a 1-D mesh (parameters, gradients
and optimizer state all `Flat`: the one layout megatron-fsdp 0.6.1 runs on a single mesh axis).
The engine's weights, as a sync reads them, are `self.source`: a `MegatronFSDP2Source`
(`ckpt_engine.sources.megatron_fsdp2`). The sharded parameters' local pieces are DBuffer ranges,
not DTensor's `Shard(0)` chunks, so DCP would misplace their rows: checkpoints hold each rank's
buffers (same world size to load).

Needs CUDA (Megatron-FSDP2 schedules on CUDA streams). Importing this module never fails;
construction without CUDA or without megatron-fsdp raises a RuntimeError naming what is missing.
Collective contract: every rank of the mesh calls every public method in the same order.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn

from ckpt_engine.sources.megatron_fsdp2 import MegatronFSDP2Source
from ckpt_engine.sources.wire import check_float_dtype, hf_config_of, tied_embeddings, torch_dtype
from ckpt_engine.trainer.engines.base import LossFn, TrainEngine
from ckpt_engine.trainer.engines.common import TrainConfig, clip_and_step, decoder_layers, global_grad_norm, mean_loss, resume_schedule

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

__all__ = ["MegatronFSDP2Config", "MegatronFSDP2TrainEngine", "megatron_fsdp2_available"]

logger = logging.getLogger(__name__)

try:  # import guard: CPU CI imports this module without CUDA and usually without megatron-fsdp
    from megatron_fsdp.experimental import fully_shard as _probe  # noqa: F401

    _IMPORT_ERROR: str | None = None
except Exception as exc:  # ImportError, or a clash with an installed megatron-core
    _IMPORT_ERROR = f"{type(exc).__name__}: {exc}"


def megatron_fsdp2_available() -> tuple[bool, str]:
    """(usable here, why not): `megatron_fsdp.experimental` importable and CUDA present."""
    if _IMPORT_ERROR is not None:
        return False, (
            f"Megatron-FSDP2 cannot be imported ({_IMPORT_ERROR}); install megatron-fsdp>=0.6.1 "
            "(its megatron_fsdp.experimental.fully_shard)"
        )
    if not torch.cuda.is_available():
        return False, "Megatron-FSDP2 needs CUDA GPUs (it gathers and reduces on CUDA streams)"
    return True, ""


@dataclass(kw_only=True)
class MegatronFSDP2Config(TrainConfig):
    """Optimizer, schedule and export settings (`TrainConfig`) plus Megatron-FSDP2 precision."""

    param_dtype: str | None = None
    """Compute (model-weight) dtype: the model is cast to it before sharding (None: as given)."""
    main_params_dtype: str | None = "float32"
    """Optimizer (main) weights; None: the compute weights are the main weights."""
    main_grads_dtype: str | None = None
    """dtype the reduced gradients are kept in (None: the compute dtype)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for fname in ("param_dtype", "main_params_dtype", "main_grads_dtype"):
            check_float_dtype(f"{type(self).__name__}.{fname}", getattr(self, fname))


class MegatronFSDP2TrainEngine(TrainEngine):
    """Data-parallel Megatron-FSDP2 training of a HF causal LM; `source` is its weights for the rollout.

    `model`: an unsharded `transformers` causal LM with identical weights on every rank, on this
    rank's CUDA device. Exactly one of `process_group` and `mesh` (1-D) says which ranks shard it.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        config: MegatronFSDP2Config | None = None,
        process_group: dist.ProcessGroup | None = None,
        mesh: DeviceMesh | None = None,
    ) -> None:
        self.config = config if config is not None else MegatronFSDP2Config()
        if not isinstance(self.config, MegatronFSDP2Config):
            raise ValueError(f"MegatronFSDP2TrainEngine takes a MegatronFSDP2Config, got {type(self.config).__name__}")
        if (process_group is None) == (mesh is None):
            raise ValueError("MegatronFSDP2TrainEngine needs exactly one of process_group or mesh (the default group is never assumed)")
        hf_config = hf_config_of(model, "MegatronFSDP2TrainEngine")
        if tied_embeddings(hf_config):
            raise ValueError(
                "MegatronFSDP2TrainEngine cannot shard tied embeddings: megatron-fsdp 0.6.1's experimental fully_shard "
                "gives each name of a shared parameter its own shard (set tie_word_embeddings=False or use trainer.backend=fsdp2)"
            )
        ok, why = megatron_fsdp2_available()
        if not ok:
            raise RuntimeError(why)
        from megatron_fsdp import MixedPrecisionPolicy
        from megatron_fsdp.experimental import Flat, Placements, fully_shard, fully_shard_optimizer
        from torch.distributed.device_mesh import DeviceMesh

        device = next(model.parameters()).device
        if device.type != "cuda":
            raise ValueError(f"MegatronFSDP2TrainEngine needs the model on this rank's CUDA device, got {device}")
        self.device = device
        cfg = self.config
        if cfg.param_dtype is not None:
            model.to(torch_dtype(cfg.param_dtype))
        layers = decoder_layers(model)

        if mesh is None:
            assert process_group is not None
            mesh = DeviceMesh.from_group(process_group, "cuda")
        if mesh.ndim != 1:
            raise ValueError(f"MegatronFSDP2TrainEngine shards over a 1-D mesh (plain FSDP), got a {mesh.ndim}-D mesh")
        self.mesh = mesh
        self.group: dist.ProcessGroup = mesh.get_group()
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)

        placements = Placements(dp_axes=[0], parameter=[Flat()], gradient=[Flat()], optimizer=[Flat()])
        policy = MixedPrecisionPolicy(
            main_params_dtype=torch_dtype(cfg.main_params_dtype) if cfg.main_params_dtype else None,
            main_grads_dtype=torch_dtype(cfg.main_grads_dtype) if cfg.main_grads_dtype else None,
        )
        for layer in layers:  # bottom-up: a parent's fully_shard skips parameters its children own
            fully_shard(layer, mesh, placements, policy)
        fully_shard(model, mesh, placements, policy)
        fsdp_model: Any = model  # megatron-fsdp's fully_shard module (not read by the type checker)
        fsdp_model._lazy_init_context()  # share one context (streams, prefetch orders) now, so export may precede forward
        self.model = model
        self.source: MegatronFSDP2Source = MegatronFSDP2Source(
            model, process_group=self.group, units=[model, *layers], dtype=cfg.wire_dtype, keep_fp32=cfg.keep_fp32_patterns,
        )
        self.optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
        )
        fully_shard_optimizer(self.optimizer)  # grads cast around step; main -> model weights after it (before the schedule wraps step)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, cfg.lr_factor)
        self.global_step = 0
        logger.info(
            "Megatron-FSDP2 engine: %s, %d units over %d ranks, %d exported tensors",
            self.source.model_type, len(self.source.units), self.world_size, len(self.source.metadata()),
        )

    # --- training ------------------------------------------------------------------------------
    def forward_backward(self, batch: dict[str, torch.Tensor], loss_fn: LossFn) -> dict[str, float]:
        """Forward and backward on this rank's micro-batch; collective (gathers, reduce-scatters).

        Returns this rank's loss and the mean over the mesh ('loss'). Gradients accumulate over
        calls until `optimizer_step()`; Megatron-FSDP2 averages them over ranks.
        """
        self.source.finish_pending_gathers()
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
        # A tuple output: Megatron-FSDP2's root pre-backward is a module full-backward hook, which
        # finds tensors at the top level of the output only (not inside a ModelOutput).
        logits = self.model(**inputs, use_cache=False, return_dict=False)[0]
        loss = loss_fn(logits, batch)
        loss.backward()
        return mean_loss(loss, self.group, self.world_size)

    def _local_grads(self) -> list[torch.Tensor]:
        return [cast("DTensor", p.grad).to_local() for p in self.model.parameters() if p.grad is not None]  # fully_shard's grads are DTensors

    def grad_norm(self) -> float:
        """Global L2 norm: every gradient element lives in exactly one rank's range; fp64, all-reduced."""
        return global_grad_norm(self._local_grads(), self.group, self.device)

    def optimizer_step(self) -> float:
        """Clip (global norm), AdamW on the main weights, copy them into the compute weights, zero grads.

        Returns the pre-clip global grad norm; a non-finite norm skips the update on every rank.
        """
        torch.cuda.current_stream(self.device).wait_stream(self.source.units[0].context.reduce_scatter_stream)
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
    def _groups(self) -> list[Any]:
        return [g for unit in self.source.units for g in unit.parameter_groups]

    def _ckpt_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's main-weight buffers and AdamW moments, keyed by group / parameter index."""
        out: dict[str, torch.Tensor] = {}
        for gi, group in enumerate(self._groups()):
            out[f"g{gi}.main"] = group.main_weight.local_buffer
            for pi, p in enumerate(group.sharded_parameters):
                for key, value in self.optimizer.state.get(p, {}).items():
                    if isinstance(value, torch.Tensor):
                        out[f"g{gi}.p{pi}.{key}"] = value.to_local() if hasattr(value, "to_local") else value
        return out

    def save_checkpoint(self, path: str) -> None:
        """Every rank writes its own shard file (safetensors): main weights, AdamW state, steps.

        Same world size to load (the buffers' ranges depend on it). Every rank calls it.
        """
        from safetensors.torch import save_file

        os.makedirs(path, exist_ok=True)
        tensors = {k: v.detach().contiguous() for k, v in self._ckpt_tensors().items()}
        meta = {"world_size": str(self.world_size), "global_step": str(self.global_step), "scheduler_step": str(self.scheduler.last_epoch)}
        save_file(tensors, os.path.join(path, f"megatron_fsdp2_rank{self.rank:05d}.safetensors"), metadata=meta)
        dist.barrier(group=self.group)
        logger.info("saved Megatron-FSDP2 checkpoint at step %d to %s", self.global_step, path)

    def load_checkpoint(self, path: str) -> None:
        """Load what `save_checkpoint` wrote with the same world size; every rank calls it."""
        from safetensors import safe_open

        file = os.path.join(path, f"megatron_fsdp2_rank{self.rank:05d}.safetensors")
        if not os.path.exists(file):
            raise ValueError(f"no Megatron-FSDP2 checkpoint for rank {self.rank} at {path}")
        self.source.finish_pending_gathers()
        with safe_open(file, framework="pt", device=str(self.device)) as f:
            meta = f.metadata()
            if int(meta["world_size"]) != self.world_size:
                raise ValueError(f"checkpoint {path} was saved by {meta['world_size']} ranks, this mesh has {self.world_size}")
            keys = set(f.keys())
            with torch.no_grad():
                for gi, group in enumerate(self._groups()):
                    group.main_weight.local_buffer.copy_(f.get_tensor(f"g{gi}.main"))
                    for pi, p in enumerate(group.sharded_parameters):
                        state = self._fresh_adam_state(p) if p not in self.optimizer.state else self.optimizer.state[p]
                        for key, value in state.items():
                            k = f"g{gi}.p{pi}.{key}"
                            if k not in keys:
                                raise ValueError(f"checkpoint {path} lacks {k}")
                            local = value.to_local() if hasattr(value, "to_local") else value
                            local.copy_(f.get_tensor(k))
                        self.optimizer.state[p] = state
                    group.sync_model_weight_from_main_weight()
        self.global_step = int(meta["global_step"])
        resume_schedule(self.optimizer, self.scheduler, self.config, int(meta["scheduler_step"]))
        dist.barrier(group=self.group)
        logger.info("loaded Megatron-FSDP2 checkpoint from %s at step %d", path, self.global_step)

    @staticmethod
    def _fresh_adam_state(p: torch.Tensor) -> dict[str, torch.Tensor]:
        """AdamW's per-parameter state as torch creates it on the first step (non-capturable)."""
        return {
            "step": torch.tensor(0.0, dtype=torch.float32),
            "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
        }
