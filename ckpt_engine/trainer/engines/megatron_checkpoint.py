"""Layout-independent Megatron checkpoints: weights and AdamW moments as full HF-named tensors.

A Megatron rank holds TP/PP/EP shards in Megatron's layouts (fused qkv per query group, [gate; up]
per TP shard, vocab padded to a multiple of TP). Saving them per rank ties the checkpoint to that
layout. Here the same conversion that exports weights to rollout engines (`MegatronExporter`)
turns the weights *and* each AdamW moment (elementwise state, so it converts like its parameter)
into full Hugging Face tensors; loading runs the reverse conversion (`megatron_load.load_hf`) into whatever
TP/PP/EP layout the loading engine has. A TP=2 checkpoint therefore loads into TP=1, and the
weights file is a plain HF safetensors checkpoint.

Files: `model.safetensors`, `exp_avg.safetensors`, `exp_avg_sq.safetensors` (full precision,
HF checkpoint names), steps in the metadata. Collective contract: every rank of the
model-parallel world and of the data-parallel group calls `save`/`load`; one rank writes.
"""

from __future__ import annotations

import logging
import os
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from ckpt_engine.sources.megatron_export import MegatronExporter, walk_to_first_stage
from ckpt_engine.trainer.engines.megatron_load import load_hf
from ckpt_engine.sources.wire import WirePolicy

MegatronTrainEngine = Any  # the engine (megatron.py imports this module, so no import back)

__all__ = ["FORMAT", "MOMENTS", "hf_space_exporter", "load_megatron_checkpoint", "save_megatron_checkpoint"]

logger = logging.getLogger(__name__)

FORMAT = "ckpt_engine.megatron.hf_space.v1"
MOMENTS = ("exp_avg", "exp_avg_sq")
FILES = ("model", *MOMENTS)


def _moment(optimizer: torch.optim.Optimizer, key: str, p: torch.Tensor) -> torch.Tensor:
    state = optimizer.state.get(p)
    return state[key] if state and key in state else torch.zeros_like(p)


def hf_space_exporter(engine: MegatronTrainEngine, key: str) -> MegatronExporter:
    """Full-precision exporter (no wire dtype) over the weights, or over one AdamW moment."""
    local = None if key == "model" else partial(_moment, engine.optimizer, key)
    return MegatronExporter(engine.model, engine.hf_config, WirePolicy(None, ()), engine.groups, local_tensor=local)


def _check_supported(engine: MegatronTrainEngine) -> None:
    if getattr(engine, "megatron_optimizer", False):
        raise RuntimeError(
            "layout-independent checkpoints cover MegatronConfig.optimizer='adamw'; the megatron_distributed "
            "optimizer keeps its fp32 main weights sharded over DP (save them with megatron.core.dist_checkpointing)"
        )


def _barrier(engine: MegatronTrainEngine) -> None:
    """All ranks of the model-parallel world and of the DP group pass only after the writer."""
    for group in (engine.groups.mp, engine.groups.dp):
        if group is not None and dist.get_world_size(group) > 1:
            dist.barrier(group=group)


def _params(engine: MegatronTrainEngine) -> list[torch.Tensor]:
    return [p for group in engine.optimizer.param_groups for p in group["params"]]


def save_megatron_checkpoint(engine: MegatronTrainEngine, path: str) -> None:
    """Write weights, AdamW moments and steps as full HF tensors; every rank calls it."""
    from safetensors.torch import save_file

    _check_supported(engine)
    g = engine.groups
    writer = g.tp_rank == 0 and g.pp_rank == 0 and g.dp_rank == 0 and g.ep_rank == 0
    steps = {float(engine.optimizer.state[p]["step"]) for p in _params(engine) if "step" in engine.optimizer.state.get(p, {})}
    if len(steps) > 1:
        raise RuntimeError(f"AdamW step differs between parameters ({sorted(steps)}): cannot save one step count")
    meta = {
        "format": FORMAT, "global_step": str(engine.global_step), "scheduler_step": str(engine._sched_step),
        "adam_step": str(steps.pop() if steps else 0.0),
    }
    device = next(engine.model.parameters()).device
    if writer:
        os.makedirs(path, exist_ok=True)
    for key in FILES:
        ex = hf_space_exporter(engine, key)
        tensors: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for name, t in walk_to_first_stage(ex, ex.stage_specs(), g, device):
                if writer:
                    tensors[name] = t.detach().to("cpu", copy=True)
        if writer:
            save_file(tensors, os.path.join(path, f"{key}.safetensors"), metadata=meta)
    _barrier(engine)
    logger.info("saved layout-independent Megatron checkpoint at step %d to %s", engine.global_step, path)


def load_megatron_checkpoint(engine: MegatronTrainEngine, path: str) -> None:
    """Load what `save_megatron_checkpoint` wrote into this engine's layout; every rank calls it."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    _check_supported(engine)
    paths = {key: os.path.join(path, f"{key}.safetensors") for key in FILES}
    missing = [p for p in paths.values() if not os.path.exists(p)]
    if missing:
        raise ValueError(f"not a ckpt_engine Megatron checkpoint: {missing[0]} is missing")
    with safe_open(paths["model"], framework="pt") as f:
        meta: dict[str, Any] = f.metadata() or {}
    if meta.get("format") != FORMAT:
        raise ValueError(f"{paths['model']}: format {meta.get('format')!r}, expected {FORMAT!r}")
    optimizer = engine.optimizer
    adam_step = float(meta["adam_step"])
    ex = hf_space_exporter(engine, "model")
    with torch.no_grad():
        load_hf(ex, load_file(paths["model"]))
        for p in _params(engine):
            state = optimizer.state[p]
            for key in MOMENTS:
                if key not in state:
                    state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] = torch.tensor(adam_step, dtype=torch.float32)
        for key in MOMENTS:
            load_hf(ex, load_file(paths[key]), target=lambda p: optimizer.state[p][key])  # called within load_hf, so `key` is this iteration's
    engine.global_step = int(meta["global_step"])
    engine._sched_step = int(meta["scheduler_step"])
    if engine.scheduler is not None:
        engine.scheduler.last_epoch = engine._sched_step
    for group in optimizer.param_groups:
        group["lr"] = engine.config.lr * engine.config.lr_factor(engine._sched_step)
    if engine.scheduler is not None:
        engine.scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
    _barrier(engine)
    logger.info("loaded layout-independent Megatron checkpoint from %s at step %d", path, engine.global_step)
