"""The stream step of one sync: the senders send while every engine receives, and a failure is
blamed on its culprits (the weight source, engines, the sender, or other trainer ranks)."""

from __future__ import annotations

import concurrent.futures as cf
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from ckpt_engine.config import CheckpointEngineConfig
from ckpt_engine.delta.request import DeltaRequest
from ckpt_engine.manifest import BucketManifest
from ckpt_engine.pipeline.wire_views import SourceMismatch
from ckpt_engine.rollout_adapters.base import ReceiveReport, RolloutAdapter
from ckpt_engine.sources.base import WatchedWeights, WeightSource
from ckpt_engine.sources.sharded import PieceWalk, ShardedWeightSource
from ckpt_engine.sync.fanout import collect_failures, receive_failures
from ckpt_engine.sync.many_senders import ManySenders
from ckpt_engine.sync.regions import RegionDelivery
from ckpt_engine.sync.report import SOURCE, SyncError
from ckpt_engine.sync.sender_follower import finish_walk, send_message
from ckpt_engine.sync.staging import failure_deadline
from ckpt_engine.engine import CheckpointEngine, SendStats

__all__ = ["Break", "SyncStream"]

Break = Callable[[dict[str, str], float | None, set[str]], list[str]]
"""The session's reaction to a failed stream: (failed engines, the failure's deadline or None, the
engines its probe found unreachable: every engine was probed once already, or need not be) -> the
engines now stale.
It drops the group and leaves the engines stale (or discards staging, waiting no later than the
deadline: `staging.failure_deadline`)."""


class SyncStream:
    """Runs the stream step for a session, over its senders, region delivery and threads."""

    def __init__(
        self, config: CheckpointEngineConfig, senders: ManySenders, regions: RegionDelivery, pool: cf.ThreadPoolExecutor,
        broken: Break, new_engine: Callable[[int], CheckpointEngine],
    ) -> None:
        self.config, self._senders, self._regions, self._pool = config, senders, regions, pool
        self._broken, self._new_engine = broken, new_engine

    def run(
        self, rollouts: Sequence[RolloutAdapter], source: WeightSource, engine: CheckpointEngine, manifest: BucketManifest,
        weights: WatchedWeights, pieces: PieceWalk | None, request: DeltaRequest | None, senders: int, stage: str | None = None,
        sent: Callable[[], None] | None = None,
    ) -> tuple[SendStats, dict[str, ReceiveReport]]:
        """Stream `manifest` into every engine; any failure names its culprits and raises SyncError.
        `sent`: work of this rank's for the wait on the engines' answers, once its send went through
        (it must not raise: the receives are still in flight)."""
        if senders > 1:
            self._senders.start_send(send_message("send", manifest.digest, request, self._regions.announcement(), self._senders.installed))
            failed = self._senders.not_ready(source)  # type: ignore[arg-type]  # with TP helpers: every rank ready first
            if failed:
                # the engines only validated and paused: stale, not dead
                raise SyncError("transfer", failed, self._broken({}, None, set()))
        extra: dict[str, Any] = {k: v for k, v in (("delta", request), ("stage", stage)) if v is not None}  # only what is used
        receives = {r.name: self._pool.submit(r.receive, manifest, **extra) for r in rollouts}
        try:
            stats = self._regions.send(  # the engine's own send_weights without region delivery
                engine, manifest, weights, stable=_stable(source, senders), delta=request,
                make_engine=lambda: self._new_engine(engine.bucket_size_bytes), source=source,
            )
        except Exception as exc:
            self._send_failed(exc, rollouts, source, engine, weights, pieces, receives, senders, time.monotonic(), staged=stage is not None)
        if sent is not None:
            sent()
        deadline = failure_deadline(self.config.timeout_s, time.monotonic())
        followers = self._senders.failed(None) if senders > 1 else {}
        failed, unreachable = receive_failures(rollouts, receives, grace_s=self.config.timeout_s) if not followers else ({}, set())
        failed.update(followers)
        if failed:
            if followers:
                engine.finalize()  # wake receivers still waiting on a dead sender's group
                failed.update(collect_failures(receives, "receive", min(5.0, self.config.timeout_s)))
            stale = self._broken(failed, deadline, unreachable)
            raise SyncError("transfer", failed, stale)
        return stats, {name: f.result() for name, f in receives.items()}

    def _send_failed(
        self, exc: Exception, rollouts: Sequence[RolloutAdapter], source: WeightSource, engine: CheckpointEngine,
        weights: WatchedWeights, pieces: PieceWalk | None, receives: dict[str, cf.Future[ReceiveReport]], senders: int,
        sent: float, staged: bool,
    ) -> NoReturn:
        """The send raised (at monotonic time `sent`): blame the source when it raised itself, else
        the engines that failed or died, else the sender; every engine is left stale."""
        deadline = failure_deadline(self.config.timeout_s, sent)
        _drop_frames(exc)  # before the finalize: else the send loop's work handles keep the group open
        engine.finalize()  # closing the sender's group wakes receivers blocked on it
        if pieces is not None:
            finish_walk(source, pieces)  # type: ignore[arg-type]  # TP helpers wait in its gathers
        sender_error = f"{type(exc).__name__}: {exc}"
        followers = self._senders.failed(sender_error) if senders > 1 else {}
        if weights.error is not None or _yielded_amiss(exc):
            # The trainer's source failed (or yielded what its metadata does not say), not an engine:
            # the engines are healthy, paused and stale, and stay members; the next complete sync
            # heals them. Unstaged, their answers are waited for within the bound: a vLLM worker runs
            # one call at a time, so a receive still in flight when the error came held up the next
            # sync's first call to it, past that call's own bound. (Staged, the discards that follow
            # end the waits.)
            collect_failures(receives, "receive", min(5.0, self.config.timeout_s) if staged else max(0.0, deadline - time.monotonic()))
            raise SyncError("transfer", {SOURCE: sender_error}, self._broken({}, deadline, set())) from exc
        failed, unreachable = receive_failures(rollouts, receives, grace_s=min(5.0, self.config.timeout_s), failing=True)
        failed.update(followers)
        if not failed:
            failed["sender"] = sender_error
        stale = self._broken(failed, deadline, unreachable)
        raise SyncError("transfer", failed, stale, sender_error=sender_error if "sender" not in failed else None) from exc


def _yielded_amiss(exc: BaseException | None) -> bool:
    """Whether the send failed because the source yielded what its own metadata does not say."""
    while exc is not None:
        if isinstance(exc, SourceMismatch):
            return True
        exc = exc.__cause__
    return False


def _drop_frames(exc: BaseException) -> None:
    """Clear the locals of the finished frames `exc` and its causes went through. The send loop's
    pending work handles hold the sender's process groups, and a group keeps its connections open
    while anything holds it: a receiver still blocked on this sender (a survivor of a receiver
    killed mid-sync) then waited out its whole timeout_s before it could fail, answer, or join the
    next sync, instead of failing at once when the finalize drops the group."""
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__


def _stable(source: WeightSource, senders: int) -> bool:
    """Whether what the sender yields stays valid for the whole sync (lets it skip copies). With many
    senders a source may say so of its pieces alone (`stable_pieces`) and not of `iter_weights()`."""
    if senders > 1 and isinstance(source, ShardedWeightSource):
        return source.stable_pieces
    return source.stable_tensors
