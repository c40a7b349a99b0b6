"""What one daemon sync did (`SyncOutcome`), and the one-walk-per-attempt guard around a source."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ckpt_engine.daemon.membership import EngineRecord, EngineState, Membership
from ckpt_engine.manifest import TensorSpec
from ckpt_engine.sync.api import SyncError
from ckpt_engine.sources.base import WeightSource

__all__ = ["MOVED_DATA", "OneWalkPerAttempt", "SyncOutcome", "WalkBarrier", "blame_source", "drop_tracebacks", "size_text", "summarize", "wire_text"]

logger = logging.getLogger(__name__)

MOVED_DATA = ("pause", "transfer", "receive", "finalize", "resume")
"""Stages of a failed sync after which engines may hold part of a version (or are at least paused)."""
UNSTAMPED = ("probe", "join", "validate", "pause")
"""Stages of a failed attempt before any engine could stamp the sync's version: a retry after only
these is a new sync of that version, not a catch-up of weights some engine took under it."""

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
    descriptors: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Each engine's descriptor as the sync took its members: a report speaks of the engine it
    drove, not of one registered under the same name since (`reported`)."""
    report: dict[str, Any] | None = None
    """The successful attempt's SyncReport.to_dict()."""
    error: str | None = None
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def stamped(self) -> bool:
        """Whether a failed attempt of this sync got past the pause, so some engine may hold its
        version from it: only then is an engine at that version its own catch-up, else another
        trainer's (`UNSTAMPED`)."""
        return any(a["stage"] not in UNSTAMPED for a in self.attempts)


def reported(membership: Membership, outcome: Mapping[str, Any], name: str) -> EngineRecord | None:
    """The record a trainer's reported outcome speaks of under `name`: None when there is none, or
    when the engine registered again (another descriptor) after the sync took its members, so a
    failure of its earlier process is not held against it."""
    rec = membership.get(name)
    drove = outcome.get("descriptors", {}).get(name)
    return rec if rec is not None and (drove is None or drove == rec.engine) else None


class OneWalkPerAttempt(WeightSource):
    """Wraps a weight source so that each attempt walks `iter_weights()` exactly once.

    WeightSyncSession walks the source exactly once per `sync()` call, but an attempt can fail
    before that call (pruning, building the session), and on a sharded trainer every walk is a
    collective: the sender must walk exactly as often as the other ranks. All `iter_weights()` calls
    within an attempt continue one underlying walk, and `finish()` completes it.

    It also tells a failing source from failing engines: an exception raised by the source itself
    (`metadata()` or the walk) is kept in `error`, so the daemon blames the source, not the
    receivers that merely saw the sender stop.
    """

    def __init__(self, source: WeightSource) -> None:
        self.source = source
        self._it: Iterator[tuple[str, torch.Tensor]] | None = None
        self._done = True
        self.error: BaseException | None = None
        """The exception the source raised during the current attempt, if any."""
        self.error_in_walk = False
        """The source raised while being walked (engines were paused and may hold part of it)."""

    @property
    def device(self) -> torch.device | None:
        """The source's: the session fixes the sender's device from it (`WeightSource.device`)."""
        return self.source.device

    def metadata(self) -> list[TensorSpec]:
        try:
            return self.source.metadata()
        except Exception as exc:
            self.error = exc
            raise

    def begin(self) -> None:
        self._it, self._done, self.error, self.error_in_walk = None, False, None, False

    def _next(self) -> tuple[str, torch.Tensor] | None:
        try:
            if self._it is None:
                self._it = iter(self.source.iter_weights())
            return next(self._it)
        except StopIteration:
            return None
        except Exception as exc:
            self.error, self.error_in_walk, self._done = exc, True, True  # a generator that raised is finished
            raise

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        while (item := self._next()) is not None:
            yield item
        self._done = True

    def finish(self) -> None:
        if not self._done:
            try:
                while self._next() is not None:
                    pass
            except Exception as exc:  # kept in self.error; the attempt's outcome names it
                self.error = self.error if self.error is not None else exc
            self._done = True
        self._it = None


def summarize(outcome: Mapping[str, Any]) -> dict[str, Any]:
    """The history line of one outcome (status shows the last few): with delta syncs, the bytes
    on the wire next to the dense bytes and the delta kind (off / seed / patch)."""
    report = outcome.get("report") or {}
    return {
        "version": outcome.get("version"),
        "ok": outcome.get("ok"),
        "catch_up": outcome.get("catch_up"),
        "dropped": sorted(outcome.get("dropped") or {}),
        "seconds": outcome.get("seconds"),
        "bytes": report.get("bytes"),
        "delta": report.get("delta"),
        "wire_bytes": report.get("wire_bytes"),
        "dense_bytes": report.get("dense_bytes"),
        "senders": report.get("senders"),
        "gbps": report.get("gbps"),
        "at": time.time(),
    }


def size_text(n: int) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 100_000 else f"{n / 1e3:.1f} kB"


def wire_text(report: Mapping[str, Any]) -> str:
    """`patch 1.20 MB of 58.00 MB (2.1 %)`: a sync's wire bytes next to its dense bytes and delta
    kind (a report, a history line or a trainer's sync record as a dict); `dense 58.00 MB` for a
    sync without delta."""
    dense = int(report.get("dense_bytes") or 0) or int(report.get("bytes") or 0)
    wire = int(report.get("wire_bytes") or 0) or dense
    kind = str(report.get("delta") or "off")
    if kind == "off":
        return f"dense {size_text(dense)}"
    return f"{kind} {size_text(wire)} of {size_text(dense)} ({100.0 * wire / dense if dense else 100.0:.1f} %)"


def drop_tracebacks(exc: BaseException) -> None:
    """Drop the tracebacks of a failed sync: their frames hold the broken group's work handles."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        e.__traceback__ = None
        e = e.__cause__ if e.__cause__ is not None else e.__context__


def blame_source(
    walker: OneWalkPerAttempt, exc: BaseException, members: list[EngineRecord], membership: Membership, outcome: SyncOutcome, attempt: int
) -> None:
    """The trainer's weight source raised: name it and its exception, drop no engine.

    Engines that may have received part of the version are marked stale (no complete version)
    and stay paused until the next complete sync."""
    err = walker.error
    drop_tracebacks(exc)
    what = f"weight source {type(walker.source).__name__} raised {type(err).__name__}: {err}"
    outcome.attempts.append({"attempt": attempt, "stage": "source", "failed": {"source": what[:2000]}})
    moved = walker.error_in_walk or (isinstance(exc, SyncError) and exc.stage in MOVED_DATA)
    if moved:
        for rec in members:
            membership.set_state(rec, EngineState.STALE, None)
    outcome.error = f"{what}; no engine was dropped" + ("; engines stay paused and stale until the next complete sync" if moved else "")
    logger.warning("sync v%d: %s", outcome.version, outcome.error)
