"""The controller's side of a sync with many senders: `ManySenders`, held by a WeightSyncSession.

Trainer rank 0 decides, per sync, how many ranks send (config `senders`), announces to the other
trainer ranks whether to (re)join a group and whether to send (`SenderChannel`), and collects
their outcome in one report round; whatever happens on rank 0, the other ranks get both
announcements and the report round, so nobody waits on a collective rank 0 skipped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from ckpt_engine.rollout_adapters.capabilities import lacking
from ckpt_engine.config import CheckpointEngineConfig
from ckpt_engine.manifest import BucketManifest
from ckpt_engine.rollout_adapters.base import RolloutAdapter
from ckpt_engine.sources.base import WeightSource
from ckpt_engine.sources.sharded import ShardedWeightSource
from ckpt_engine.sync.sender_channel import SenderChannel
from ckpt_engine.sync.installed_shares import sender_shares
from ckpt_engine.sync.sender_follower import join_message, send_message
from ckpt_engine.registry import CheckpointEngineRegistry

__all__ = ["ManySenders", "refuse_to_followers", "wants_many_senders"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


def wants_many_senders(source: WeightSource, mode: str) -> bool:
    """Whether `source` sends from every trainer rank under config `senders` = `mode`."""
    sharded = isinstance(source, ShardedWeightSource) and source.sharded
    return mode in ("all", "per_stage") or (mode == "auto" and sharded)


def refuse_to_followers(source: WeightSource, timeout_s: float, error: str) -> None:
    """Trainer rank 0 failed a many-sender sync before any announcement (no engines passed, the
    session or the senders setting refused): the other ranks, waiting for its "join", get "no
    group" and a "skip" with the error, and raise it (`SenderFollower.sync`) instead of waiting."""
    if not isinstance(source, ShardedWeightSource):
        return
    try:
        channel = SenderChannel(source.process_group, timeout_s=timeout_s)
        channel.publish(join_message(None, {}))
        channel.publish(send_message("skip", error=error[:4000]))
    except Exception as exc:
        logger.warning("telling the other trainer ranks that this sync was refused failed: %s", exc)


