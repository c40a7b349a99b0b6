"""The fully-async trainer loop: consume fresh samples, step any TrainEngine, sync via the daemon.

Rollout workers generate continuously with whatever complete version their engine holds; the
trainer takes batches whose staleness (newest pushed version minus the sample's version) is at
most `trainer.max_staleness`, drops older samples, steps, and every `trainer.sync_every` steps
pushes its weights through the daemon. When an engine waits for weights (new, restarted, or left
stale by a failed sync) and `daemon.catch_up` is on, the trainer syncs right away instead of at the
next interval. The loop never branches on the TrainEngine backend.

Multi-rank trainers: every attempt of a sync is one collective walk of `iter_weights()`; rank 0
passes a `TorchDistWalkBarrier` to `WeightSyncDaemon.sync`, the other ranks call `follow_sync`.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ckpt_engine.config import CheckpointEngineConfig
from ckpt_engine.daemon.coordinator import SyncOutcome, WalkBarrier, WeightSyncDaemon
from ckpt_engine.sync.sender_follower import SendFailed
from ckpt_engine.sync.api import sync_rollout_weights
from ckpt_engine.trainer.config import JobConfig
from ckpt_engine.trainer.rollout import Generator, RolloutWorker, SampleChunk
from ckpt_engine.trainer.task import ModularTask
from ckpt_engine.trainer.engines.base import TrainEngine
from ckpt_engine.sources.base import WeightSource

__all__ = ["FullyAsyncTrainer", "StepRecord", "SyncRecord", "TorchDistWalkBarrier", "TrainerPeers", "follow_sync"]

logger = logging.getLogger(__name__)


@dataclass
class StepRecord:
    step: int
    loss: float
    reward: float
    staleness_max: int
    staleness_mean: float
    dropped_stale: int


@dataclass
class SyncRecord:
    step: int
    version: int
    ok: bool
    catch_up: bool
    bytes: int
    seconds: float
    gbps: float
    dropped: dict[str, str]
    reason: str
    stages: dict[str, float] = field(default_factory=dict)
    """The sync's per-stage seconds (validate, pause, transfer, finalize, resume, total, ...)."""
    delta: str = "off"
    """`off` (no delta), `seed` (dense, (re)seeding the engines' bases) or `patch`."""
    wire_bytes: int = 0
    """Bytes the senders put on the wire; `dense_bytes` is what a dense sync of the plan sends."""
    dense_bytes: int = 0
    changed_fraction: float = 1.0
    senders: int = 1
    """Trainer ranks that sent their own pieces (1: rank 0 alone, after a gather)."""
    staged: str = "off"
    """How the engines took it (issue 28): `off` (paused for the whole sync), `patches` or `full`."""
    stall_s: float = 0.0
    """The engines' largest stall: seconds they produced no tokens because of this sync."""


@dataclass
class TrainSummary:
    steps: int
    versions: list[int]
    final_version: int
    engine_versions: dict[str, int | None]
    staleness_max: int
    staleness_mean: float
    reward_first: float
    reward_last: float
    samples_used: int
    samples_dropped_stale: int
    syncs: list[SyncRecord] = field(default_factory=list)


