"""sync_rollout_weights(): one sync, end to end, as DESIGN.md orders it.

metadata -> plan (cached) -> validate on every engine -> pause -> stream (sender here, receivers
in the engines) -> finalize + version -> resume -> SyncReport. A `WeightSyncSession` keeps the
weight-sync group, buffers and plan across syncs; `sync_rollout_weights` reuses one per set of
engines.
"""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

import torch

from ckpt_engine.buckets import auto_bucket_size_bytes
from ckpt_engine.config import CheckpointEngineConfig
from ckpt_engine.engine import CheckpointEngine, Rendezvous
from ckpt_engine.fanout import collect_failures, mark_stale_and_probe
from ckpt_engine.manifest import BucketManifest, TensorSpec, encode_manifest
from ckpt_engine.registry import CheckpointEngineRegistry
from ckpt_engine.rollout_adapters.base import JoinOptions, ManifestRejectedError, ReceiveReport, RolloutAdapter
from ckpt_engine.weights import WeightSource

__all__ = ["SyncError", "SyncReport", "WeightSyncSession", "sync_rollout_weights"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class SyncError(RuntimeError):
    """A sync failed after it started moving data; the named engines failed at `stage`.

    Every surviving engine stays paused and stale until a later sync completes.
    """

    def __init__(self, stage: str, failed: dict[str, str], stale: list[str]) -> None:
        detail = "; ".join(f"{name}: {why}" for name, why in failed.items())
        super().__init__(f"weight sync failed during {stage}: {detail}; engines left paused and stale: {', '.join(stale) or 'none'}")
        self.stage, self.failed, self.stale = stage, failed, stale


@dataclass
class SyncReport:
    """One sync's figures. `seconds["transfer"]` runs from the first bucket sent to the last
    receiver done loading (streaming and loading overlap); `export`/`pack` are the sender's host
    time inside it, `load_max` the slowest engine's loader time."""

    version: int
    bytes: int
    tensors: int
    buckets: int
    engines: int
    seconds: dict[str, float] = field(default_factory=dict)
    gbps: float = 0.0
    raw_gbps: float | None = None
    receivers: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def ratio_to_raw(self) -> float | None:
        return self.gbps / self.raw_gbps if self.raw_gbps else None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ratio_to_raw"] = self.ratio_to_raw
        return d


class WeightSyncSession:
    """The sender side of one weight-sync group, reused across syncs.

    Hosts the rendezvous store (free port from the OS, a fresh token per group) and rebuilds the
    group only when the set of engines changes or an earlier sync broke it.
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
        if len(set(names)) != len(names):
            raise ValueError(f"engine names must be unique, got {names}")
        self.host = host
        self.backend = CheckpointEngineRegistry.resolve_name(self.config.backend)
        self._engine = engine
        self._device = device
        self.raw_gbps = raw_gbps
        self._store: Any = None
        self._ready = False
        self._plan_key: tuple[Any, ...] | None = None
        self._manifest: BucketManifest | None = None
        self._encoded = b""
        self.version = 0
        self.stale: set[str] = set()
        self._pool = cf.ThreadPoolExecutor(max_workers=max(4, 2 * len(self.rollouts)), thread_name_prefix="ckpt-sync")

    # --- group --------------------------------------------------------------------------------
    def _new_engine(self, bucket_size: int) -> CheckpointEngine:
        kwargs = self.config.kwargs_for(self.backend)
        if self._device is not None:
            kwargs.setdefault("device", self._device)
        return CheckpointEngineRegistry.new(
            self.backend, bucket_size_bytes=bucket_size, num_buffers=self.config.num_buffers,
            timeout_s=self.config.timeout_s, verify=self.config.verify, **kwargs,
        )

    def _bucket_size(self) -> int:
        if self.config.bucket_size_bytes is not None:
            return self.config.bucket_size_bytes
        device = str(self._device) if self._device is not None else ("cuda" if self.backend == "nccl" else "cpu")
        return auto_bucket_size_bytes(device, self.config.num_buffers)

    def _ensure_group(self) -> CheckpointEngine:
        if self._ready and self._engine is not None:
            return self._engine
        if self._engine is None:
            self._engine = self._new_engine(self._bucket_size())
        engine = self._engine
        topo = type(engine).build_topology(1, [r.world_size for r in self.rollouts])
        if self._store is None:
            self._store = torch.distributed.TCPStore(
                self.host, 0, is_master=True, wait_for_workers=False,
                timeout=_td(self.config.timeout_s),
            )
        rdzv = Rendezvous(self.host, self._store.port, uuid.uuid4().hex, topo.world_size, self.backend, self.config.timeout_s)
        options = JoinOptions(engine.bucket_size_bytes, engine.num_buffers, engine.verify, self.config.kwargs_for(self.backend))
        futures = {
            r.name: self._pool.submit(r.join, rdzv, off, options) for r, off in zip(self.rollouts, topo.receiver_offsets)
        }
        try:
            engine.init_process_group(rdzv, 0)
        except Exception as exc:
            failed = self._collect_failures(futures, "join")
            failed.setdefault("sender", str(exc))
            engine.finalize()
            self._engine = None
            raise SyncError("join", failed, sorted(self.stale)) from exc
        failed = self._collect_failures(futures, "join")
        if failed:
            engine.finalize()
            self._engine = None
            raise SyncError("join", failed, sorted(self.stale))
        self._ready = True
        logger.info("weight-sync group %s ready: %d ranks over %s", rdzv.token[:8], topo.world_size, self.backend)
        return engine

    def _collect_failures(self, futures: dict[str, cf.Future[Any]], stage: str) -> dict[str, str]:
        return collect_failures(futures, stage, self.config.timeout_s)

    def _fan_out(self, stage: str, fn: Callable[[RolloutAdapter], T]) -> dict[str, T]:
        futures = {r.name: self._pool.submit(fn, r) for r in self.rollouts}
        failed = self._collect_failures(futures, stage)
        if failed:
            self._break(failed)
            raise SyncError(stage, failed, sorted(self.stale))
        return {name: f.result() for name, f in futures.items()}

    def _break(self, failed: dict[str, str]) -> None:
        """Mark the group for rebuild and every engine stale; find the dead ones by name."""
        self._ready = False
        mark_stale_and_probe(self.rollouts, failed, self.stale)
        if self._engine is not None:
            self._engine.finalize()
            self._engine = None

    # --- one sync -----------------------------------------------------------------------------
    def plan(self, specs: list[TensorSpec], engine: CheckpointEngine) -> BucketManifest:
        key = (engine.bucket_size_bytes, engine.solo_bytes, tuple(specs))
        if key != self._plan_key or self._manifest is None:
            self._manifest = engine.plan(specs)
            self._encoded = encode_manifest(self._manifest)
            self._plan_key = key
        return self._manifest

    @property
    def manifest(self) -> BucketManifest | None:
        """The plan of the last sync (None before the first)."""
        return self._manifest

    def sync(self, source: WeightSource, *, version: int | None = None) -> SyncReport:
        """Move one version of `source`'s weights into every engine; see the module docstring.

        `source.iter_weights()` is walked exactly once whatever happens (the other trainer ranks
        walk it too, and its gathers are collectives): on any failure the rest of the walk is
        drained before the error propagates.
        """
        weights = iter(source.iter_weights())
        try:
            return self._sync(source, weights, version)
        finally:
            try:
                for _ in weights:
                    pass
            except Exception as exc:  # the original error, if any, is the one to report
                logger.warning("draining the weight source after a failed sync: %s", exc)

    def _sync(self, source: WeightSource, weights: Iterator[tuple[str, torch.Tensor]], version: int | None) -> SyncReport:
        new_version = version if version is not None else self.version + 1
        t0 = time.perf_counter()
        seconds: dict[str, float] = {}
        engine = self._ensure_group()
        manifest = self.plan(list(source.metadata()), engine)
        seconds["plan"] = time.perf_counter() - t0

        t = time.perf_counter()
        rejected: list[ManifestRejectedError] = []

        def validate(r: RolloutAdapter) -> None:
            try:
                r.validate(manifest, self._encoded)
            except ManifestRejectedError as exc:
                rejected.append(exc)

        self._fan_out("validate", validate)
        if rejected:
            raise ManifestRejectedError.combine(sorted(rejected, key=lambda e: e.engine))
        seconds["validate"] = time.perf_counter() - t

        t = time.perf_counter()
        self._fan_out("pause", lambda r: r.pause(self.config.pause_mode))
        seconds["pause"] = time.perf_counter() - t

        t = time.perf_counter()
        receives = {r.name: self._pool.submit(r.receive, manifest) for r in self.rollouts}
        try:
            stats = engine.send_weights(manifest, weights, stable=bool(getattr(source, "stable_tensors", False)))
        except Exception as exc:
            engine.finalize()  # closing the sender's group wakes receivers blocked on it
            failed = self._receive_failures(receives, grace_s=min(5.0, self.config.timeout_s))
            if not failed:
                failed["sender"] = f"{type(exc).__name__}: {exc}"
            self._break(failed)
            raise SyncError("transfer", failed, sorted(self.stale)) from exc
        failed = self._receive_failures(receives, grace_s=self.config.timeout_s)
        if failed:
            self._break(failed)
            raise SyncError("transfer", failed, sorted(self.stale))
        reports = {name: f.result() for name, f in receives.items()}
        seconds["transfer"] = time.perf_counter() - t
        seconds.update(export=stats.export_s, pack=stats.pack_s, send=stats.total_s)
        seconds["load_max"] = max((r.load_s for r in reports.values()), default=0.0)

        t = time.perf_counter()
        self._fan_out("finalize", lambda r: r.finalize(new_version))
        seconds["finalize"] = time.perf_counter() - t
        t = time.perf_counter()
        self._fan_out("resume", lambda r: r.resume())
        seconds["resume"] = time.perf_counter() - t
        self.stale.clear()
        self.version = new_version
        seconds["total"] = time.perf_counter() - t0
        report = SyncReport(
            version=new_version,
            bytes=manifest.total_bytes,
            tensors=manifest.num_tensors,
            buckets=manifest.num_buckets,
            engines=len(self.rollouts),
            seconds=seconds,
            gbps=manifest.total_bytes / seconds["transfer"] / 1e9 if seconds["transfer"] > 0 else 0.0,
            raw_gbps=self.raw_gbps,
            receivers={n: r.to_dict() for n, r in reports.items()},
        )
        logger.info(
            "sync v%d: %.3f GB, %d tensors, %d buckets in %.3fs (%.2f GB/s)",
            new_version, report.bytes / 1e9, report.tensors, report.buckets, seconds["total"], report.gbps,
        )
        return report

    def _receive_failures(self, receives: dict[str, cf.Future[ReceiveReport]], grace_s: float) -> dict[str, str]:
        failed = collect_failures(receives, "receive", grace_s)
        if not failed:
            return failed
        # A receiver that merely timed out behind a dead peer is not the cause; keep the dead ones.
        dead = {}
        for r in self.rollouts:
            try:
                r.health()
            except Exception as exc:
                dead[r.name] = f"died during the transfer ({exc})"
        return dead if dead else failed

    def close(self) -> None:
        """Leave the group on every engine (best effort) and free the sender's buffers."""
        if self._ready:
            for r in self.rollouts:
                try:
                    r.leave()
                except Exception as exc:
                    logger.warning("engine %s did not leave cleanly: %s", r.name, exc)
        if self._engine is not None:
            self._engine.finalize()
            self._engine = None
        self._ready = False
        self._store = None
        self._pool.shutdown(wait=False, cancel_futures=True)


def _drain(source: WeightSource) -> None:
    for _ in source.iter_weights():
        pass


def _td(seconds: float) -> Any:
    import datetime

    return datetime.timedelta(seconds=seconds)


_sessions: dict[tuple[int, ...], WeightSyncSession] = {}
_sessions_lock = threading.Lock()


def close_sessions() -> None:
    """Close every session `sync_rollout_weights` created (engines leave their groups)."""
    with _sessions_lock:
        sessions = list(_sessions.values())
        _sessions.clear()
    for session in sessions:
        session.close()


atexit.register(close_sessions)


def sync_rollout_weights(
    source: WeightSource,
    rollouts: Sequence[RolloutAdapter] | WeightSyncSession | None,
    *,
    version: int | None = None,
    config: CheckpointEngineConfig | None = None,
) -> SyncReport | None:
    """Push one version of `source`'s weights into every rollout engine.

    Call it on every trainer rank: ranks whose source is not the sender (`source.is_sender` false)
    only walk `iter_weights()` (its gathers are collectives) and return None. On the sender,
    `rollouts` is a list of engine adapters (a session is kept per list and reused) or a session.
    """
    if not getattr(source, "is_sender", True):
        _drain(source)
        return None
    if rollouts is None:
        raise ValueError("the sending trainer rank must pass the rollout engines (or a WeightSyncSession)")
    if isinstance(rollouts, WeightSyncSession):
        session = rollouts
    else:
        key = tuple(id(r) for r in rollouts)  # ids stay valid: the cached session holds the adapters
        with _sessions_lock:
            session = _sessions.get(key)
            if session is None or (config is not None and session.config != config):
                if session is not None:
                    session.close()
                session = _sessions[key] = WeightSyncSession(rollouts, config)
    return session.sync(source, version=version)