class ManySenders:
    """Trainer rank 0's channel to the other sending ranks, kept across syncs (made on first use)."""

    runs = 0
    """How many syncs any `ManySenders` of this process has run (`run`): `sync_rollout_weights`
    tells the other ranks of a refusal itself when a call raised before one began."""

    def __init__(self, config: CheckpointEngineConfig, backend: str, rollouts: Sequence[RolloutAdapter]) -> None:
        self.config = config
        self.backend = backend
        self.rollouts = rollouts
        self._channel: SenderChannel | None = None
        self._owed: set[str] = set()
        self._gather_owed = False
        self.figures: list[dict[str, float]] = []
        """The other sending ranks' figures of the last send (`send_figures`), for the report."""
        self.installed: dict[str, Any] | None = None
        """This sync's installed-weight check as announced with the send (`InstalledChecks.announcement`)."""
        self.own_shares: Callable[[], list[int]] | None = None
        """Rank 0's shares of that check (`sender_shares`), folded after the report round."""
        self.shares: list[list[int] | None] = []
        """Every rank's shares of the last checked send (rank order), for `InstalledChecks.combine`."""

    def announce_check(self, source: ShardedWeightSource, manifest: BucketManifest, announced: dict[str, Any]) -> None:
        """This sync's installed-weight check goes with the send; rank 0 folds its own shares of it."""
        self.installed = announced
        self.own_shares = lambda: sender_shares(source, manifest, announced)

    def count(self, source: WeightSource) -> int:
        """How many trainer ranks send this sync (config `senders`; see CheckpointEngineConfig);
        refuses, by name, a source, backend or engine that cannot take many senders."""
        mode = self.config.senders
        if not wants_many_senders(source, mode):
            return 1
        if not isinstance(source, ShardedWeightSource) or not source.sharded:
            why = source.sharded_refusal() if isinstance(source, ShardedWeightSource) else None
            if why:
                raise ValueError(f"checkpoint_engine.senders={mode!r}: {why}")
            raise ValueError(
                f"checkpoint_engine.senders={mode!r} needs a sharded weight source (a ShardedWeightSource over more "
                f"than one rank, e.g. the FSDP2 trainer); {type(source).__name__} is not one. Use senders=rank0"
            )
        if source.sender_index != 0:
            raise ValueError(f"the controller must be sender 0, this source is sender {source.sender_index}")
        if not CheckpointEngineRegistry.get(self.backend).supports_many_senders:
            raise ValueError(f"the {self.backend} backend has one sender only; use senders=rank0")
        single = lacking(self.rollouts, "many_senders")
        if single:
            raise ValueError(f"engine(s) {', '.join(single)} take weights from one sender only; use senders=rank0")
        if self._channel is None:
            self._channel = SenderChannel(source.process_group, timeout_s=self.config.timeout_s)
        return source.num_senders

    def announce(self, message: dict[str, Any]) -> None:
        """Publish a join or send announcement to the other trainer ranks."""
        assert self._channel is not None
        self._channel.publish(message)
        self._owed.discard(message["kind"])

    def run(self, body: Callable[[], T]) -> T:
        """Run one sync (`body`) with every trainer rank sending: the other ranks follow two
        announcements per sync and report their send; whatever happens in `body`, they get both
        and the report round."""
        ManySenders.runs += 1
        self._owed = {"join", "send"}
        self._gather_owed = False
        self.installed, self.own_shares, self.shares = None, None, []
        error: str | None = None
        try:
            return body()
        except BaseException as exc:
            error = f"trainer rank 0: {type(exc).__name__}: {exc}"
            raise
        finally:
            try:
                if "join" in self._owed:
                    self.announce(join_message(None, {}))
                if "send" in self._owed:  # failed before the send: the other ranks raise this error too
                    logger.info("the sync failed before the send (%s); telling the other trainer ranks", error)
                    self.installed = None
                    self.announce(send_message("skip", error=(error or "trainer rank 0: the sync ended before the send")[:4000]))
                if self._gather_owed:
                    self._gather_owed = False
                    self._channel.gather_status(error)  # type: ignore[union-attr]
            except Exception as exc:
                logger.warning("telling the other trainer ranks how the sync ended failed: %s", exc)

    def start_send(self, message: dict[str, Any]) -> None:
        """Announce the send; the report round (`failed`) is owed from here on."""
        self.announce(message)
        self._gather_owed = True

    def failed(self, own_error: str | None) -> dict[str, str]:
        """The report round after a send: which trainer ranks failed (by rank), as `failed` entries."""
        self._gather_owed = False
        self.figures = []
        try:
            statuses = self._channel.gather_status(own_error)  # type: ignore[union-attr]
        except Exception as exc:
            return {"trainer ranks": f"the report round after the send failed (a sending rank died or hung?): {exc}"}
        self.figures = [f for f in self._channel.last_figures[1:] if f is not None]  # type: ignore[union-attr]
        failed = {f"trainer rank {i}": e for i, e in enumerate(statuses) if e is not None and i != 0}
        if self.installed is not None and all(e is None for e in statuses):  # every rank takes this round then
            failed.update(self._gather_shares())
        return failed

    def _gather_shares(self) -> dict[str, str]:
        """The installed-check round (every rank sent): each rank's digest shares to `shares`."""
        assert self.installed is not None
        own: list[int] | None = None
        try:
            own = self.own_shares() if self.own_shares is not None else None
        except Exception as exc:  # the round still runs: the other ranks wait in it
            logger.warning("trainer rank 0: folding its installed-check shares failed: %s", exc)
        try:
            self.shares = self._channel.gather_shares(own, len(self.installed["keys"]))  # type: ignore[union-attr]
        except Exception as exc:
            return {"trainer ranks": f"the installed-check round after the send failed (a sending rank died or hung?): {exc}"}
        return {}

    def not_ready(self, source: ShardedWeightSource) -> dict[str, str]:
        """With TP helpers (`collective_pieces`), one round before anything streams: the trainer
        ranks that cannot take part (their join, plan or digest), by name, so the sync fails before
        a sender or a helper waits in a TP gather and the receivers wait for a sender. {}: all ready."""
        if not source.collective_pieces:
            return {}
        try:
            statuses = self._channel.gather_status(None)  # type: ignore[union-attr]
        except Exception as exc:
            return {"trainer ranks": f"the ready round before the send failed: {exc}"}
        return {f"trainer rank {i}": e for i, e in enumerate(statuses) if e is not None}
