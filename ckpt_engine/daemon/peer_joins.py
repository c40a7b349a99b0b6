"""The daemon's side of elastic joins (issue 43 item 2, `ckpt_engine.elastic`): an engine that
registers mid-job without the job's current version pulls it from a serving member, in the
background, while the trainer and the other engines go on.

With `daemon.peer_join: true`, `register` hands the new record here (and the health monitor an
engine it finds restarted at its address, holding nothing); when a serving member holds
the current version and both can take part (`PeerJoinable`), the record is `joining` until the
pull ends (only a fresh process: one that never held a version and is in no group): syncs leave it out (its weights are the pull's), the health monitor does not take its
state from its health, and a trainer's report does not overwrite it. A completed pull makes it
`serving` at that version; a failed one (every peer failed) leaves it as its health says (stale or
pending, never serving), so the trainer's next sync or catch-up seeds it like any new engine.
"""

from __future__ import annotations

import logging
import threading

from ckpt_engine.daemon.membership import EngineRecord, EngineState, Membership, state_from_health
from ckpt_engine.elastic import PeerJoinError, PeerJoinable, join_from_peer

__all__ = ["PeerJoins"]

logger = logging.getLogger(__name__)


_FRESH_KEYS = ("version", "last_version", "stale", "receiving", "group")


def fresh(rec: EngineRecord) -> bool:
    """Whether an engine is a fresh process: it never held a version, is in no weight-sync group
    and no sync is loading into it. Only such an engine joins from a peer: one a trainer's sync is
    in the middle of (paused, stale, received and not yet finalized) is the sync's. An engine whose
    health says all of that (the reference receiver) is judged by it; one whose health does not (a
    vLLM handle's: its version only) by its workers' versions and groups (`membership()`: a worker
    in no group is in no sync)."""
    health = rec.health
    if health is None or rec.adapter is None or health.get("version") is not None:
        return False
    if all(k in health for k in _FRESH_KEYS):
        return all(health.get(k) in (None, False) for k in _FRESH_KEYS)
    try:
        held = rec.adapter.membership()
    except Exception as exc:  # asked again at its next health probe
        logger.warning("engine %s: could not ask its workers whether it is a fresh process: %s", rec.name, exc)
        return False
    return held.version is None and held.groups is not None and all(g is None for g in held.groups)


class PeerJoins:
    """The joins in flight (one thread each), bounded by `timeout_s` per peer tried."""

    def __init__(self, enabled: bool, timeout_s: float) -> None:
        self.enabled = enabled
        self.timeout_s = timeout_s
        self._threads: dict[str, threading.Thread] = {}
        self._failed: set[tuple[str, int, int]] = set()
        """(engine, id of its handle, version) of failed joins: not retried until the engine registers
        again (a new handle) or the job moves to another version."""
        self.last: dict[str, dict[str, object]] = {}
        """Engine -> its last join (the report, or the error), for status."""

    def start(self, rec: EngineRecord, membership: Membership, version: int) -> bool:
        """Start a join of `rec` at `version` if it lacks it and a serving member can give it."""
        if not self.enabled or not isinstance(rec.adapter, PeerJoinable) or version == 0:
            return False
        if (rec.name, id(rec.adapter), version) in self._failed:
            return False
        peers = [
            r.adapter for r in membership.records()
            if r is not rec and r.state == EngineState.SERVING and r.version == version and isinstance(r.adapter, PeerJoinable)
        ]
        if not peers or not fresh(rec) or not membership.set_state(rec, EngineState.JOINING, None):
            return False
        t = threading.Thread(target=self._run, args=(rec, peers, membership, version), name=f"ckpt-join-{rec.name}", daemon=True)
        self._threads[rec.name] = t
        t.start()
        return True

    def _run(self, rec: EngineRecord, peers: list, membership: Membership, version: int) -> None:
        assert rec.adapter is not None
        try:
            report = join_from_peer(rec.adapter, peers, version=version, timeout_s=self.timeout_s)
        except (PeerJoinError, ValueError) as exc:
            logger.warning("engine %s: no peer join (%s); the trainer's next sync seeds it", rec.name, exc)
            self.last[rec.name] = {"ok": False, "version": version, "error": str(exc)}
            self._failed.add((rec.name, id(rec.adapter), version))
            try:
                found = state_from_health(rec.adapter.health())
            except Exception as probe:
                logger.warning("engine %s: health probe after a failed join: %s", rec.name, probe)
                found = None
            membership.set_state(rec, *(found if found is not None else (EngineState.STALE, None)))
            return
        self.last[rec.name] = {"ok": True, **report.to_dict()}
        membership.set_state(rec, EngineState.SERVING, version)

    def close(self, timeout_s: float) -> None:
        for t in list(self._threads.values()):
            t.join(timeout_s)