class FullyAsyncTrainer:
    """Drives one fully-async job on trainer rank 0 with an embedded (or following) daemon."""

    def __init__(
        self,
        job: JobConfig,
        engine: TrainEngine,
        daemon: WeightSyncDaemon,
        generators: Sequence[Generator],
        *,
        on_sync: Callable[[SyncRecord], None] | None = None,
        task: ModularTask | None = None,
        peers: TrainerPeers | None = None,
    ) -> None:
        """`task` poses prompts, scores answers and builds the engine's batch and loss (default: the
        tiny policy's ModularTask). `peers` is set when other trainer ranks follow this one: they
        are told before every step and every sync, so the loop stays the same on any backend."""
        self.job = job
        self.engine = engine
        self.daemon = daemon
        self.generators = generators
        self.task = task if task is not None else ModularTask(job.rollout.vocab_size)
        self.peers = peers
        self.queue: queue.Queue[SampleChunk] = queue.Queue(maxsize=max(1, job.rollout.queue_size // job.rollout.samples_per_request))
        self.workers: list[RolloutWorker] = []
        self.steps: list[StepRecord] = []
        self.syncs: list[SyncRecord] = []
        self.on_sync = on_sync
        self._carry: list[SampleChunk] = []
        self._stepped_since_sync = True

    # --- syncing ------------------------------------------------------------------------------
    def sync(self, step: int, reason: str) -> SyncOutcome:
        source: WeightSource = self.engine.source
        many = self.daemon.many_senders(source)  # decided once, told to the other ranks, kept by the daemon
        barrier = self.peers.announce_sync(many) if self.peers is not None else None
        if self._stepped_since_sync or self.daemon.version == 0:
            outcome = self.daemon.sync(source, walk_barrier=barrier, many_senders=many)
        else:  # weights unchanged since the last push: re-send the same version to the newcomers
            outcome = self.daemon.sync(source, version=self.daemon.version, walk_barrier=barrier, many_senders=many)
        self._stepped_since_sync = not outcome.ok and self._stepped_since_sync
        report = outcome.report or {}
        rec = SyncRecord(
            step=step, version=outcome.version, ok=outcome.ok, catch_up=outcome.catch_up, bytes=int(report.get("bytes", 0)),
            seconds=outcome.seconds, gbps=float(report.get("gbps", 0.0)), dropped=dict(outcome.dropped), reason=reason,
            stages={k: float(v) for k, v in (report.get("seconds") or {}).items()}, delta=str(report.get("delta", "off")),
            wire_bytes=int(report.get("wire_bytes", 0)), dense_bytes=int(report.get("dense_bytes", 0)),
            changed_fraction=float(report.get("changed_fraction", 1.0)), senders=int(report.get("senders", 1)),
            staged=str(report.get("staged", "off")), stall_s=float(report.get("stall_s", 0.0)),
        )
        self.syncs.append(rec)
        if self.on_sync is not None:
            self.on_sync(rec)
        if not outcome.ok:
            logger.warning("sync at step %d incomplete: %s", step, outcome.error)
        return outcome

    # --- batches ------------------------------------------------------------------------------
    def _next_batch(self) -> tuple[dict[str, torch.Tensor], list[int], int]:
        """`batch_size` samples with staleness <= max_staleness; older samples are dropped."""
        cfg = self.job.trainer
        deadline = time.monotonic() + cfg.batch_timeout_s
        chunks, have, dropped = [], 0, 0
        while have < cfg.batch_size:
            if self._carry:
                chunk = self._carry.pop()
            else:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise RuntimeError(self._starved_message(cfg.batch_timeout_s))
                try:
                    chunk = self.queue.get(timeout=min(remaining, 1.0))
                except queue.Empty:
                    # Starved while an engine waits for weights (e.g. the only one was restarted):
                    # catch it up now, or no sample would ever come.
                    if self.job.daemon.catch_up and self.daemon.pending():
                        self.sync(len(self.steps), "catch-up")
                    continue
            if self.daemon.version - chunk.version > cfg.max_staleness:
                dropped += len(chunk.prompts)
                continue
            chunks.append(chunk)
            have += len(chunk.prompts)
        versions = [c.version for c in chunks for _ in range(len(c.prompts))]
        batch = {k: torch.cat([getattr(c, k) for c in chunks]) for k in ("prompts", "actions", "rewards")}
        extra = have - cfg.batch_size
        if extra > 0:  # keep the overflow of the last chunk for the next batch
            last = chunks[-1]
            keep = len(last.prompts) - extra
            self._carry.append(SampleChunk(last.prompts[keep:], last.actions[keep:], last.rewards[keep:], last.version, last.engine))
            batch = {k: v[: cfg.batch_size] for k, v in batch.items()}
            versions = versions[: cfg.batch_size]
        return batch, versions, dropped

    def _starved_message(self, timeout_s: float) -> str:
        errors = {w.generator.name: w.last_error for w in self.workers if w.last_error}
        return (
            f"no batch of samples with staleness <= {self.job.trainer.max_staleness} within {timeout_s:.0f}s; "
            f"engines waiting for weights: {self.daemon.pending() or 'none'}; worker errors: {errors or 'none'}"
        )

    # --- the loop -----------------------------------------------------------------------------
    def run(self, *, initial_sync: bool = True) -> TrainSummary:
        """Train `trainer.steps` steps; `initial_sync=False` when the caller already pushed version 1."""
        cfg = self.job.trainer
        if initial_sync or self.daemon.version == 0:
            self.sync(0, "initial")  # engines serve nothing until they hold the trainer's weights
        self.workers = [
            RolloutWorker(g, self.task, self.queue, self.job.rollout.samples_per_request, seed=cfg.seed * 1000 + i).start()
            for i, g in enumerate(self.generators)
        ]
        staleness_all: list[int] = []
        used = dropped_total = 0
        try:
            for step in range(1, cfg.steps + 1):
                batch, versions, dropped = self._next_batch()
                staleness = [self.daemon.version - v for v in versions]
                staleness_all += staleness
                used += len(versions)
                dropped_total += dropped
                self.engine.train_mode()
                metrics = self.engine.forward_backward(self.task.to_batch(batch), self.task.loss_fn)
                self.engine.optimizer_step()
                self._stepped_since_sync = True
                self.steps.append(StepRecord(step, metrics["loss"], float(batch["rewards"].mean()), max(staleness), statistics.fmean(staleness), dropped))
                if step % cfg.sync_every == 0:
                    self.sync(step, "interval")
                elif self.job.daemon.catch_up and self.daemon.pending():
                    self.sync(step, "catch-up")
        finally:
            for w in self.workers:
                w.stop()
        rewards = [s.reward for s in self.steps]
        k = max(1, min(5, len(rewards) // 2))
        members = {e["name"]: e["version"] for e in self.daemon.members()["engines"]}
        return TrainSummary(
            steps=len(self.steps),
            versions=[s.version for s in self.syncs if s.ok],
            final_version=self.daemon.version,
            engine_versions=members,
            staleness_max=max(staleness_all, default=0),
            staleness_mean=statistics.fmean(staleness_all) if staleness_all else 0.0,
            reward_first=statistics.fmean(rewards[:k]),
            reward_last=statistics.fmean(rewards[-k:]),
            samples_used=used,
            samples_dropped_stale=dropped_total,
            syncs=list(self.syncs),
        )


class TrainerPeers(Protocol):
    """Rank 0's line to the other trainer ranks (see `ckpt_engine.trainer.ranks`)."""

    def announce_sync(self, many_senders: bool = False) -> WalkBarrier:
        """Tell the other ranks a sync starts and whether they send their own pieces (else they
        walk `iter_weights()`); returns the walk barrier."""
        ...


class TorchDistWalkBarrier:
    """Tells the other trainer ranks whether another walk of the weights follows (rank 0 sends)."""

    def __init__(self, group: Any = None, src: int = 0) -> None:
        self.group, self.src = group, src

    def __call__(self, again: bool) -> None:
        torch.distributed.broadcast(torch.tensor([int(again)]), self.src, group=self.group)

    def receive(self) -> bool:
        flag = torch.tensor([0])
        torch.distributed.broadcast(flag, self.src, group=self.group)
        return bool(flag.item())


def follow_sync(
    source: WeightSource, barrier: TorchDistWalkBarrier, *, many_senders: bool = False, config: CheckpointEngineConfig | None = None
) -> None:
    """Trainer ranks other than 0, once per attempt rank 0 makes: with `many_senders` follow rank
    0's announcements and send this rank's own pieces (`sync_rollout_weights(source, None)`),
    else walk the weights (rank 0 gathers them). A failed send is rank 0's to report: every
    sending rank learns of it in the same round, and the barrier says whether another attempt
    follows."""
    follow = dataclasses.replace(config if config is not None else CheckpointEngineConfig(), senders="all")
    while True:
        if many_senders:
            try:
                sync_rollout_weights(source, None, config=follow)
            except SendFailed as exc:
                logger.warning("this rank's part of the sync failed (rank 0 reports it): %s", exc)
        else:
            for _ in source.iter_weights():
                pass
        if not barrier.receive():
            return
