"""What a session's group can do, asked before anything pauses: whether it can move patches."""

from __future__ import annotations

from collections.abc import Sequence

from ckpt_engine.rollout_adapters.capabilities import lacking
from ckpt_engine.rollout_adapters.base import RolloutAdapter
from ckpt_engine.engine import CheckpointEngine

__all__ = ["delta_unsupported"]


def delta_unsupported(engine: CheckpointEngine, backend: str, rollouts: Sequence[RolloutAdapter]) -> str | None:
    """Why this group cannot take patch syncs (the backend or engines by name), or None."""
    if not engine.supports_delta:
        return f"the {backend} backend does not send patches"
    missing = lacking(rollouts, "delta")
    return f"engine(s) {', '.join(missing)} do not take patches" if missing else None
