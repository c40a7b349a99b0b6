"""WeightSyncSession: one sync, end to end, in this order:

metadata -> plan (cached) -> validate on every engine -> pause -> stream (the senders: this rank,
and with many senders every trainer rank, announced over the trainer's process group; receivers
in the engines) -> finalize + version -> resume -> SyncReport; staged, the engines serve while it
streams and pause only for a swap (`sync/staging.py`). A session keeps the weight-sync group
(`sync/group.py`), plan and delta bases across syncs; the stream step is `sync/stream.py`.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Collection, Hashable, Iterator, Sequence
from typing import Any, TypeVar

import torch

from ckpt_engine.config import CheckpointEngineConfig
from ckpt_engine.sync.delta_policy import DeltaPolicy
from ckpt_engine.delta.request import DeltaRequest
from ckpt_engine.engine import CheckpointEngine, SendStats
from ckpt_engine.sync.claims import claims
from ckpt_engine.sync.fanout import ask_memberships, collect_failures, collect_memberships, fan_out, leave_all, mark_stale_and_probe
from ckpt_engine.manifest import BucketManifest, TensorSpec
from ckpt_engine.rollout_adapters.base import ManifestRejectedError, Membership, ReceiveReport, RolloutAdapter
from ckpt_engine.sync.sender_follower import join_message
from ckpt_engine.sources.sharded import ShardedWeightSource, iter_pieces
from ckpt_engine.sync.group import SyncGroup, backend_for, delta_unsupported
from ckpt_engine.sync.installed import InstalledChecks
from ckpt_engine.sync.many_senders import ManySenders, wants_many_senders
from ckpt_engine.sync.regions import RegionDelivery, RegionSync
from ckpt_engine.sync.progress import SyncProgress
from ckpt_engine.sync.report import SOURCE, SyncError, SyncReport, make_report
from ckpt_engine.sync.stream import SyncStream
from ckpt_engine.sync.staging import StagePolicy, discard_all, run_order
from ckpt_engine.sync.weights_mode import WeightsModeCheck
from ckpt_engine.versions import next_version
from ckpt_engine.sources.vllm import as_weight_source
from ckpt_engine.sources.base import WatchedWeights, WeightSource, drain
from ckpt_engine.sources.fp8 import Fp8WireSource, fp8_wire

__all__ = ["SOURCE", "SyncError", "SyncReport", "WeightSyncSession"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class WeightSyncSession:
    """The sender side of one weight-sync group, reused across syncs.

    Holds the weight-sync group (`SyncGroup`: the rendezvous store, the sender's engine, the plan),
    rebuilt only when the set of engines changes or an earlier sync broke it. Syncs on one session
    run one at a time: a second caller waits its turn for at most `timeout_s`, then is refused.
    """

    def __init__(
        self,
        rollouts: Sequence[RolloutAdapter],
        config: CheckpointEngineConfig | None = None,
        *,
        engine: CheckpointEngine | None = None,
        host: str = "127.0.0.1",
        device: str | torch.device | None = None,
        raw_gbps: float | None = None,
    ) -> None:
        self.config = config if config is not None else CheckpointEngineConfig()
        self.rollouts = list(rollouts)
        names = [r.name for r in self.rollouts]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"a weight-sync session needs one or more rollout engines, each named once; got {names}")
        keys = [r.engine_key() for r in self.rollouts]
        if len(set(keys)) != len(keys):  # two names on one engine: its one receive would be asked twice
            raise ValueError(f"rollout engines {[n for n, k in zip(names, keys) if keys.count(k) > 1]} are one engine under several names: list it once")
        self.host = host
        self.backend = backend_for(self.config, self.rollouts)
        self._group = SyncGroup(self.config, self.backend, host, device, engine)
        self.raw_gbps = raw_gbps
        self.version = 0
        self.completed: int | None = None  # the version this session (or one it replaced) last completed: never stamped again
        self.stale: set[str] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._delta = DeltaPolicy(self.config.delta, self.config.full_sync_every)
        self._senders = ManySenders(self.config, self.backend, self.rollouts)
        self._regions = RegionDelivery(self.config.region_slot_memory_bytes)  # issue 27: each engine rank receives only what it holds
        self._pool = cf.ThreadPoolExecutor(max_workers=max(4, 2 * len(self.rollouts) + 1), thread_name_prefix="ckpt-sync")
        self._staging: str | None = None  # this sync's stage while it streams (None: today's order)
        self._stages = StagePolicy(self.config.stage)
        c = self.config
        self._weights_mode = WeightsModeCheck()
        self._installed = InstalledChecks(c.verify_installed, c.verify_installed_samples, c.unwritten_tensors)  # issue 42 item 5
        self._progress = SyncProgress()
        self._stream = SyncStream(self.config, self._senders, self._regions, self._pool, self._break, self._group.new_engine)

    @property
    def closed(self) -> bool:
        """Whether `close()` ran: the session's group is gone and every sync is refused."""
        return self._closed

    def engine_keys(self) -> dict[str, Hashable]:
        return {r.name: r.engine_key() for r in self.rollouts}

    @contextlib.contextmanager
    def _locked(self, what: str) -> Iterator[None]:
        """The session lock for `what` (not a sync), refused when closed or after `timeout_s`."""
        if not self._lock.acquire(timeout=self.config.timeout_s):
            raise RuntimeError(f"{what}: a sync on this session has run for more than timeout_s={self.config.timeout_s}s")
        try:
            if self._closed:
                raise RuntimeError("this WeightSyncSession is closed; make a new one")
            yield
        finally:
            self._lock.release()

    def join(self) -> None:
        """Build the weight-sync group now (the first sync would): an engine that cannot join
        fails here, by name."""
        with self._locked("join"):
            self._ensure_group(self._group.num_senders)

    def rebind(self, rollouts: Sequence[RolloutAdapter]) -> None:
        """Drive new handles on the same engines (same names and `engine_key`s, in order): the
        group, plan, version and delta bases stay, since the engines stay members."""
        rollouts = list(rollouts)
        same = len(rollouts) == len(self.rollouts) and all(
            new.name == old.name and new.engine_key() == old.engine_key() for new, old in zip(rollouts, self.rollouts)
        )
        if not same:
            raise ValueError("rebind() takes new handles on the same engines, in the same order")
        with self._locked("rebind"):
            for new, old in zip(rollouts, self.rollouts):
                if new is not old:
                    new.take_over(old)
            self.rollouts[:] = rollouts

    # --- group --------------------------------------------------------------------------------
    def _ensure_group(self, num_senders: int = 1) -> CheckpointEngine:
        """The group, (re)built when needed. With several senders, the other trainer ranks learn
        here (one announcement per sync) whether to join a new group."""
        engine = self._group.current(num_senders)
        if engine is not None:
            if num_senders > 1:
                self._senders.announce(join_message(None, {}))
            return engine
        self._delta.forget()  # members join with empty bases
        announce = (lambda rdzv, options: self._senders.announce(join_message(rdzv, options))) if num_senders > 1 else None
        engine, rdzv, failed = self._group.build(num_senders, self.rollouts, self._pool, announce)
        if failed:
            raise SyncError("join", failed, sorted(self.stale))
        claims.claim(self.engine_keys(), self)
        self._regions.joined(self.rollouts, self._fan_out("join", lambda r: r.receive_plans()), rdzv)
        return engine

    def _fan_out(self, stage: str, fn: Callable[[RolloutAdapter], T]) -> dict[str, T]:
        """`fn` on every engine (`fanout.fan_out`); a failure or a wait past timeout_s breaks the group."""
        answers, failed = fan_out(self._pool, self.rollouts, fn, stage, self.config.timeout_s)
        if failed:
            self._progress.step(stage, answers)
            raise SyncError(stage, failed, self._break(failed))
        return answers

    def _break(self, failed: dict[str, str], deadline: float | None = None, unreachable: Collection[str] | None = None) -> list[str]:
        """Mark the group for rebuild and every engine stale; find the dead ones by name (a health
        probe of the rest, unless this failure probed them already: `unreachable` is what it found).
        A staged stream that failed: every engine discards what it staged and stays fresh (its live
        weights were never touched); only an engine that cannot discard (dead) is stale; the
        discards are waited for no later than `deadline` (the failed stream's,
        `staging.failure_deadline`), the `unreachable` only briefly. Returns the stale."""
        self._group.ready = False
        self._delta.failed()
        if self._staging is not None:
            self._staging = None
            for name, why in discard_all(self._pool, self.rollouts, self.config.timeout_s, deadline, unreachable or ()).items():
                self.stale.add(name)
                failed.setdefault(name, why)
        elif unreachable is None:
            mark_stale_and_probe(self.rollouts, failed, self.stale)
        else:
            self.stale.update(r.name for r in self.rollouts)
        self._regions.drop_groups()
        self._group.drop()
        return sorted(self.stale)

    # --- one sync -----------------------------------------------------------------------------
    def plan(self, specs: list[TensorSpec], engine: CheckpointEngine, source: Any = None) -> BucketManifest:
        return self._group.plan(specs, engine, source.owners() if self._group.num_senders > 1 else None)

    @property
    def manifest(self) -> BucketManifest | None:
        """The plan of the last sync (None before the first)."""
        return self._group.manifest

    def sync(self, source: WeightSource, *, version: int | None = None) -> SyncReport:
        """Move one version of `source`'s weights into every engine; see the module docstring.

        `version` defaults to one past the newest version any engine reports it holds (or this
        session's last one); an explicit version below what an engine holds is refused.
        `source.iter_weights()` is walked exactly once whatever happens (the other trainer ranks
        walk it too, and its gathers are collectives): on any failure the rest of the walk is
        drained before the error propagates (a checked `stable_tensors` source is walked before the pause, and the send takes that walk).
        """
        report = self._locked_sync(as_weight_source(source), version, drain_if_closed=True)
        assert report is not None
        return report

    def _locked_sync(self, source: WeightSource, version: int | None, *, drain_if_closed: bool) -> SyncReport | None:
        """One sync under the session lock; None (source untouched) if closed and not draining."""
        if not self._lock.acquire(timeout=self.config.timeout_s):
            self._release_refused(source)
            raise RuntimeError(
                f"another sync on this session (engines {', '.join(r.name for r in self.rollouts)}) has run for more "
                f"than timeout_s={self.config.timeout_s}s; syncs on one set of engines run one at a time"
            )
        try:
            if self._closed:
                if not drain_if_closed:
                    return None
                self._release_refused(source)
                raise RuntimeError("this WeightSyncSession is closed; make a new one")
            source = fp8_wire(source, self.config.wire_dtype)  # checkpoint_engine.wire_dtype: quantized while walked
            senders = self._senders.count(source)
            if senders > 1:
                return self._senders.run(lambda: self._sync(source, None, version, senders))
            weights = WatchedWeights(self._installed.tap(source.iter_weights(), source.stable_tensors))  # folds what an armed check needs
            try:
                return self._sync(source, weights, version)
            finally:
                try:
                    for _ in weights:
                        pass
                except Exception as exc:  # the original error, if any, is the one to report
                    logger.warning("draining the weight source after a failed sync: %s", exc)
                self._installed.release()
        except SyncError as exc:
            self._progress.restate(exc)  # what each engine was left doing
            raise
        finally:
            self._lock.release()

    def _release_refused(self, source: WeightSource) -> None:
        """A source this session refuses before its sync begins: walked, since its gathers are
        collectives the other trainer ranks run in step (`sync_rollout_weights` on them drains it
        too), unless every rank sends its own pieces. Then the other ranks wait for announcements,
        not gathers (`sync_rollout_weights` tells them of the refusal), and a walk here would hang
        in gathers nobody joins."""
        if not wants_many_senders(source, self.config.senders):
            drain(source)

    def _sync(self, source: WeightSource, weights: WatchedWeights | None, version: int | None, senders: int = 1) -> SyncReport:
        """One sync in its steps: prepare (metadata, version, group, plan) -> validate -> delta or
        dense -> pause -> stream -> finalize -> resume -> report. `weights` is None with many
        senders: this rank then sends its own pieces, no gather."""
        t0 = time.perf_counter()
        seconds: dict[str, float] = {}
        self._progress.begin(self.rollouts, self.config.pause_mode)
        # The membership rides on the validate; with many senders the group's join is announced to
        # the other ranks once a sync, before any validate, so a rejoin must be known before it.
        if senders == 1 and all(r.membership_at_validate for r in self.rollouts):
            new_version, engine, manifest, regions = self._prepare_validated(source, version, senders, seconds, t0)
        else:
            new_version, engine, manifest = self._prepare(source, version, senders)
            regions = self._regions.prepare(self.rollouts, manifest, engine, senders, source)  # a bad plan is refused here
            seconds["plan"] = time.perf_counter() - t0
            self._validate(manifest, seconds)
        pieces = None
        if weights is None:  # many senders: this rank's own pieces, no gather
            pieces = iter_pieces(source, manifest)  # type: ignore[arg-type]  # count(): sharded
            weights = WatchedWeights(pieces)
        collective = isinstance(source, ShardedWeightSource) and source.collective_pieces
        self._installed.arm_manifest(self.rollouts, manifest, self._regions.plans, senders, collective, source if senders == 1 else None)
        if isinstance(source, Fp8WireSource):  # the walk fills the sender's slots itself unless a check folds what it yields
            source.fill_slots = self._installed.request is None
        announced = self._installed.announcement() if senders > 1 else None
        if announced is not None and isinstance(source, ShardedWeightSource):  # each sender folds its share; rank 0 adds them
            self._senders.announce_check(source, manifest, announced)
        # Delta or dense is decided before anything is paused (delta=on with an engine that takes no
        # patches is refused here, with every engine still serving).
        digest = regions.digest if regions is not None else manifest.digest
        request = self._delta.request(digest, delta_unsupported(engine, self.backend, self.rollouts), self.backend)
        stage = self._stages.choose(
            self.rollouts, request, self._regions.received_bytes(self.rollouts, manifest.total_bytes),
            lambda ask: self._fan_out("validate", ask), regions=regions is not None,
        )
        self._staging = stage  # while it streams: a failure then discards instead of leaving engines stale
        # One engine, one sender, nothing checked between receive and finalize (or one rank checked against source digests known
        # before the stream, where they agree): it may finalize in its receive's last call (more engines: one could fail after another finalized).
        checked = self._installed.request is not None
        if stage is None and (not checked or self._installed.ahead) and senders == 1 and len(self.rollouts) == 1:
            self.rollouts[0].finalize_with_receive(new_version, self._installed.expected_report if checked else None)

        def stream() -> tuple[SendStats, dict[str, ReceiveReport]]:
            t = time.perf_counter()
            out = self._stream.run(self.rollouts, source, engine, manifest, weights, pieces, request, senders, stage, self._installed.sent)
            if self._senders.installed is not None and senders > 1:  # every sender's shares came in the round after the send
                self._installed.combine(self._senders.shares)
            self._staging = None  # every rank checked every set: a failure from here (a swap) is stale, as a finalize's
            seconds["transfer"] = time.perf_counter() - t
            return out

        try:
            stats, reports, stall = run_order(stage, stream, self._step, new_version, self.config.pause_mode, seconds, self._check_installed)
        finally:
            self._staging = None
        report = self._report(new_version, manifest, request, stats, reports, senders, seconds, t0)
        report.staged, report.stall_s = stage if stage is not None else "off", stall
        return report

    def _check_installed(self, swapped: bool) -> None:
        """Installed-weight checks (`sync/installed.py`), before the version is stamped (staged: right
        after the swap). Engines that differ fail the sync, out of service: paused (a swapped one is
        paused now) and stale, as a failed sync leaves its engines."""
        failed = self._installed.verify(self._pool, self.rollouts, self.config.timeout_s)
        if not failed:
            return
        if swapped:
            mode = self.config.pause_mode if self.config.pause_mode != "none" else "keep"
            collect_failures({r.name: self._pool.submit(r.pause, mode) for r in self.rollouts if r.name in failed}, "pause", self.config.timeout_s)
            self._progress.held_out(failed)
        raise SyncError("verify", failed, self._break(failed))

    def _prepare(self, source: WeightSource, version: int | None, senders: int) -> tuple[int, CheckpointEngine, BucketManifest]:
        """Metadata, the claim on the engines, the next version, the group and the plan: nothing
        is paused or sent yet."""
        if self._group.ready:  # (re)joining claims the engines for this session
            claims.check_current(self.engine_keys(), self)
        # What every engine holds, and whether it is still in this session's group, is asked each
        # sync: another session may have synced it, or it restarted. Asked first, answered while the
        # source's metadata and device are read (a round trip to every engine: ~1.3 ms on vLLM).
        asked = ask_memberships(self._pool, self.rollouts)
        try:
            specs = self._specs(source)
            device = source.device if senders == 1 else None  # with many senders each rank's transport takes its own
        except BaseException:
            cf.wait(asked.values(), timeout=self.config.timeout_s)  # a refused sync leaves no query in flight
            raise
        members, failed = collect_memberships(asked, self.config.timeout_s)
        if failed:  # part of validating: nothing was paused or sent
            raise SyncError("validate", failed, self._break(failed))
        self._rejoin_if_left(members)
        new_version = self._new_version(members, version)
        if senders == 1:
            self._group.take_device(device)
        engine = self._ensure_group(senders)
        return new_version, engine, self.plan(specs, engine, source)

    def _prepare_validated(
        self, source: WeightSource, version: int | None, senders: int, seconds: dict[str, float], t0: float,
    ) -> tuple[int, CheckpointEngine, BucketManifest, RegionSync | None]:
        """`_prepare` and `_validate` for engines whose validate answers their membership too
        (`RolloutAdapter.membership_at_validate`): one engine round trip fewer a sync. An engine found
        restarted or taken over (`_rejoin_if_left`) is rejoined, and every engine validates again in
        the new group (nothing was paused or sent; nobody is blamed). A version refused after the
        validate is refused as before, every engine serving; the claim its validate took on a vLLM
        engine lapses as a refused manifest's does (`vllm/holds.py`)."""
        if self._group.ready:
            claims.check_current(self.engine_keys(), self)
        specs = self._specs(source)
        device = source.device
        for attempt in range(2):
            self._group.take_device(device)
            engine = self._ensure_group(senders)
            manifest = self.plan(specs, engine, source)
            regions = self._regions.prepare(self.rollouts, manifest, engine, senders, source)  # a bad plan is refused here
            seconds.setdefault("plan", time.perf_counter() - t0)
            self._validate(manifest, seconds)
            members = self._validated_members()
            left = self._rejoin_if_left(members)
            if not left:
                break
            if attempt:  # left again right after joining: not streamed into
                why = {n: "left the weight-sync group again right after rejoining it" for n in left}
                raise SyncError("validate", why, self._break(why))
        return self._new_version(members, version), engine, manifest, regions

    def _validated_members(self) -> dict[str, Membership]:
        """Every engine's membership as its validate read it; asked apart of one that could not say."""
        members = {r.name: r.validated_membership() for r in self.rollouts}
        unread = [r for r in self.rollouts if members[r.name] is None]
        if unread:
            more, failed = collect_memberships(ask_memberships(self._pool, unread), self.config.timeout_s)
            if failed:
                raise SyncError("validate", failed, self._break(failed))
            members.update(more)
        return {n: m for n, m in members.items() if m is not None}

    def _new_version(self, members: dict[str, Membership], version: int | None) -> int:
        """The sync's version from what every engine holds; ValueError for a version refused."""
        return next_version({n: m.version for n, m in members.items()}, self.version, version, self.completed)

    def _specs(self, source: WeightSource) -> list[TensorSpec]:
        """The source's metadata, refused when empty or not what `checkpoint_engine.weights` says."""
        specs = list(source.metadata())
        if not specs:
            raise ValueError(
                f"the weight source ({type(source).__name__}) lists no tensors: refusing to stamp an empty sync as a "
                "new version (does a name filter drop every tensor?)"
            )
        self._weights_mode(self.config.weights, specs, self.rollouts)
        return specs

    def _rejoin_if_left(self, members: dict[str, Membership]) -> list[str]:
        """An engine with a rank in no group or another one than this session's (a server restarted at
        its URL, a worker process replaced) would fail mid-stream and be blamed: the group is dropped
        now, to be rebuilt (every engine rejoins), and the sync is a seed (new members hold no delta
        bases). Returns the engines that left."""
        token = self._group.token
        if not self._group.ready or token is None:
            return []
        left = sorted(n for n, m in members.items() if m.left(token))
        if left:
            logger.warning(
                "engine(s) %s left this session's weight-sync group (restarted?): every engine rejoins and this sync seeds them",
                ", ".join(left),
            )
            self._regions.drop_groups()
            self._group.drop()
        return left

    def _validate(self, manifest: BucketManifest, seconds: dict[str, float]) -> None:
        """Every engine checks the manifest; the rejections of all of them raise as one error."""
        t = time.perf_counter()
        rejected: list[ManifestRejectedError] = []

        def validate(r: RolloutAdapter) -> None:
            try:
                self._regions.validate(r, manifest, self._group.encoded)
            except ManifestRejectedError as exc:
                rejected.append(exc)

        self._fan_out("validate", validate)
        if rejected:
            raise ManifestRejectedError.combine(sorted(rejected, key=lambda e: e.engine))
        seconds["validate"] = time.perf_counter() - t

    def _step(self, stage: str, seconds: dict[str, float], fn: Callable[[RolloutAdapter], T]) -> dict[str, T]:
        """One engine-wide step (pause, finalize, resume, swap), timed; a failure breaks the group."""
        t = time.perf_counter()
        out = self._fan_out(stage, fn)
        seconds[stage] = time.perf_counter() - t
        self._progress.step(stage, out)
        return out

    def _report(
        self, new_version: int, manifest: BucketManifest, request: DeltaRequest | None, stats: SendStats,
        reports: dict[str, ReceiveReport], senders: int, seconds: dict[str, float], t0: float,
    ) -> SyncReport:
        """The sync completed: the engines are fresh, the version and the delta chain move on."""
        others = self._senders.figures if senders > 1 else []  # every other sender's share of the wire
        report = make_report(
            new_version, manifest, request, stats, reports, len(self.rollouts), senders, seconds, self.raw_gbps, others,
            region_bytes=self._regions.sent_bytes(),
        )
        report.received_bytes = self._regions.received_bytes(self.rollouts, manifest.total_bytes)
        active = self._regions.active
        self.stale.clear()
        self.version = self.completed = new_version
        self._installed.completed = True
        if self._installed.seconds is not None:
            seconds["installed_check"] = self._installed.seconds
        self._delta.completed(
            active.digest if active is not None else manifest.digest, request, transport=self.backend, seconds=seconds["transfer"], plan_bytes=manifest.total_bytes,
            wire_bytes=report.wire_bytes, dense_bytes=report.dense_bytes,
        )
        seconds["total"] = time.perf_counter() - t0
        logger.info(
            "sync v%d: %.3f GB (%.3f GB on the wire, %s), %d tensors, %d buckets, %d sender(s) in %.3fs (%.2f GB/s)",
            new_version, report.bytes / 1e9, report.wire_bytes / 1e9, report.delta, report.tensors, report.buckets, senders,
            seconds["total"], report.gbps,
        )
        return report

    def close(self) -> None:
        """Leave the group on every engine (best effort), free the sender's buffers and threads.

        Waits (at most `timeout_s`) for a sync in flight on another thread to end first."""
        locked = self._lock.acquire(timeout=self.config.timeout_s)
        if not locked:
            logger.warning("closing a weight-sync session while a sync is still in flight after %ss", self.config.timeout_s)
        try:
            if self._closed:
                return
            self._closed = True
            # An engine another session has joined since is not asked to leave: it would leave that group.
            lost = set(claims.taken_over(self.engine_keys(), self))
            if self._group.ready:
                leave_all([r for r in self.rollouts if r.name not in lost])
            self._regions.drop_groups()
            self._group.close()
            claims.release(self)
            self._pool.shutdown(wait=False, cancel_futures=True)
        finally:
            if locked:
                self._lock.release()
