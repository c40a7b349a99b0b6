"""TrainEngine: one interface over FSDP2, Megatron and Megatron-FSDP.

Each adapter is both the training engine (forward/backward/step) and the weight source for
`sync_rollout_weights()`. A training loop drives any backend without branching on it.

Collective contract: every trainer rank calls every method in the same order; `iter_weights()`
is a collective walk (gathers), so all ranks iterate it to the end; `is_sender` is true on the
one rank whose yielded tensors are streamed to the rollout engines.
"""

from __future__ import annotations

import importlib
from abc import abstractmethod
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch

from ckpt_engine.manifest import TensorSpec
from ckpt_engine.sources.base import WeightSource

__all__ = ["LossFn", "TrainEngine", "TrainEngineRegistry"]

LossFn = Callable[[torch.Tensor, dict[str, torch.Tensor]], torch.Tensor]
"""loss_fn(logits, batch) -> scalar loss."""


class TrainEngine(WeightSource):
    """A trainer (FSDP2, Megatron, ...) that is also the weight source of its syncs."""

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
    def metadata(self) -> list[TensorSpec]:
        """HF name, wire dtype and global shape of every tensor the rollout needs; no gathering."""

    @abstractmethod
    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full, HF-named tensors in `metadata()` order; a collective walk on every trainer rank.

        A yielded tensor may alias a gather buffer that the walk reuses or frees: it is valid until
        the next item is requested (the sync core packs it before asking for more); clone to keep.
        """

    @abstractmethod
    def save_checkpoint(self, path: str) -> None:
        """Save the sharded training state (model, optimizer, step) so a run can continue."""

    @abstractmethod
    def load_checkpoint(self, path: str) -> None: ...


class TrainEngineRegistry:
    """`trainer.backend` -> TrainEngine class, imported on first use."""

    _lazy: ClassVar[dict[str, str]] = {
        "fsdp2": "ckpt_engine.trainer_adapters.fsdp2:FSDP2TrainEngine",
        "megatron": "ckpt_engine.trainer_adapters.megatron:MegatronTrainEngine",
        "megatron_fsdp": "ckpt_engine.trainer_adapters.megatron_fsdp:MegatronFSDPTrainEngine",
        "megatron_fsdp2": "ckpt_engine.trainer_adapters.megatron_fsdp2:MegatronFSDP2TrainEngine",
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
