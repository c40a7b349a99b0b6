"""The job's version as one daemon knows it: adopted from its engines, advanced by its syncs.

Versions come from the engines: a daemon (or trainer) that starts fresh next to engines that
outlived the last one adopts the highest complete version they report, so its next sync carries
on from there instead of starting at 1 and being refused. A version labels one set of weights:
an explicit version equal to the current one is a catch-up, allowed only to the daemon that sent
that version (the trainer still holds the same weights); anyone else must pick a new one.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

from ckpt_engine.versions import MAX_VERSION, MAX_VERSION_STEP, check_version

__all__ = ["JobVersions"]

logger = logging.getLogger(__name__)


class JobVersions:
    """`current`: the highest complete version this job's engines hold (as far as this daemon
    knows); `sent`: the last version this daemon's own syncs completed (None: none yet)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.current = 0
        self.sent: int | None = None
        self.vouched = 0
        """The highest version a trusted party named: this daemon's own syncs, a trainer's report,
        the standalone daemon. Engines' reports are bounded by it (`adopt_health`)."""

    def adopt(self, version: int | None, source: str, *, trusted: bool = True, arriving: bool = False) -> None:
        """A trusted party (or, `trusted=False`, an engine: see `adopt_health`) reports `version`
        complete: the job is at least there."""
        if version is None:
            return
        if version >= MAX_VERSION:
            logger.warning("%s reports version %d, which leaves no room for another; not adopted", source, version)
            return
        with self._lock:
            if not trusted:
                limit = self.vouched + 1 if self.vouched and not arriving else max(self.current, self.vouched) + MAX_VERSION_STEP
                if version > limit:
                    logger.warning("%s reports version %d, past what this job issued (%d); not adopted", source, version, limit)
                    return
            else:
                self.vouched = max(self.vouched, version)
            if version > self.current:
                logger.info("adopting version %d from %s (was %d)", version, source, self.current)
                self.current = version

    def adopt_health(self, health: object, source: str, *, arriving: bool = False) -> None:
        """Adopt the newest version an engine's health names: the one it holds completely, or the
        last it ever finalized (`last_version`: a stale engine still says how far the job got).
        An engine's word is bounded: once this daemon knows the job's version from a trusted party,
        at most one past it (a sync of another daemon of the job in flight); before that (a fresh
        daemon next to engines that outlived the last one), and for an engine `arriving` (its
        registration: what it holds outlived an earlier daemon of the job, which may have gone further
        than this one: a job restarted whole, engines registering one by one), at most
        MAX_VERSION_STEP past. So no engine's report can freeze the job at 2**63-1, and an engine that
        comes back holding a later version than this daemon issued moves the job on instead of
        having every later sync refused as another trainer's."""
        if isinstance(health, dict):
            known = [v for v in (health.get("version"), health.get("last_version")) if isinstance(v, int) and not isinstance(v, bool)]
            self.adopt(max(known, default=None), source, trusted=False, arriving=arriving)

    def completed(self, version: int) -> None:
        """This daemon's sync of `version` completed."""
        with self._lock:
            self.current = max(self.current, version)
            self.sent, self.vouched = version, max(self.vouched, version)

    def target(self, requested: int | None, holders: Iterable[str]) -> tuple[int, bool]:
        """(version of the next sync, whether it is a catch-up); ValueError before anything pauses.

        `holders`: the engines known to hold the current version (named in the refusal)."""
        current = self.current
        if requested is None:
            return self._issue(check_version(current + 1, "the next version")), False
        floor = max(current, 1)
        check_version(requested, f"version (at least the current version {floor})", at_least=floor)
        if requested != current:
            return self._issue(requested), False
        if self.sent != current:
            names = ", ".join(map(repr, holders)) or "this job's engines"
            raise ValueError(
                f"version {requested} is what {names} already hold, and this daemon did not send it: a version labels one "
                f"set of weights, so a new sync needs a new one: pass version=None (next: {current + 1}) or a version > {current}"
            )
        return requested, True

    def _issue(self, version: int) -> int:
        """`version` is handed to a sync: engines may report it complete before the sync returns."""
        with self._lock:
            self.vouched = max(self.vouched, version)
        return version
