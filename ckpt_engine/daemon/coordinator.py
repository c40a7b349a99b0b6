"""WeightSyncDaemon: membership, versions, health and fault recovery around WeightSyncSession.

Three ways to run it, one class:

- **Embedded** (the main path): trainer rank 0 owns a `WeightSyncDaemon`; engines register with it
  (in-process adapters, or descriptors after `serve()`); `sync(source)` moves the weights.
- **Standalone** (`ckpt-engine serve`, `role="standalone"`): the job's membership authority. It
  keeps engines (register / leave / heartbeat / health probes), the current version and the last
  sync report, and answers `ckpt-engine status`; it holds no weights and never syncs itself.
- **Trainer following a standalone daemon** (`upstream=DaemonClient(...)`): before each sync the
  trainer's daemon mirrors the standalone daemon's member list (building adapters from the
  descriptors), drives the sync locally, and reports the outcome back (`report_sync`), so the
  standalone daemon's versions, drops and status stay current.

Fault handling in `sync()`: an engine named by a failed sync that does not answer a health probe
(died, hung) or rejected the manifest is dropped from the membership, the broken group is torn
down, the group is rebuilt from the survivors and the same version is pushed again, up to
`daemon.max_resync_attempts` times; when every named engine answers (one restarted), nobody is
dropped and the version is pushed again once (`daemon.recovery`). A weight source that raises is
the source's fault: the outcome names the source and its exception, no engine is dropped, and
engines that received part of the version stay paused and stale. The caller gets a `SyncOutcome`
saying what happened; nothing waits past the configured timeouts. Engines that lack the current
version (new, returning or stale) are listed by `pending()` until a sync covers them. Between
syncs the health monitor takes each engine's own report of its state, so status stays truthful
after a trainer died mid-sync. Engines belong to one job's group at a time (`daemon.ownership`).

Restarts: registration pauses nothing; a fresh daemon adopts its engines' versions
(`daemon.versions`); an engine restarted at its address is noticed before the next sync (a
standing group is kept only while every member says what the daemon knows of it) and seeded;
`close()` resumes every engine left paused that holds a complete version; a trainer following a
restarted `ckpt-engine serve` keeps syncing the engines it knows until they register again.

Collective contract with a sharded trainer: every attempt walks the source exactly once on the
sender (or, when every rank sends, makes the two announcements the other ranks follow; see
`daemon.senders`), then the sender calls `walk_barrier(again)`; the other ranks learn from it
whether another attempt follows (see `ckpt_engine.trainer.loop.follow_sync`).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ckpt_engine.config import CheckpointEngineConfig
from ckpt_engine.control.wire import RpcError, WireError
from ckpt_engine.daemon.adapters import close_in_background, close_quietly, make_adapter
from ckpt_engine.daemon.config import DaemonConfig
from ckpt_engine.daemon.group import GroupKeeper, probe_members
from ckpt_engine.daemon.membership import EngineRecord, EngineState, Membership, state_from_health
from ckpt_engine.daemon.outcome import OneWalkPerAttempt, SyncOutcome, WalkBarrier, blame_source, reported, summarize
from ckpt_engine.daemon.ownership import claim_engine, describe, job_group, refusal, release_engine
from ckpt_engine.daemon.peer_joins import PeerJoins
from ckpt_engine.daemon.recovery import after_failed_attempt, changed_members, registered_during, resume_held
from ckpt_engine.daemon.senders import ShardedWalk, sends_from_every_rank
from ckpt_engine.daemon.upstream import mirror_upstream
from ckpt_engine.daemon.protocol import PROTOCOL_VERSION, ProtocolError, check_engine_descriptor, check_engine_name, check_outcome
from ckpt_engine.daemon.server import DaemonServer
from ckpt_engine.daemon.versions import JobVersions
from ckpt_engine.daemon.weights import check_engine_weights, check_sync_weights
from ckpt_engine.manifest import BucketManifest
from ckpt_engine.rollout_adapters.base import RolloutAdapter
from ckpt_engine.sources.base import WeightSource
from ckpt_engine.sources.sharded import ShardedWeightSource

if TYPE_CHECKING:
    from ckpt_engine.daemon.client import DaemonClient

__all__ = ["SyncOutcome", "WeightSyncDaemon"]

logger = logging.getLogger(__name__)

class WeightSyncDaemon:
    """Membership, versions and fault recovery of one job's weight-sync group; see the module docstring."""

    def __init__(
        self,
        config: CheckpointEngineConfig | None = None,
        daemon_config: DaemonConfig | None = None,
        *,
        token: str | None = None,
        role: str = "embedded",
        upstream: DaemonClient | None = None,
        rendezvous_host: str = "127.0.0.1",
    ) -> None:
        if role not in ("embedded", "standalone"):
            raise ValueError(f"role must be 'embedded' or 'standalone', got {role!r}")
        if role == "standalone" and upstream is not None:
            raise ValueError("a standalone daemon is the membership authority; it cannot follow an upstream daemon")
        self.config = config if config is not None else CheckpointEngineConfig()
        self.daemon_config = daemon_config if daemon_config is not None else DaemonConfig()
        if role == "embedded":
            self.config.check_memory()  # the sender's buffers live here: refuse what cannot fit, before any join
        self.token = token if token is not None else secrets.token_hex(16)
        if not isinstance(self.token, str) or len(self.token) < 8:
            raise ValueError("the job token must be a string of at least 8 characters")
        self.role = role
        self.upstream = upstream
        self.rendezvous_host = rendezvous_host
        self.group = job_group(self.token)
        """This job's weight-sync group id, the same for every daemon of the job (see ownership)."""
        self.membership = Membership()
        self.versions = JobVersions(self.daemon_config.state_file)
        self.manifest: BucketManifest | None = None
        self.last_outcome: dict[str, Any] | None = None
        self.history: deque[dict[str, Any]] = deque(maxlen=32)
        self.started_at = time.time()
        self._state_lock = threading.Lock()
        self._sync_lock = threading.Lock()
        self._generation = 0
        """Bumped by every recorded sync; a health probe older than the last one is not applied."""
        self._groups = GroupKeeper(self.config, rendezvous_host)
        self.joins = PeerJoins(self.daemon_config.peer_join and upstream is None, self.config.timeout_s)  # engines joining from a serving peer
        self._stop = threading.Event()
        self._monitor: threading.Thread | None = None
        self.server: DaemonServer | None = None

    # --- membership ---------------------------------------------------------------------------
    def register(self, name: str, engine: Mapping[str, Any] | RolloutAdapter) -> dict[str, Any]:
        """Add an engine (a descriptor to build an adapter from, or an in-process adapter).

        The engine is probed and claimed, and nothing is paused: it keeps serving what it holds
        until a sync starts. A complete version it holds is adopted as the job's (a daemon that
        starts fresh carries on from what its engines hold); one that holds none is pending until
        a sync covers it (the next one, or a catch-up the trainer starts when `pending()` is non-empty).
        """
        check_engine_name(name)
        if self.upstream is not None:
            if isinstance(engine, RolloutAdapter):
                raise ValueError("a trainer following a standalone daemon registers engines by descriptor")
            return self.upstream.register(name, dict(engine))
        if isinstance(engine, RolloutAdapter):
            adapter, descriptor, owned = engine, {"kind": "in_process", "class": type(engine).__name__}, False
            if engine.name != name:
                raise ValueError(f"adapter is named {engine.name!r} but registers as {name!r}")
        else:
            descriptor = check_engine_descriptor(dict(engine))
            adapter, owned = make_adapter(name, descriptor, self.config.timeout_s, token=self.token), True
        check_engine_weights(name, describe(descriptor), adapter, self.config.weights, owned)  # before it is probed or claimed
        try:
            health = adapter.health()
            claim_engine(adapter, self.group, self.daemon_config.engine_lease_s)
        except Exception as exc:
            if owned:
                close_quietly(adapter)
            raise ValueError(refusal(name, describe(descriptor), exc)) from None
        record = EngineRecord(name=name, engine=descriptor, adapter=adapter, owned=owned, health=health)
        found = state_from_health(health)
        if found is not None:  # what it holds, as it says: a complete version is the job's too
            record.state, record.version = found
        self.versions.adopt_health(health, f"engine {name}", arriving=True)
        old = self.membership.add(record)
        if old is not None and old.adapter is not None and old.adapter is not adapter:
            close_in_background(old.adapter, close=old.owned, release=False)
        self.joins.start(record, self.membership, self.version)  # daemon.peer_join: pull the current version from a peer
        logger.info("engine %s registered (%s): %s, version %s", name, describe(descriptor), record.state, record.version)
        return record.to_dict()

    def leave(self, name: str) -> bool:
        """Remove an engine between syncs (it asked to go); the group is rebuilt without it."""
        check_engine_name(name)
        if self.upstream is not None:
            return bool(self.upstream.leave(name)["left"])
        rec = self.membership.get(name)
        return rec is not None and self._drop(rec, "left")

    def heartbeat(self, name: str) -> dict[str, Any]:
        check_engine_name(name)
        rec = self.membership.touch(name)
        if rec is None:
            raise ValueError(f"engine {name!r} is not registered (dropped or never joined); register it again")
        return {"version": self.version, "state": rec.state}

    def pending(self) -> list[str]:
        """Engines that do not hold the current version completely (new, returning, stale)."""
        self._pull_upstream()  # a no-op without an upstream daemon
        return [r.name for r in self.membership.records() if r.state != EngineState.SERVING or r.version != self.version]

    def hello(self) -> dict[str, Any]:
        return {
            "protocol": PROTOCOL_VERSION, "role": self.role, "version": self.version, "epoch": self.membership.epoch, "group": self.group, "weights": self.config.weights,
        }

    def members(self) -> dict[str, Any]:
        return {"epoch": self.membership.epoch, "version": self.version, "group": self.group, "engines": self.membership.snapshot()}

    def status(self) -> dict[str, Any]:
        manifest = self.manifest
        return {
            "role": self.role,
            "group": self.group,
            "address": self.address,
            "version": self.version,
            "epoch": self.membership.epoch,
            "uptime_s": round(time.time() - self.started_at, 1),
            "engines": self.membership.snapshot(),
            "departed": {k: dict(v) for k, v in self.membership.departed.items()},
            "manifest": None if manifest is None else {
                "digest": manifest.digest, "tensors": manifest.num_tensors, "buckets": manifest.num_buckets, "bytes": manifest.total_bytes, "bucket_size_bytes": manifest.bucket_size_bytes,
            },
            "peer_joins": dict(self.joins.last),
            "last_sync": self.last_outcome,
            "history": list(self.history),
        }

    @property
    def address(self) -> str | None:
        return f"{self.server.host}:{self.server.port}" if self.server is not None else None

    @property
    def version(self) -> int:
        """The job's current version: the highest complete version its engines hold, as far as known."""
        return self.versions.current

    def _drop(self, rec: EngineRecord, reason: str) -> bool:
        removed = self.membership.remove(rec.name, reason, adapter=rec.adapter)
        if removed is None:
            return False
        logger.warning("engine %s dropped from the weight-sync group: %s", rec.name, reason)
        if removed.adapter is not None:
            close_in_background(removed.adapter, close=removed.owned, release=self.upstream is None)
        return True

    # --- health -------------------------------------------------------------------------------
    def start_monitor(self) -> None:
        """Probe every engine each `health_interval_s`; drop those silent past `heartbeat_timeout_s`."""
        if self._monitor is not None:
            return
        self._monitor = threading.Thread(target=self._monitor_loop, name="ckpt-daemon-monitor", daemon=True)
        self._monitor.start()

    def _monitor_loop(self) -> None:
        while not self._stop.wait(self.daemon_config.health_interval_s):
            try:
                self.check_health()
            except Exception:
                logger.exception("health monitor pass failed")

    def check_health(self) -> None:
        """One monitor pass: a health answer counts as a heartbeat, and says the engine's state.

        While no sync runs here, each engine's own report (paused, stale, complete version) is
        taken as its state: after a trainer died mid-sync nobody reports an outcome, and the
        engines are the only ones who know they are paused and stale."""
        generation = self._generation
        for rec in self.membership.records():
            if rec.adapter is None:
                continue
            try:
                health = rec.adapter.health()
            except Exception as exc:
                self.membership.set_health_error(rec.name, f"{type(exc).__name__}: {exc}"[:300])
                continue
            self.membership.touch(rec.name, health)
            found = state_from_health(health, rec.state)
            if found is not None and not self._sync_lock.locked() and generation == self._generation and rec.state != EngineState.JOINING:
                self.membership.set_state(rec, *found)
                self.joins.start(rec, self.membership, self.version)  # restarted at its address: a peer join (daemon.peer_join)
            self.versions.adopt_health(health, f"engine {rec.name}")
        timeout = self.daemon_config.heartbeat_timeout_s
        if timeout > 0:
            for rec in self.membership.silent_for(timeout):
                self._drop(rec, f"no heartbeat or health answer for {timeout:g}s")

    # --- syncing ------------------------------------------------------------------------------
    def many_senders(self, source: WeightSource) -> bool:
        """Whether a sync of `source` now would stream from every trainer rank (see daemon.senders)."""
        return sends_from_every_rank(self.config, source, [r.adapter for r in self.membership.records() if r.adapter is not None])

    def sync(
        self, source: WeightSource, *, version: int | None = None, walk_barrier: WalkBarrier | None = None, many_senders: bool | None = None
    ) -> SyncOutcome:
        """Move `source`'s weights into every member as `version` (default: current + 1, where the
        current version is the highest its engines hold). `many_senders`: the trainer's decision,
        told to its other ranks (None: `many_senders()`). A version below the current one, or equal
        to it when this daemon did not send it, is refused before anything pauses.

        `version` equal to the current version is a catch-up: only valid while `source` still
        holds exactly that version (e.g. the trainer has not stepped since the last sync).
        Returns the outcome; raises ManifestRejectedError only when every engine rejected the
        manifest (the trainer's weights do not fit the engines: nothing moved anywhere).
        """
        if self.role == "standalone":
            raise RuntimeError(
                "a standalone daemon holds no weights; the trainer drives syncs with "
                "WeightSyncDaemon(upstream=DaemonClient(address, token)).sync(source)"
            )
        with self._sync_lock:
            self._pull_upstream()
            check_sync_weights(self.config.weights, source, [r.adapter for r in self.membership.records() if r.adapter is not None], self.upstream)
            holders = [r.name for r in self.membership.records() if r.version == self.version]
            target, repeat = self.versions.target(version, holders)
            if self.upstream is not None and not repeat:  # kept there before any engine can hold it
                try:
                    self.upstream.begin_sync(target)
                except (OSError, WireError, RpcError) as exc:  # down or restarting: it learns the version from the report or its engines
                    logger.warning("could not tell the daemon at %s that v%d begins: %s", self.upstream.address, target, exc)
            outcome = SyncOutcome(version=target, catch_up=repeat, descriptors={r.name: dict(r.engine) for r in self.membership.records()})
            many = self.many_senders(source) if many_senders is None else many_senders
            walker = OneWalkPerAttempt(source)
            if many:
                if not isinstance(source, ShardedWeightSource):
                    raise ValueError(f"many_senders=True needs a ShardedWeightSource, got {type(source).__name__}")
                walker = ShardedWalk(source, self.config.timeout_s)
            t0 = time.perf_counter()
            # one attempt: join + validate + pause + transfer (+ grace) + finalize + resume, each bounded
            deadline = time.monotonic() + (self.daemon_config.max_resync_attempts + 1) * 6 * self.config.timeout_s
            attempt = 0
            try:
                while True:
                    walker.begin()
                    again = False
                    try:
                        members = [r for r in self.membership.records() if r.state != EngineState.JOINING]  # a join's weights are its pull's
                        if not members:
                            outcome.error = "no engines are registered"
                        else:
                            again = self._attempt(walker, members, target, outcome, attempt)
                    finally:
                        walker.finish()
                        if again and attempt >= self.daemon_config.max_resync_attempts:
                            outcome.error = f"gave up after {attempt + 1} attempts (daemon.max_resync_attempts={self.daemon_config.max_resync_attempts})"
                            again = False
                        elif again and time.monotonic() > deadline:
                            outcome.error = "gave up re-syncing: the sync deadline passed"
                            again = False
                        if walk_barrier is not None:
                            walk_barrier(again)
                    if not again:
                        break
                    attempt += 1
            except BaseException as exc:
                outcome.error = outcome.error or f"{type(exc).__name__}: {exc}"  # the log names what raised
                raise
            finally:
                outcome.seconds = time.perf_counter() - t0
                self._finish(outcome)
            return outcome

    def catch_up(self, source: WeightSource) -> SyncOutcome | None:
        """Push the current version again when an engine waits for it (see `sync` for the caveat)."""
        if not self.pending() or self.version == 0:
            return None
        same = self.versions.sent == self.version  # else another trainer sent it: a new version
        return self.sync(source, version=self.version if same else None)

    def _attempt(self, walker: OneWalkPerAttempt, members: list[EngineRecord], target: int, outcome: SyncOutcome, attempt: int) -> bool:
        """One try with the current members; returns whether to try again (engines were dropped)."""
        members = self._prune_unreachable(members, outcome, attempt)
        if not members:
            outcome.error = "no registered engine is reachable"
            return False
        try:
            # a retry walks the same weights: engines finalized by an attempt that got past the pause take `target` again
            session = self._groups.session_for(members, sent=max(self.versions.sent or 0, target) if outcome.stamped() else self.versions.sent)
            report = session.sync(walker, version=target)
        except Exception as exc:
            if walker.error is None:
                return after_failed_attempt(exc, members, outcome, attempt, self.membership, self._drop, min(self.config.timeout_s, 10.0))
            blame_source(walker, exc, members, self.membership, outcome, attempt)
            return False
        self.membership.mark(members, EngineState.SERVING, target)
        registered_during(members, self.membership, self._groups)
        self.versions.completed(target)
        with self._state_lock:
            self.manifest = self._groups.manifest
        outcome.ok = True
        outcome.report = report.to_dict()
        return False

    def _prune_unreachable(self, members: list[EngineRecord], outcome: SyncOutcome, attempt: int) -> list[EngineRecord]:
        """Before (re)building a group, drop members that do not answer a health probe (see group.py).
        A standing group is kept only while every member still says what the daemon knows of it:
        an engine restarted at its address holds nothing and left the group, so it is rebuilt."""
        if self._groups.stands_for(members):
            if all(r.state == EngineState.SERVING for r in members) and not changed_members(members, self.membership, min(self.config.timeout_s, 10.0)):
                return members
            self._groups.rebuild_next()
        errors = probe_members(members, self.membership, min(self.config.timeout_s, 10.0))
        if not errors:
            return members
        outcome.attempts.append({"attempt": attempt, "stage": "probe", "failed": dict(errors)})
        for r in members:
            if r.name in errors:
                why = f"engine {r.name!r} was unreachable before the sync: {errors[r.name]}"
                outcome.dropped[r.name] = why
                self._drop(r, why)
        return [r for r in members if r.name not in errors]

    def _finish(self, outcome: SyncOutcome) -> None:
        records = self.membership.records()
        outcome.engines = {r.name: r.version for r in records}
        outcome.states = {r.name: r.state for r in records}
        outcome.stale = sorted(r.name for r in records if r.state == EngineState.STALE)
        data = outcome.to_dict()
        with self._state_lock:
            self.last_outcome = data
            self.history.append(summarize(data))
            self._generation += 1
        if outcome.ok:
            logger.info("sync v%d reached %d engine(s) in %.3fs", outcome.version, len(records), outcome.seconds)
        else:
            logger.warning("sync v%d incomplete: %s (dropped: %s)", outcome.version, outcome.error, outcome.dropped or "none")
        if self.upstream is not None:
            try:
                self.upstream.report_sync(data)
            except Exception as exc:
                logger.warning("could not report sync v%d to the daemon: %s", outcome.version, exc)

    # --- following a standalone daemon --------------------------------------------------------
    def _pull_upstream(self) -> None:
        """Mirror the standalone daemon's members (`daemon.upstream`)."""
        if self.upstream is not None:
            mirror_upstream(self.upstream, self.membership, self.versions, self._drop, self.config.timeout_s, self._set_group)

    def _set_group(self, group: str | None) -> str:
        """The job's group as the standalone daemon names it (kept when it names none)."""
        with self._state_lock:
            self.group = str(group or self.group)
            return self.group

    def begin_sync(self, version: int) -> dict[str, Any]:
        """Standalone side of `begin_sync`: a trainer is about to sync `version` (`JobVersions.reserve`)."""
        try:
            self.versions.reserve(version, "a trainer's sync")
        except ValueError as exc:
            raise ProtocolError(str(exc)) from None
        return {"version": self.version}

    def record_sync(self, outcome: dict[str, Any]) -> dict[str, Any]:
        """Standalone side of `report_sync`: take a trainer's outcome as the job's state."""
        check_outcome(outcome)
        with self._state_lock:
            try:
                self.versions.check_reported(outcome["version"], "outcome.version")
            except ValueError as exc:
                raise ProtocolError(str(exc)) from None
            if outcome["ok"]:
                self.versions.adopt(outcome["version"], "a trainer's report")
            self._generation += 1
        for name, why in outcome["dropped"].items():
            rec = reported(self.membership, outcome, name)
            if rec is not None:
                self._drop(rec, why)
        for name, state in outcome["states"].items():
            rec = reported(self.membership, outcome, name)
            if rec is not None and EngineState.JOINING not in (state, rec.state):  # a join in flight here is its own
                self.membership.set_state(rec, state, None if state == EngineState.STALE else outcome["engines"].get(name))
        with self._state_lock:
            self.last_outcome = outcome
            self.history.append(summarize(outcome))
        return {"version": self.version}

    # --- serving ------------------------------------------------------------------------------
    def serve(self, host: str | None = None, port: int | None = None) -> DaemonServer:
        """Start the control server (register / status / ... from other processes)."""
        if self.server is None:
            self.server = DaemonServer(
                self,
                token=self.token,
                limits=self.daemon_config,
                host=host if host is not None else self.daemon_config.host,
                port=port if port is not None else self.daemon_config.port,
            ).start()
        return self.server

    def close(self) -> None:
        """Stop serving and monitoring, leave the group, resume every engine left paused that
        holds a complete version, close the adapters the daemon built."""
        self._stop.set()
        if self.server is not None:
            self.server.close()
        self.joins.close(2 * self.config.timeout_s)
        with self._sync_lock:
            self._groups.close()
        if self.role != "standalone":
            resume_held(self.membership.records())
        for rec in self.membership.records():
            if rec.adapter is not None and self.upstream is None:
                release_engine(rec.adapter)
            if rec.owned and rec.adapter is not None:
                close_quietly(rec.adapter)
        if self._monitor is not None:
            self._monitor.join(timeout=self.daemon_config.health_interval_s + 10)

    def __enter__(self) -> WeightSyncDaemon:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
