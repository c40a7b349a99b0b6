"""After a failed sync attempt: who to blame, and what a closing daemon leaves serving.

Blame only the dead. A failure names the engines whose calls failed, but behind one engine that
restarted at its address every other receiver fails too (the sender stops streaming to them).
So each named engine is probed first: only one that does not answer is dropped; when every named
engine answers, the group is rebuilt and the same version is pushed again once, which re-seeds a
restarted engine and keeps the healthy ones.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ckpt_engine.daemon.group import GroupKeeper, probe_members
from ckpt_engine.daemon.membership import EngineRecord, EngineState, Membership, state_from_health
from ckpt_engine.daemon.outcome import MOVED_DATA, SyncOutcome, drop_tracebacks
from ckpt_engine.rollout_adapters.base import ManifestRejectedError
from ckpt_engine.sync.api import SyncError
from ckpt_engine.versions import VersionConflictError

__all__ = ["after_failed_attempt", "changed_members", "registered_during", "resume_held"]

logger = logging.getLogger(__name__)

Drop = Callable[[EngineRecord, str], bool]


def after_failed_attempt(
    exc: Exception, members: list[EngineRecord], outcome: SyncOutcome, attempt: int, membership: Membership, drop: Drop, probe_s: float
) -> bool:
    """An engine (or the sender's side) failed; drop the dead and say whether to try again."""
    if isinstance(exc, VersionConflictError):
        return _moved_on(exc, outcome, attempt)
    if not isinstance(exc, (ManifestRejectedError, SyncError)):
        raise exc
    if isinstance(exc, ManifestRejectedError):
        return _rejected(exc, members, outcome, attempt, drop)
    stage, failed = exc.stage, dict(exc.failed)
    drop_tracebacks(exc)
    entry = {"attempt": attempt, "stage": stage, "failed": failed}
    outcome.attempts.append(entry)
    named = [r for r in members if r.name in failed]
    dead = probe_members(named, membership, probe_s) if named else {}  # check health before blaming
    lost = [r for r in named if r.name in dead]
    survivors = [r for r in members if r.name not in dead]
    if stage in MOVED_DATA:
        for r in survivors:  # what they hold is unknown until the next complete sync
            membership.set_state(r, EngineState.STALE, None)
    for r in lost:
        why = f"engine {r.name!r} failed during {stage}: {failed[r.name]}; it does not answer a health probe ({dead[r.name]})"
        outcome.dropped[r.name] = why
        drop(r, why)
    if not named:
        outcome.error = f"sync failed during {stage} on the sender side: {failed}"
        return False
    if not lost:
        if any("kept" in a for a in outcome.attempts[:-1]):
            outcome.error = f"sync failed during {stage} again, and every engine it named answers a health probe: {failed}"
            return False
        entry["kept"] = sorted(r.name for r in named)
        logger.warning(
            "sync v%d failed during %s, but every engine it named answers a health probe (one restarted?): "
            "rebuilding the group and pushing the version again", outcome.version, stage,
        )
        return True
    if not survivors:
        outcome.error = "every engine failed"
        return False
    logger.warning("sync v%d: dropped %s during %s; re-syncing %d survivor(s)", outcome.version, ", ".join(r.name for r in lost), stage, len(survivors))
    return True


def _moved_on(exc: VersionConflictError, outcome: SyncOutcome, attempt: int) -> bool:
    """The engines hold a version this daemon did not issue, at or past this sync's: another
    trainer drives them under the same job token (two daemons of one job). Nothing was paused;
    the sync ends here, naming what happened and what to do, instead of a raw version refusal."""
    held = ", ".join(f"{n}: v{v}" for n, v in sorted(exc.ahead.items()))
    outcome.attempts.append({"attempt": attempt, "stage": "validate", "failed": {n: f"holds v{v}" for n, v in exc.ahead.items()}})
    outcome.error = (
        f"sync v{outcome.version} refused at attempt {attempt + 1}: the engines hold {held}, which this trainer's daemon "
        "did not push: another trainer is syncing the same engines under the same job token. Run one trainer per job "
        "token (each job its own token and engines), or let one trainer drive the syncs; nothing was paused and the "
        "engines keep what they hold"
    )
    logger.warning("%s", outcome.error)
    return False


def changed_members(members: list[EngineRecord], membership: Membership, probe_s: float) -> list[str]:
    """Members that do not answer a probe, or whose own report differs from their record (an
    engine restarted at its address says it holds nothing): a standing group is stale for them.
    One health call per member, in parallel, before each sync through a standing group."""
    errors = probe_members(members, membership, probe_s)
    changed = sorted(errors)
    for rec in members:
        found = state_from_health(rec.health, rec.state) if rec.name not in errors else None
        if found is not None and found != (rec.state, rec.version):
            changed.append(rec.name)
            membership.set_state(rec, *found)
    if changed:
        logger.warning("engine(s) %s changed since the last sync (restarted?): the weight-sync group is rebuilt", ", ".join(changed))
    return changed


def _rejected(exc: ManifestRejectedError, members: list[EngineRecord], outcome: SyncOutcome, attempt: int, drop: Drop) -> bool:
    names = set(exc.engines)
    rejecting = [r for r in members if r.name in names]
    outcome.attempts.append({"attempt": attempt, "stage": "validate", "failed": {r.name: "rejected the manifest" for r in rejecting}})
    for r in rejecting:
        outcome.rejected[r.name] = [str(p) for p in exc.problems[:20]]
    if not rejecting or len(rejecting) == len(members):
        outcome.error = str(exc)
        raise exc
    for r in rejecting:
        outcome.dropped[r.name] = f"engine {r.name!r} rejected the manifest: {'; '.join(exc.problems[:3])}"
        drop(r, outcome.dropped[r.name])
    return True  # nothing moved; the others still hold their version


def resume_held(records: list[EngineRecord]) -> None:
    """Resume every engine that is paused but holds a complete version (a closing daemon leaves
    no engine paused that could serve); a stale one stays paused until a complete sync."""
    for rec in records:
        if rec.adapter is None:
            continue
        try:
            health = rec.adapter.health()
            if isinstance(health, dict) and health.get("paused") and not health.get("stale") and health.get("version") is not None:
                rec.adapter.resume()
                logger.info("engine %s resumed serving version %s as the daemon closes", rec.name, health["version"])
        except Exception as exc:
            logger.warning("engine %s: could not resume it as the daemon closes: %s", rec.name, exc)


def registered_during(members: list[EngineRecord], membership: Membership, groups: GroupKeeper) -> None:
    """After a completed sync, engines that registered again while it ran: the new record took what
    the engine said mid-sync (stale). The new handle of the same engine takes the old one's place in
    the group (its delta bases stay), and the engine's own word now sets its state: one that holds
    this sync's version serves it, no seed; any other is seeded by the next sync."""
    now = [membership.get(r.name) or r for r in members]
    again = [(new, new.adapter) for old, new in zip(members, now) if new is not old and new.adapter is not None and new.state != EngineState.JOINING]
    if not again:
        return
    groups.rebind(now)
    for rec, adapter in again:
        try:
            health = adapter.health()
        except Exception:  # the next sync's probe finds out
            continue
        membership.touch(rec.name, health)
        found = state_from_health(health, rec.state)
        if found is not None:
            membership.set_state(rec, *found)
