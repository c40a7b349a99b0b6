"""Which one setting would make this sync faster: try each single change, rank by the gain.

Each candidate is a flag the user can pass; the planner predicts the changed set-up and keeps
the ones that help. Candidates that ckpt-engine cannot run yet say so.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ckpt_engine.plan.cost import predict
from ckpt_engine.plan.params import Calibration
from ckpt_engine.plan.scenario import Scenario

__all__ = ["Advice", "advise"]

_NOT_YET = "not in ckpt-engine yet"
_THIS_ROUND = "being added this round"


@dataclass(frozen=True)
class Advice:
    """One single-setting change and the total it predicts."""

    flag: str
    total_s: float
    speedup: float
    status: str


def _candidates(sc: Scenario) -> list[tuple[str, dict[str, Any], str]]:
    """(flag, scenario changes, whether ckpt-engine runs it today) for each single change."""
    out: list[tuple[str, dict[str, Any], str]] = []
    if sc.strategy == "single":
        out.append(("--strategy all-senders", {"strategy": "all-senders"}, _THIS_ROUND))
    for mb in (sc.bucket_mb / 4, sc.bucket_mb * 4):
        if mb >= 1:
            out.append((f"--bucket-mb {mb:g}", {"bucket_mb": mb}, "exists"))
    if sc.buffers < 3:
        out.append(("--buffers 3", {"buffers": 3}, "exists"))
    if sc.delta is None:
        out.append(("--delta 0.02", {"delta": 0.02}, _THIS_ROUND))
    if not sc.fused_experts:
        out.append(("--fused-experts", {"fused_experts": True}, _NOT_YET))
    if sc.receive == "full":
        out.append(("--receive shard", {"receive": "shard"}, _NOT_YET))
    if sc.dtype != "fp8":
        out.append(("--dtype fp8", {"dtype": "fp8"}, _NOT_YET))
    return out


def advise(sc: Scenario, cal: Calibration, top: int = 3) -> list[Advice]:
    """The ``top`` single changes that shorten the predicted sync most (at least 2 %)."""
    base = predict(sc.setup(), cal).total_s
    found = []
    for flag, changes, status in _candidates(sc):
        try:
            total = predict(replace(sc, **changes).setup(), cal).total_s
        except ValueError:
            continue  # a change that does not apply to this set-up
        if total < base * 0.98:
            found.append(Advice(flag, total, base / total, status))
    return sorted(found, key=lambda a: a.total_s)[:top]
