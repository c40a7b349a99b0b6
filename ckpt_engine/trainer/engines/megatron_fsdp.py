"""Megatron-FSDP training engine: megatron-core GPTModel sharded by Megatron's own FSDP.

Uses megatron-core's adapter (`megatron.core.distributed.fsdp.mcore_fsdp_adapter`
`FullyShardedDataParallel`, backed by the bundled or stand-alone `megatron_fsdp` package) with the
sharding strategies `no_shard | optim | optim_grads | optim_grads_params`, and Megatron's
distributed optimizer. Its weights, as a sync reads them, are `self.source`: a
`MegatronFSDPSource` (`ckpt_engine.sources.megatron_fsdp`), which finishes every chunk's
parameter gathers and gathers uneven DP shards before the Megatron export walk.

Needs CUDA (megatron-fsdp allocates its buffers on the current CUDA device). The import of this
module never fails: constructing the engine without CUDA or without megatron-fsdp raises a
RuntimeError that says which is missing. Collective contract as in `megatron.py`.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ckpt_engine.sources.megatron_export import MegatronExporter, check_exportable
from ckpt_engine.trainer.engines.megatron_load import load_hf
from ckpt_engine.sources.megatron_fsdp import SHARDING_STRATEGIES, MegatronFSDPSource, megatron_fsdp_available
from ckpt_engine.sources.megatron_groups import MegatronGroups
from ckpt_engine.sources.wire import WirePolicy
from ckpt_engine.trainer.engines.megatron import MegatronConfig, MegatronTrainEngine, build_gpt_model, megatron_adam

__all__ = ["MegatronFSDPConfig", "MegatronFSDPTrainEngine"]

logger = logging.getLogger(__name__)

@dataclass(kw_only=True)
class MegatronFSDPConfig(MegatronConfig):
    """`MegatronConfig` plus the Megatron-FSDP sharding settings."""

    sharding_strategy: str = "optim_grads_params"
    """What FSDP shards over the data-parallel group: no_shard | optim | optim_grads | optim_grads_params."""
    overlap_param_gather: bool = True
    overlap_grad_reduce: bool = True
    use_cpu_initialization: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sharding_strategy not in SHARDING_STRATEGIES:
            raise ValueError(
                f"MegatronFSDPConfig.sharding_strategy must be one of {', '.join(SHARDING_STRATEGIES)}, got {self.sharding_strategy!r}"
            )


class MegatronFSDPTrainEngine(MegatronTrainEngine):
    """Megatron-core GPT under Megatron-FSDP (+ TP/PP), Megatron's distributed optimizer, HF export."""

    def __init__(
        self,
        hf_config: Any,
        *,
        config: MegatronFSDPConfig | None = None,
        model_chunks: list[nn.Module] | None = None,
        pg_collection: Any = None,
        initial_hf_weights: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """`initial_hf_weights` (full HF tensors, same on every rank) are loaded into the raw model
        before Megatron-FSDP shards it: loading into sharded params would need FSDP's chunk offsets."""
        self.config = config if config is not None else MegatronFSDPConfig()
        if not isinstance(self.config, MegatronFSDPConfig):
            raise ValueError(f"MegatronFSDPTrainEngine takes a MegatronFSDPConfig, got {type(self.config).__name__}")
        check_exportable(hf_config)  # bad input: ValueError before anything is built
        ok, why = megatron_fsdp_available()
        if not ok:
            raise RuntimeError(why)
        from megatron.core.distributed import DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

        cfg = self.config
        self.hf_config = hf_config
        self.pg_collection = pg_collection
        self.groups = MegatronGroups.from_megatron(pg_collection)
        if model_chunks is None:
            model_chunks = [build_gpt_model(hf_config, cfg, pg_collection).cuda()]
        ddp_config = DistributedDataParallelConfig(
            use_megatron_fsdp=True,
            data_parallel_sharding_strategy=cfg.sharding_strategy,
            use_distributed_optimizer=True,
            overlap_param_gather=cfg.overlap_param_gather,
            overlap_grad_reduce=cfg.overlap_grad_reduce,
            grad_reduce_in_fp32=True,
        )
        if initial_hf_weights is not None:
            for chunk in model_chunks:
                load_hf(MegatronExporter(chunk, hf_config, WirePolicy(None, ()), self.groups), initial_hf_weights)
        self.chunks: list[nn.Module] = []
        for chunk in model_chunks:
            wrapped = FullyShardedDataParallel(config=chunk.config, ddp_config=ddp_config, module=chunk, pg_collection=pg_collection)
            self.chunks.append(wrapped)
        tconf: Any = model_chunks[0].config  # megatron-core's TransformerConfig (not read by the type checker)
        tconf.finalize_model_grads_func = finalize_model_grads
        tconf.no_sync_func = self.chunks[0].no_sync if len(self.chunks) == 1 else [c.no_sync for c in self.chunks]
        self.model = self.chunks[0]
        self.optimizer = megatron_adam(cfg, self.chunks, clip_grad=cfg.max_grad_norm if cfg.max_grad_norm is not None else 0.0)
        self.source: MegatronFSDPSource = MegatronFSDPSource(
            self.chunks, hf_config, sharding_strategy=cfg.sharding_strategy, pg_collection=pg_collection, dtype=cfg.wire_dtype,
            keep_fp32=cfg.keep_fp32_patterns, export_mode=cfg.export_mode,
        )
        self.global_step = 0
        self._sched_step = 0
        self.megatron_optimizer = True  # gradients reduced by finalize_model_grads in the schedule
        self.scheduler = None
        self._apply_lr()
        logger.info("Megatron-FSDP engine: strategy %s, %d chunk(s)", cfg.sharding_strategy, len(self.chunks))

    def load_hf_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        raise RuntimeError("Megatron-FSDP shards the model at construction: pass initial_hf_weights= to MegatronFSDPTrainEngine")

    # --- training ----------------------------------------------------------------------------
    def forward_backward(self, batch: dict[str, torch.Tensor], loss_fn: Any) -> dict[str, float]:
        if self._fresh_step:  # first micro-batch since the last step: clear the grad buffers
            chunks: list[Any] = self.chunks  # megatron-core's FullyShardedDataParallel (not read by the type checker)
            for chunk in chunks:
                chunk.zero_grad_buffer()
        self._fresh_step = False
        return super().forward_backward(batch, loss_fn)

    _fresh_step = True

    def optimizer_step(self) -> float:
        """Megatron's distributed optimizer step (clips by `max_grad_norm`); returns the grad norm."""
        success, grad_norm, _ = self.optimizer.step()
        self._fresh_step = True
        if not success:
            logger.warning("step %d: optimizer skipped the update (non-finite grads)", self.global_step)
            return float("nan") if grad_norm is None else float(grad_norm)
        self.global_step += 1
        return float(grad_norm) if grad_norm is not None else math.nan

    def train_mode(self) -> None:
        for c in self.chunks:
            c.train()

    def eval_mode(self) -> None:
        for c in self.chunks:
            c.eval()

    # --- checkpoint --------------------------------------------------------------------------
    def save_checkpoint(self, path: str) -> None:
        """DCP checkpoint of the FSDP-sharded model and optimizer; every rank calls it."""
        import torch.distributed.checkpoint as dcp

        self.source.sync_params_for_export()
        dcp.save(self._fsdp_state(), checkpoint_id=path)

    def load_checkpoint(self, path: str) -> None:
        import torch.distributed.checkpoint as dcp

        self.source.sync_params_for_export()
        state = self._fsdp_state()
        dcp.load(state, checkpoint_id=path)
        for i, c in enumerate(self.chunks):
            c.load_state_dict(state[f"model{i}"], strict=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.global_step = int(state["trainer"]["global_step"])
        self._sched_step = int(state["trainer"]["scheduler_step"])
        self._apply_lr()

    def _fsdp_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {f"model{i}": c.state_dict() for i, c in enumerate(self.chunks)}
        state["optimizer"] = self.optimizer.state_dict()
        state["trainer"] = {"global_step": torch.tensor(self.global_step), "scheduler_step": torch.tensor(self._sched_step)}
        return state
