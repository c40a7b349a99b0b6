"""Who is in the weight-sync group: engine records, liveness and departures.

A record is created when an engine registers and removed when it leaves, stops answering for
`heartbeat_timeout_s`, or fails a sync. Every change bumps `epoch`; the coordinator rebuilds the
weight-sync group when the set of members it last synced differs from the current one. Records
are plain data behind one lock; no network calls are made while holding it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ckpt_engine.rollout_adapters.base import RolloutAdapter

__all__ = ["EngineRecord", "EngineState", "Membership"]

logger = logging.getLogger(__name__)


class EngineState:
    """Where an engine stands with respect to the job's weights."""

    PENDING = "pending"
    """Registered; holds no version from this job yet, so it is paused and must not serve."""
    SERVING = "serving"
    """Holds a complete version (`EngineRecord.version`) and serves it."""
    PAUSED = "paused"
    """Holds a complete version but is paused (a sync stopped before moving data, or died there)."""
    STALE = "stale"
    """A sync failed part-way; paused with a half-loaded state (no complete version) until the next complete sync."""
    JOINING = "joining"
    """Pulling the current version from a serving peer (`daemon.peer_joins`): out of service, left out of syncs."""


def state_from_health(health: Any, state: str = EngineState.PENDING) -> tuple[str, int | None] | None:
    """(state, complete version) as the engine itself reports it, or None if its health does not say.

    Engines report `version` only for weights they hold completely, so this is the truth after a
    trainer died mid-sync and no outcome was ever reported. A health that does not say both paused
    and stale (a vLLM handle's: its version only) says what a record in `state` serves, unless it
    says paused or stale, or the daemon itself found it so (a failed sync): such an answer cannot
    contradict that."""
    if not isinstance(health, dict) or "version" not in health:
        return None
    version = health["version"]
    if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
        return None
    if not {"paused", "stale"} <= set(health):
        if state in (EngineState.STALE, EngineState.PAUSED) or health.get("paused") or health.get("stale"):
            return None
        return (EngineState.SERVING if version is not None else EngineState.PENDING), version
    if health["stale"]:
        return EngineState.STALE, None
    if version is None:
        return EngineState.PENDING, None
    return (EngineState.PAUSED if health["paused"] else EngineState.SERVING), version


@dataclass
class EngineRecord:
    name: str
    engine: dict[str, Any]
    """The descriptor it registered with (kind + how to reach it)."""
    adapter: RolloutAdapter | None
    owned: bool
    """True when the daemon built the adapter from the descriptor (and so closes it)."""
    state: str = EngineState.PENDING
    version: int | None = None
    last_seen: float = field(default_factory=time.monotonic)
    health: dict[str, Any] | None = None
    health_error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "engine": dict(self.engine),
            "state": self.state,
            "version": self.version,
            "last_seen_s": round(time.monotonic() - self.last_seen, 3),
            "health": self.health if self.health_error is None else {"error": self.health_error},
        }


class Membership:
    """The live engines and the recently departed ones, behind one lock."""

    def __init__(self, max_departed: int = 64) -> None:
        self._lock = threading.Lock()
        self._records: dict[str, EngineRecord] = {}
        self.departed: dict[str, dict[str, Any]] = {}
        self._max_departed = max_departed
        self.epoch = 0

    def add(self, record: EngineRecord) -> EngineRecord | None:
        """Insert or replace (a restarted engine re-registers under its name); returns the replaced one."""
        with self._lock:
            old = self._records.get(record.name)
            self._records[record.name] = record
            self.departed.pop(record.name, None)
            self.epoch += 1
        if old is not None:
            logger.info("engine %s re-registered; its earlier registration is replaced", record.name)
        return old

    def remove(self, name: str, reason: str, adapter: RolloutAdapter | None = None) -> EngineRecord | None:
        """Drop `name` (only if it still has `adapter`, when given: a re-registered engine stays)."""
        with self._lock:
            rec = self._records.get(name)
            if rec is None or (adapter is not None and rec.adapter is not adapter):
                return None
            del self._records[name]
            self.departed[name] = {"reason": reason, "at": time.time(), "version": rec.version}
            while len(self.departed) > self._max_departed:
                self.departed.pop(next(iter(self.departed)))
            self.epoch += 1
        return rec

    def get(self, name: str) -> EngineRecord | None:
        with self._lock:
            return self._records.get(name)

    def records(self) -> list[EngineRecord]:
        with self._lock:
            return list(self._records.values())

    def names(self) -> list[str]:
        with self._lock:
            return list(self._records)

    def touch(self, name: str, health: dict[str, Any] | None = None) -> EngineRecord | None:
        with self._lock:
            rec = self._records.get(name)
            if rec is not None:
                rec.last_seen = time.monotonic()
                if health is not None:
                    rec.health, rec.health_error = health, None
            return rec

    def set_health_error(self, name: str, error: str) -> None:
        with self._lock:
            rec = self._records.get(name)
            if rec is not None:
                rec.health_error = error

    def silent_for(self, timeout_s: float) -> list[EngineRecord]:
        now = time.monotonic()
        with self._lock:
            return [r for r in self._records.values() if now - r.last_seen > timeout_s]

    def mark(self, records: Iterable[EngineRecord], state: str, version: int | None = None) -> None:
        """Set state (and version) of records that are still members under the same adapter."""
        with self._lock:
            for rec in records:
                if self._records.get(rec.name) is rec:
                    rec.state = state
                    if version is not None:
                        rec.version = version

    def set_state(self, rec: EngineRecord, state: str, version: int | None) -> bool:
        """Set exactly this state and version (None included); False if `rec` is no longer a member."""
        with self._lock:
            if self._records.get(rec.name) is not rec:
                return False
            changed = (rec.state, rec.version) != (state, version)
            rec.state, rec.version = state, version
        if changed:
            logger.info("engine %s is %s (version %s)", rec.name, state, version)
        return True

    def snapshot(self) -> list[dict[str, Any]]:
        with self._lock:
            return [r.to_dict() for r in self._records.values()]
