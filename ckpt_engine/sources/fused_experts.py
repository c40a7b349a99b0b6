"""A weight source that sends each layer's routed experts as one stacked tensor per projection.

Wrap a trainer's source when every engine of the sync holds experts fused (see
`planning/fused_experts.py`): the manifest then names `...mlp.experts.gate_proj.weight`
([experts, rows, cols]) instead of one tensor per expert. The stack is filled as the inner source
yields its experts (one copy each, into memory the stack owns) and yielded once complete.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ckpt_engine.manifest import TensorSpec
from ckpt_engine.planning.fused_experts import FusedExperts, fuse_specs
from ckpt_engine.sources.base import WeightSource

__all__ = ["FusedExpertSource"]


class FusedExpertSource(WeightSource):
    """`inner` with its per-expert tensors stacked (single sender: one rank streams everything).

    Collective contract as `inner`'s: every trainer rank walks `iter_weights()` once per sync; a
    rank that does not send walks the inner source unchanged (nothing is stacked)."""

    def __init__(self, inner: WeightSource) -> None:
        self.inner = inner
        self.is_sender = inner.is_sender
        self.stable_tensors = inner.stable_tensors  # a stack is new memory every sync, never reused
        self.process_group = inner.process_group
        self._specs: list[TensorSpec] | None = None
        self._fused: FusedExperts | None = None

    def _plan(self) -> tuple[list[TensorSpec], FusedExperts]:
        if self._specs is None or self._fused is None:
            self._specs, self._fused = fuse_specs(self.inner.metadata())
        return self._specs, self._fused

    def metadata(self) -> list[TensorSpec]:
        self._specs = self._fused = None  # the inner source may have changed its tensors
        return list(self._plan()[0])

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        if not self.is_sender:
            yield from self.inner.iter_weights()
            return
        fused = self._plan()[1]
        stacks: dict[str, torch.Tensor] = {}
        filled: dict[str, int] = {}
        for name, t in self.inner.iter_weights():
            where = fused.member_of.get(name)
            if where is None:
                yield name, t
                continue
            stacked, index = where
            group = fused.groups[stacked]
            buf = stacks.get(stacked)
            if buf is None:
                buf = stacks[stacked] = torch.empty((len(group.members), *t.shape), dtype=t.dtype, device=t.device)
            if tuple(t.shape) != tuple(buf.shape[1:]):
                raise ValueError(f"{name}: shape {list(t.shape)} differs from its metadata {list(buf.shape[1:])}")
            buf[index].copy_(t)
            filled[stacked] = filled.get(stacked, 0) + 1
            if filled[stacked] == len(group.members):
                yield stacked, stacks.pop(stacked)
        if stacks:
            name = next(iter(stacks))
            raise RuntimeError(f"the weight source yielded {filled[name]} of the {len(fused.groups[name].members)} experts of {name!r}")
