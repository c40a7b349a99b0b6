"""Settings and steps every training engine shares: optimizer, LR schedule, clipping, loss and grad norm.

The wire dtypes a config names are the sources' (`ckpt_engine.sources.wire`)."""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ckpt_engine.sources.wire import DEFAULT_KEEP_FP32, WirePolicy, check_float_dtype

__all__ = [
    "TrainConfig", "adamw_with_schedule", "clip_and_step", "decoder_layers", "global_grad_norm", "hf_model_from_config", "mean_loss",
    "resume_schedule",
]

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class TrainConfig:
    """AdamW, grad clipping, LR schedule and export dtypes: the part every backend shares."""

    lr: float = 1e-5
    """Peak learning rate of AdamW."""
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0
    """Clip the global grad norm to this value; None disables clipping (the norm is still returned)."""
    warmup_steps: int = 0
    """Linear warmup from lr/warmup_steps to lr over this many `lr_scheduler_step()` calls."""
    total_steps: int | None = None
    """When set, cosine decay from lr to `min_lr_ratio * lr` between warmup_steps and total_steps."""
    min_lr_ratio: float = 0.0
    wire_dtype: str | None = "bfloat16"
    """dtype floating-point tensors travel in (None: their parameter dtype)."""
    keep_fp32_patterns: tuple[str, ...] = DEFAULT_KEEP_FP32
    """Regexes (re.search on the HF name) of tensors that travel as float32 whatever `wire_dtype` says."""

    def __post_init__(self) -> None:
        cls = type(self).__name__
        if not self.lr > 0:
            raise ValueError(f"{cls}.lr must be > 0, got {self.lr}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"{cls}.max_grad_norm must be > 0 or None, got {self.max_grad_norm}")
        if self.warmup_steps < 0:
            raise ValueError(f"{cls}.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.total_steps is not None and self.total_steps <= self.warmup_steps:
            raise ValueError(f"{cls}.total_steps ({self.total_steps}) must exceed warmup_steps ({self.warmup_steps})")
        check_float_dtype(f"{cls}.wire_dtype", self.wire_dtype)
        for pat in self.keep_fp32_patterns:
            try:
                re.compile(pat)
            except re.error as exc:
                raise ValueError(f"{cls}.keep_fp32_patterns: bad regex {pat!r}: {exc}") from None

    def wire(self) -> WirePolicy:
        """The wire dtypes these settings name, as the sources take them."""
        return WirePolicy(self.wire_dtype, self.keep_fp32_patterns)

    def lr_factor(self, step: int) -> float:
        """Multiplier of `lr` after `step` scheduler steps (pure; shared by engines and references)."""
        if self.warmup_steps and step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.total_steps is None:
            return 1.0
        progress = min(1.0, (step - self.warmup_steps) / (self.total_steps - self.warmup_steps))
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
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


def hf_model_from_config(hf_config: object, dtype: torch.dtype, **kwargs: object) -> torch.nn.Module:
    """`AutoModelForCausalLM.from_config` across transformers 4.x (`torch_dtype=`) and 5.x (`dtype=`)."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_config(hf_config, dtype=dtype, **kwargs)
    except TypeError:
        return AutoModelForCausalLM.from_config(hf_config, torch_dtype=dtype, **kwargs)


def adamw_with_schedule(model: torch.nn.Module, config: TrainConfig) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over `model`'s trainable parameters and its `config.lr_factor` schedule: the plain
    optimizer of the FSDP2, Megatron and Megatron-FSDP2 engines."""
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=config.lr, betas=config.betas, eps=config.eps, weight_decay=config.weight_decay,
    )
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, config.lr_factor)


def resume_schedule(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR, config: TrainConfig, step: int) -> None:
    """Put a loaded checkpoint's schedule at `step`: every group's lr and what the scheduler reports."""
    scheduler.last_epoch = step
    for group in optimizer.param_groups:
        group["lr"] = group["initial_lr"] * config.lr_factor(step)
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]


def clip_and_step(
    optimizer: torch.optim.Optimizer, grads: list[torch.Tensor], norm: float, max_grad_norm: float | None, step: int
) -> bool:
    """Scale `grads` to `max_grad_norm` (given their global `norm`), step and zero the optimizer.

    A non-finite norm skips the update (the grads are dropped) and returns False, so one bad batch
    cannot poison the weights every rollout engine will receive.
    """
    if not math.isfinite(norm):
        logger.warning("step %d: grad norm is %s, skipping the update", step, norm)
        optimizer.zero_grad(set_to_none=True)
        return False
    if max_grad_norm is not None:
        coef = max_grad_norm / (norm + 1e-6)
        if coef < 1.0:
            torch._foreach_mul_(grads, coef)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return True


def mean_loss(loss: torch.Tensor, group: Any, world_size: int) -> dict[str, float]:
    """This rank's loss ('local_loss') and its mean over the data-parallel `group` ('loss');
    collective: every rank of `group` calls it once per micro-batch."""
    local = loss.detach().float().reshape(1).clone()
    total = local.clone()
    dist.all_reduce(total, group=group)
    return {"loss": total.item() / world_size, "local_loss": local.item()}


def global_grad_norm(local_grads: list[torch.Tensor], group: Any, device: torch.device) -> float:
    """Global L2 norm of gradients whose every element lives on exactly one rank of `group` (local
    shards): fp64 sums of squares, all-reduced. Collective over `group`."""
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for g in local_grads:
        if g.numel():
            sq += torch.linalg.vector_norm(g, dtype=torch.float64).square()
    dist.all_reduce(sq, group=group)
    return math.sqrt(sq.item())
