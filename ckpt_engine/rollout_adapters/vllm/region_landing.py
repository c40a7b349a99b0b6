"""How a vLLM worker's region items become what its loader takes, for one sync.

A worker with a receive plan gets `(name, region, tensor)` items; vLLM's `load_weights` wants
global-shaped tensors under per-expert names (it narrows its own slice). `RegionLanding` assembles
each name's regions (`RegionAssembler`), turns a stack into its experts (views) and lets a tied head
ride along as its embedding's tensor, then hands the pairs to a sink.

One landing object exists per use: the live receive lands straight into vLLM; a staged receive keeps
the items compactly (only the slice bytes) and checks them as they land with a landing on the `meta`
device (every check of the real one, no memory), and the swap lands them for real.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ckpt_engine.manifest import TensorSpec
from ckpt_engine.planning.regions import ReceivePlan, Region
from ckpt_engine.rollout_adapters.region_assembler import RegionAssembler

__all__ = ["LandingFactory", "RegionItem", "RegionLanding"]

RegionItem = tuple[str, Region | None, torch.Tensor]
Pairs = list[tuple[str, torch.Tensor]]
Unstack = Callable[[Pairs, Any], Pairs]
"""Stacks among the pairs -> their experts (`VllmSpecs.unstack`); its second argument the
per-expert names the rank holds."""


class RegionLanding:
    """Region items of one sync -> the loader's (name, tensor) pairs, into `sink` as names complete."""

    def __init__(
        self, plan: ReceivePlan, fused: ReceivePlan, specs: Mapping[str, TensorSpec], device: torch.device,
        unstack: Unstack, alias: Mapping[str, str], sink: Callable[[Pairs], None],
    ) -> None:
        self._assembler = RegionAssembler(fused, specs, device)
        self._held = plan.holds
        self._unstack, self._alias, self._sink = unstack, alias, sink

    def load(self, items: list[RegionItem]) -> int:
        """Take items (raises for one the plan does not hold, or of the wrong shape); returns the
        names handed to the sink."""
        ready = self._unstack([pair for item in items for pair in self._assembler.add(*item)], self._held)
        if ready:
            self._sink(ready + [(self._alias[n], t) for n, t in ready if n in self._alias])
        return len(ready)

    def incomplete(self) -> list[str]:
        """Names with regions still missing (a receive that ends with any is broken)."""
        return self._assembler.incomplete()


LandingFactory = Callable[[torch.device, Callable[[Pairs], None]], RegionLanding]
"""A sync's landing, made for a device and a sink (the sync's plan, specs and aliases bound)."""
