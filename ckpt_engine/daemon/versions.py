"""The job's version as one daemon knows it: adopted from its engines, advanced by its syncs.

Versions come from the engines: a daemon (or trainer) that starts fresh next to engines that
outlived the last one adopts the highest complete version they report, so its next sync carries
on from there instead of starting at 1 and being refused. A version labels one set of weights:
an explicit version equal to the current one is a catch-up, allowed only to the daemon that sent
that version (the trainer still holds the same weights); anyone else must pick a new one.

A job restarted whole (daemon and trainer killed, engines restarted) would find no engine holding
its last version until that engine registers, and issue versions again from 1. With
`daemon.state_file` the daemon writes the highest version it handed out or heard of (from a
trainer's report or an engine) there (replaced whole, so a killed daemon leaves the old file or the
new one) and starts from it.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import tempfile
import threading
from collections.abc import Iterable
from pathlib import Path

from ckpt_engine.versions import MAX_VERSION, MAX_VERSION_STEP, check_step, check_version

__all__ = ["JobVersions"]

logger = logging.getLogger(__name__)


class JobVersions:
    """`current`: the highest complete version this job's engines hold (as far as this daemon
    knows); `sent`: the last version this daemon's own syncs completed (None: none yet)."""

    def __init__(self, state_file: str | None = None) -> None:
        self._lock = threading.Lock()
        self.current = 0
        self.sent: int | None = None
        self.vouched = 0
        """The highest version a trusted party named: this daemon's own syncs, a trainer's report,
        the standalone daemon. Engines' reports are bounded by it (`adopt_health`)."""
        self._state = Path(state_file) if state_file is not None else None
        self._saved = 0
        if self._state is not None:
            self.current = self.vouched = self._saved = _read_state(self._state)
            if self.current:
                logger.info("version %d from %s: the next sync of this job is past it", self.current, self._state)

    def _save(self) -> None:
        """The highest version issued, vouched for or adopted to the state file when it grew (under
        the lock): one an engine reported (a trainer's sync `serve` heard of only from its engines)
        is the job's too. A write that fails is logged: the job goes on, and the restart it guards
        against falls back to what engines report.

        Another process may write the same file (a trainer given `serve`'s configuration): each
        write holds an flock on `<file>.lock`, keeps a higher version found there, and goes through
        a temporary file of its own, so the file never goes down and is never half written."""
        high = max(self.vouched, self.current)
        if self._state is None or high <= self._saved:
            return
        try:
            with open(self._state.with_name(self._state.name + ".lock"), "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
                high = max(high, _read_state(self._state, quiet=True))
                fd, tmp = tempfile.mkstemp(dir=self._state.parent, prefix=self._state.name + ".", suffix=".tmp")
                with os.fdopen(fd, "w") as f:
                    f.write(json.dumps({"version": high}))
                os.replace(tmp, self._state)
            self._saved = high
        except (OSError, ValueError) as exc:  # ValueError: its folder is gone
            logger.error("could not write version %d to %s: %s", high, self._state, exc)

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
            self._save()

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
            self._save()

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

    def reserve(self, version: int, source: str) -> None:
        """`source` (a trainer following this daemon) is about to sync `version`: kept as issued (and
        in the state file) before any engine can hold it, so a job stopped whole before the trainer
        reports, or before this daemon hears of it from the engines, never issues it again.
        ValueError for a version below the current one or past the step bound."""
        self.check_reported(version, "version")
        self._issue(version)
        logger.debug("version %d reserved by %s", version, source)

    def check_reported(self, version: int, what: str) -> None:
        """ValueError unless `version`, named by a trainer, is at least the current one and within the step bound."""
        if version < self.current:
            raise ValueError(f"{what} {version} is older than the current version {self.current}; versions never go down")
        check_step(version, self.current, what)

    def _issue(self, version: int) -> int:
        """`version` is handed to a sync: engines may report it complete before the sync returns."""
        with self._lock:
            self.vouched = max(self.vouched, version)
            self._save()
        return version


def _read_state(path: Path, quiet: bool = False) -> int:
    """The version a state file holds (0 when there is none yet); a file that is not one is refused
    by name (`quiet`: read as 0, the file is about to be replaced)."""
    if not path.parent.is_dir():
        raise ValueError(f"daemon.state_file: folder {str(path.parent)!r} does not exist")
    if not path.exists():
        return 0
    try:
        version = json.loads(path.read_text()).get("version")
    except (OSError, ValueError, AttributeError) as exc:
        if quiet:
            return 0
        raise ValueError(f"daemon.state_file {str(path)!r} is not a version file this daemon wrote ({type(exc).__name__}: {exc})") from None
    if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version < MAX_VERSION:
        if quiet:
            return 0
        raise ValueError(f"daemon.state_file {str(path)!r} holds version {version!r}, not a version this daemon writes")
    return version
