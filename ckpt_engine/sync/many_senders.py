"""The controller's side of a sync with many senders (mixed into WeightSyncSession).

Trainer rank 0 decides, per sync, how many ranks send (config `senders`), announces to the other
trainer ranks whether to (re)join a group and whether to send (`SenderChannel`), and collects
their outcome in one report round; whatever happens on rank 0, the other ranks get both
announcements and the report round, so nobody waits on a collective rank 0 skipped.
"""

from __future__ import annotations

import logging
from typing import Any

from ckpt_engine.transports.base import CheckpointEngine
from ckpt_engine.transports.registry import CheckpointEngineRegistry
from ckpt_engine.sync.sender_channel import SenderChannel
from ckpt_engine.sync.sender_follower import join_message, send_message
from ckpt_engine.sources.sharded import ShardedWeightSource
from ckpt_engine.sync.report import SyncError, SyncReport
from ckpt_engine.sources.base import WeightSource

__all__ = ["ManySendersMixin", "wants_many_senders"]

logger = logging.getLogger(__name__)


def wants_many_senders(source: Any, mode: str) -> bool:
    """Whether `source` sends from every trainer rank under config `senders` = `mode`."""
    sharded = isinstance(source, ShardedWeightSource) and source.sharded
    return mode in ("all", "per_stage") or (mode == "auto" and sharded)


class ManySendersMixin:
    def _senders_for(self, source: WeightSource) -> int:
        """How many trainer ranks send this sync (config `senders`; see CheckpointEngineConfig)."""
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
        if not self._engine_class().supports_many_senders:
            raise ValueError(f"the {self.backend} backend has one sender only; use senders=rank0")
        single = [r.name for r in self.rollouts if not r.supports_many_senders]
        if single:
            raise ValueError(f"engine(s) {', '.join(single)} take weights from one sender only; use senders=rank0")
        if self._channel is None:
            self._channel = SenderChannel(source.process_group, timeout_s=self.config.timeout_s)
        return int(source.num_senders)

    def _engine_class(self) -> type[CheckpointEngine]:
        return CheckpointEngineRegistry.get(self.backend)

    def _announce(self, message: dict[str, Any]) -> None:
        assert self._channel is not None
        self._channel.publish(message)
        self._owed.discard(message["kind"])

    def _sharded_sync(self, source: Any, senders: int, version: int | None) -> SyncReport:
        """A sync with every trainer rank sending: the other ranks follow two announcements per
        sync and report their send; whatever happens here, they get both and the report round."""
        self._owed = {"join", "send"}
        self._gather_owed = False
        error: str | None = None
        try:
            return self._sync(source, None, version, senders)
        except BaseException as exc:
            error = f"trainer rank 0: {type(exc).__name__}: {exc}"
            raise
        finally:
            try:
                if "join" in self._owed:
                    self._announce(join_message(None, {}))
                if "send" in self._owed:
                    self._announce(send_message("skip"))
                if self._gather_owed:
                    self._gather_owed = False
                    self._channel.gather_status(error)  # type: ignore[union-attr]
            except Exception as exc:
                logger.warning("telling the other trainer ranks how the sync ended failed: %s", exc)

    def _followers_failed(self, own_error: str | None) -> dict[str, str]:
        """The report round after a send: which trainer ranks failed (by rank), as `failed` entries."""
        self._gather_owed = False
        try:
            statuses = self._channel.gather_status(own_error)  # type: ignore[union-attr]
        except Exception as exc:
            return {"trainer ranks": f"the report round after the send failed (a sending rank died or hung?): {exc}"}
        return {f"trainer rank {i}": e for i, e in enumerate(statuses) if e is not None and i != 0}

    def _senders_ready(self, source: ShardedWeightSource) -> None:
        """With TP helpers (`collective_pieces`), one round before anything streams: a trainer rank
        that cannot take part (its join, plan or digest) fails the sync here, by name, before a
        sender or a helper waits in a TP gather and the receivers wait for a sender."""
        if not source.collective_pieces:
            return
        try:
            statuses = self._channel.gather_status(None)  # type: ignore[union-attr]
        except Exception as exc:
            failed = {"trainer ranks": f"the ready round before the send failed: {exc}"}
        else:
            failed = {f"trainer rank {i}": e for i, e in enumerate(statuses) if e is not None}
        if failed:
            self._break({}, probe=False)  # type: ignore[attr-defined]  # the engines only validated and paused: stale, not dead
            raise SyncError("transfer", failed, sorted(self.stale))  # type: ignore[attr-defined]
