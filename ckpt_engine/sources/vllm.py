"""vLLM's `WeightSource` as a ckpt-engine weight source, so a trainer written against vLLM's
weight-transfer API hands the same object to `sync_rollout_weights()`.

vLLM's source declares `ParamMeta(name, torch.dtype, shape)` and yields from `iter(source)`;
ckpt-engine's declares `TensorSpec`s and yields from `iter_weights()`. Nothing here imports vLLM:
an object can only be a vLLM `WeightSource` once vLLM's `weight_transfer/base.py` is imported, so
it is looked up there.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import torch

from ckpt_engine.manifest import TensorSpec
from ckpt_engine.sources.base import WeightSource

__all__ = ["VllmWeightSourceAdapter", "as_weight_source", "is_vllm_weight_source"]


_VLLM_BASE = "vllm.distributed.weight_transfer.base"


def is_vllm_weight_source(source: Any) -> bool:
    """True for an instance of vLLM's `WeightSource` (its declared ABC)."""
    base = sys.modules.get(_VLLM_BASE)
    return base is not None and isinstance(source, base.WeightSource)


class VllmWeightSourceAdapter(WeightSource):
    """Wraps a vLLM `WeightSource`. Every trainer rank wraps its own source and walks it (the
    gathers behind it are collectives); `is_sender` says which rank streams.

    One sender streams every tensor, so a source split over ranks (`held_names()` not None) is
    refused: vLLM's many-holder layouts need a backend that pulls from every holder.
    """

    def __init__(
        self, source: Any, *, is_sender: bool = True, stable_tensors: bool = False, dtype: torch.dtype | None = None,
    ) -> None:
        if not is_vllm_weight_source(source):
            raise ValueError(f"expected a vLLM WeightSource ({_VLLM_BASE}.WeightSource), got {type(source).__name__}")
        held = source.held_names()
        if held is not None:
            raise ValueError(
                f"{type(source).__name__}.held_names() splits the model over ranks; ckpt-engine sends from "
                "one rank, so its source must hold every parameter (held_names() returning None)"
            )
        self.source = source
        self.is_sender = is_sender
        self.stable_tensors = stable_tensors
        """True only when every yielded tensor stays valid until the sync ends (e.g. plain parameters)."""
        self.dtype = dtype
        """Floating-point tensors travel (and load) as this dtype, as `StateDictSource`'s `dtype`."""

    def metadata(self) -> list[TensorSpec]:
        specs = []
        for meta in self.source.metadata():
            if not isinstance(meta.dtype, torch.dtype):
                raise ValueError(f"{meta.name}: metadata dtype must be a torch.dtype, got {meta.dtype!r}")
            wire = self.dtype if self.dtype is not None and meta.dtype.is_floating_point else meta.dtype
            specs.append(TensorSpec(meta.name, str(wire).removeprefix("torch."), tuple(int(d) for d in meta.shape)))
        return specs

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.source:
            if tensor is None:
                raise ValueError(f"{name}: the vLLM WeightSource yielded None; ckpt-engine needs every tensor on the sender")
            yield name, tensor


def as_weight_source(source: Any) -> WeightSource:
    """`source` itself if it is already a ckpt-engine source, else a vLLM source wrapped."""
    if isinstance(source, WeightSource):
        return source
    if is_vllm_weight_source(source):
        return VllmWeightSourceAdapter(source)
    raise TypeError(
        f"expected a weight source, got {type(source).__name__}: subclass ckpt_engine.sources.base.WeightSource "
        "(metadata() and iter_weights()), wrap a state dict in StateDictSource, or pass a vLLM WeightSource"
    )
