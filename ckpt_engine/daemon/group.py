"""The daemon's weight-sync group: one WeightSyncSession for exactly the current members.

The group (rendezvous, process group, buffers) is expensive to build, so it is kept while the
member set is unchanged and rebuilt when it changes. Before a rebuild every member is probed:
a dead member would make every other rank wait for it at the rendezvous until the timeout,
while a probe answers (or is refused) within seconds.
"""

from __future__ import annotations

import gc
import logging
import threading
import time

from ckpt_engine.config import CheckpointEngineConfig
from ckpt_engine.daemon.membership import EngineRecord, Membership
from ckpt_engine.manifest import BucketManifest
from ckpt_engine.sync.api import WeightSyncSession

__all__ = ["GroupKeeper", "probe_members"]

logger = logging.getLogger(__name__)

_Key = tuple[tuple[str, int], ...]


def _key(members: list[EngineRecord]) -> _Key:
    return tuple((r.name, id(r.adapter)) for r in members)


class GroupKeeper:
    """Holds the session of the last member set; `session_for` rebuilds it when the set changed."""

    def __init__(self, config: CheckpointEngineConfig, rendezvous_host: str) -> None:
        self.config = config
        self.rendezvous_host = rendezvous_host
        self._session: WeightSyncSession | None = None
        self._key: _Key | None = None

    def stands_for(self, members: list[EngineRecord]) -> bool:
        return self._session is not None and _key(members) == self._key

    @property
    def manifest(self) -> BucketManifest | None:
        return self._session.manifest if self._session is not None else None

    def session_for(self, members: list[EngineRecord], sent: int | None = None) -> WeightSyncSession:
        """The session for exactly `members`, carrying on from `sent`: the last version this daemon
        sent, or the one a failed attempt of the same sync may have finalized (so that a catch-up or
        a retry may repeat it, and no version goes back)."""
        key = _key(members)
        if self._session is not None and key == self._key:
            self._session.version = max(self._session.version, sent or 0)
            return self._session
        self.close(keep=set(key))
        gc.collect()  # a broken group's sockets close only when it is freed; survivors then stop waiting
        adapters = [r.adapter for r in members if r.adapter is not None]
        self._session = WeightSyncSession(adapters, self.config, host=self.rendezvous_host)
        self._session.version = sent or 0
        self._key = key
        logger.info("weight-sync group rebuilt for %d engine(s): %s", len(adapters), ", ".join(r.name for r in members))
        return self._session

    def rebind(self, members: list[EngineRecord]) -> None:
        """New handles (re-registered) on the group's engines, same names and engines in order:
        the group drives them, keeping its plan, version and delta bases; else it is left as it is."""
        if self._session is None:
            return
        try:
            self._session.rebind([r.adapter for r in members if r.adapter is not None])
        except (ValueError, RuntimeError):  # another set of engines: the next sync rebuilds the group
            return
        self._key = _key(members)

    def rebuild_next(self) -> None:
        """Build a fresh group at the next sync (its members leave the current one now).

        Used when a member is not serving: it may have joined another sender's group since (a
        trainer that died mid-sync), and the cached group would stream into a group it left."""
        self.close(keep=set(self._key or ()))

    def close(self, keep: set[tuple[str, int]] | None = None) -> None:
        session, self._session, self._key = self._session, None, None
        if session is None:
            return
        # Only engines still members are asked to leave: a dead one would make close() wait on it.
        session.rollouts = [r for r in session.rollouts if keep is None or (r.name, id(r)) in keep]
        try:
            session.close()
        except Exception as exc:
            logger.warning("closing the previous weight-sync session: %s", exc)


def probe_members(members: list[EngineRecord], membership: Membership, timeout_s: float) -> dict[str, str]:
    """Probe every member in parallel within `timeout_s`; the errors of those that did not answer."""
    errors: dict[str, str] = {}

    def probe(rec: EngineRecord) -> None:
        try:
            assert rec.adapter is not None
            membership.touch(rec.name, rec.adapter.health())
        except Exception as exc:
            errors[rec.name] = f"{type(exc).__name__}: {exc}"[:300]

    threads = [threading.Thread(target=probe, args=(r,), daemon=True) for r in members]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t, r in zip(threads, members):
        t.join(max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            errors.setdefault(r.name, "no answer to a health probe")
    return errors
