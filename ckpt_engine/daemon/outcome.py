"""What one daemon sync did (`SyncOutcome`), and the one-walk-per-attempt guard around a source."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ckpt_engine.manifest import TensorSpec
from ckpt_engine.weights import WeightSource

__all__ = ["OneWalkPerAttempt", "SyncOutcome", "WalkBarrier"]

WalkBarrier = Callable[[bool], None]
"""Called on the sender after each walk of the source with `again`: whether another walk follows."""


@dataclass
class SyncOutcome:
    """What one `WeightSyncDaemon.sync()` did, including any drops and automatic re-syncs."""

    version: int
    ok: bool = False
    """True when every engine still a member at the end holds `version` completely."""
    catch_up: bool = False
    """The version was the current one again (new or returning engines caught up)."""
    engines: dict[str, int | None] = field(default_factory=dict)
    """Each member's last complete version at the end."""
    states: dict[str, str] = field(default_factory=dict)
    dropped: dict[str, str] = field(default_factory=dict)
    """Engines removed from the group during this sync, with the reason (they died, timed out, rejected)."""
    rejected: dict[str, list[str]] = field(default_factory=dict)
    stale: list[str] = field(default_factory=list)
    attempts: list[dict[str, Any]] = field(default_factory=list)
    """One entry per failed attempt: stage and the engines it named."""
    report: dict[str, Any] | None = None
    """The successful attempt's SyncReport.to_dict()."""
    error: str | None = None
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class OneWalkPerAttempt:
    """Wraps a weight source so that each attempt walks `iter_weights()` exactly once.

    WeightSyncSession walks the source exactly once per `sync()` call, but an attempt can fail
    before that call (pruning, building the session), and on a sharded trainer every walk is a
    collective: the sender must walk exactly as often as the other ranks. All `iter_weights()` calls
    within an attempt continue one underlying walk, and `finish()` completes it.
    """

    is_sender = True

    def __init__(self, source: WeightSource) -> None:
        self.source = source
        self._it: Iterator[tuple[str, torch.Tensor]] | None = None
        self._done = True

    def metadata(self) -> list[TensorSpec]:
        return self.source.metadata()

    def begin(self) -> None:
        self._it, self._done = None, False

    def _iterator(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self._it is None:
            self._it = iter(self.source.iter_weights())
        return self._it

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for item in self._iterator():
            yield item
        self._done = True

    def finish(self) -> None:
        if not self._done:
            for _ in self._iterator():
                pass
            self._done = True
        self._it = None
