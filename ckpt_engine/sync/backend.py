"""Which transport a session streams over: `checkpoint_engine.backend`, or the wire its engines read."""

from __future__ import annotations

from collections.abc import Sequence

from ckpt_engine.config import CheckpointEngineConfig
from ckpt_engine.rollout_adapters.base import RolloutAdapter
from ckpt_engine.registry import CheckpointEngineRegistry

__all__ = ["backend_for"]


def backend_for(config: CheckpointEngineConfig, rollouts: Sequence[RolloutAdapter]) -> str:
    """`checkpoint_engine.backend` (`auto` resolved by device), unless the engines declare the one
    wire they read (`capabilities.transport`, e.g. SGLang's): then that one, refused by name
    when the config names another or the engines disagree."""
    wires = {r.capabilities.transport for r in rollouts}
    if wires == {None}:
        return CheckpointEngineRegistry.resolve_name(config.backend)
    if len(wires) > 1:
        kinds = ", ".join(f"{r.name}: {r.capabilities.transport or 'any'}" for r in rollouts)
        raise ValueError(f"these engines read different wires ({kinds}); sync each kind through a session of its own")
    wire = next(iter(wires))
    assert wire is not None
    if config.backend not in ("auto", wire):
        raise ValueError(
            f"engine(s) {', '.join(r.name for r in rollouts)} read only the {wire!r} wire, not "
            f"checkpoint_engine.backend={config.backend!r}; leave backend at 'auto' (or set {wire!r})"
        )
    return wire
