"""TrainEngine: one interface over FSDP2, Megatron and Megatron-FSDP(2) for the demo trainer.

A training engine steps its model (forward/backward, optimizer, checkpoints) and holds the weight
source of its syncs (`source`, from `ckpt_engine.sources`): the loop passes `engine.source` to
`sync_rollout_weights()` or the daemon. A training loop drives any backend without branching on it.

Collective contract: every trainer rank calls every method in the same order.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from ckpt_engine.sources.base import WeightSource

__all__ = ["LossFn", "TrainEngine", "TrainEngineRegistry"]

LossFn = Callable[[torch.Tensor, dict[str, torch.Tensor]], torch.Tensor]
"""loss_fn(logits, batch) -> scalar loss."""


class TrainEngine(ABC):
    """A trainer (FSDP2, Megatron, ...) and the weight source its syncs read."""

    source: WeightSource
    """The weights as a sync reads them: a `ckpt_engine.sources` object built from this engine's
    sharded model (every trainer rank holds one; its `iter_weights()` is a collective walk)."""

    @abstractmethod
    def forward_backward(self, batch: dict[str, torch.Tensor], loss_fn: LossFn) -> dict[str, float]:
        """Run forward and backward on this rank's part of `batch`; returns metrics (at least 'loss')."""

    @abstractmethod
    def optimizer_step(self) -> float:
        """Step the optimizer, zero the grads; returns the global grad norm."""

    def lr_scheduler_step(self) -> None:
        """Advance the learning-rate schedule (no-op when none is configured)."""

    @abstractmethod
    def train_mode(self) -> None: ...

    @abstractmethod
    def eval_mode(self) -> None: ...

    @abstractmethod
    def save_checkpoint(self, path: str) -> None:
        """Save the sharded training state (model, optimizer, step) so a run can continue."""

    @abstractmethod
    def load_checkpoint(self, path: str) -> None: ...


class TrainEngineRegistry:
    """`trainer.backend` -> TrainEngine class, imported on first use."""

    _lazy: ClassVar[dict[str, str]] = {
        "fsdp2": "ckpt_engine.trainer.engines.fsdp2:FSDP2TrainEngine",
        "megatron": "ckpt_engine.trainer.engines.megatron:MegatronTrainEngine",
        "megatron_fsdp": "ckpt_engine.trainer.engines.megatron_fsdp:MegatronFSDPTrainEngine",
        "megatron_fsdp2": "ckpt_engine.trainer.engines.megatron_fsdp2:MegatronFSDP2TrainEngine",
    }

    @classmethod
    def names(cls) -> list[str]:
        return sorted(cls._lazy)

    @classmethod
    def register(cls, name: str, target: str) -> None:
        if name in cls._lazy and cls._lazy[name] != target:
            raise ValueError(f"trainer backend {name!r} is already registered; registered: {', '.join(cls.names())}")
        cls._lazy[name] = target

    @classmethod
    def get(cls, name: str) -> type[TrainEngine]:
        target = cls._lazy.get(name)
        if target is None:
            raise ValueError(f"unknown trainer backend {name!r}; known: {', '.join(cls.names())}")
        module, _, attr = target.partition(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except ImportError as exc:
            raise ValueError(f"trainer backend {name!r} could not be loaded ({target}): {exc}") from exc

    @classmethod
    def new(cls, name: str, **kwargs: Any) -> TrainEngine:
        return cls.get(name)(**kwargs)
