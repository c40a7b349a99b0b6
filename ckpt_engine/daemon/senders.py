"""Which trainer ranks send a daemon sync, and the walk guard for a sync where every rank sends.

With `checkpoint_engine.senders` = `all` (or `auto` where the backend and every member take many
senders), a sharded trainer (FSDP2) sends from every rank: rank 0's daemon drives the session,
the other ranks follow its announcements (`sync_rollout_weights(source, None)`), and nobody walks
`iter_weights()` (its gathers would be collectives). The daemon decides once per sync and the
trainer tells its other ranks the same decision (see `ckpt_engine.trainer.ranks`), so every rank
takes the same path.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence

import torch

from ckpt_engine.rollout_adapters.capabilities import lacking
from ckpt_engine.config import CheckpointEngineConfig
from ckpt_engine.daemon.outcome import OneWalkPerAttempt
from ckpt_engine.manifest import TensorSpec
from ckpt_engine.planning.ownership import OwnerMap
from ckpt_engine.registry import CheckpointEngineRegistry
from ckpt_engine.rollout_adapters.base import RolloutAdapter
from ckpt_engine.sync.sender_channel import SenderChannel
from ckpt_engine.sync.sender_follower import join_message, send_message
from ckpt_engine.sources.sharded import ShardedWeightSource
from ckpt_engine.sources.base import WeightSource

__all__ = ["ShardedWalk", "sends_from_every_rank"]

logger = logging.getLogger(__name__)


def sends_from_every_rank(config: CheckpointEngineConfig, source: WeightSource, engines: Sequence[RolloutAdapter]) -> bool:
    """Whether this sync streams from every trainer rank. `rank0`: never; `all` / `per_stage`:
    whenever the source is sharded over several ranks (the session refuses, by name, a backend or
    engine that cannot take it); `auto`: only where the backend and every engine take it, else
    rank 0 sends after a gather."""
    if config.senders == "rank0":
        return False
    if not isinstance(source, ShardedWeightSource) or not source.sharded:
        return False
    if config.senders != "auto":
        return True
    backend = CheckpointEngineRegistry.get(CheckpointEngineRegistry.resolve_name(config.backend))
    return bool(backend.supports_many_senders) and not lacking(engines, "many_senders")


class ShardedWalk(OneWalkPerAttempt, ShardedWeightSource):
    """OneWalkPerAttempt for a sync where every trainer rank sends its own pieces.

    The session never walks `iter_weights()` then (it asks for `local_piece`s), so this guard never
    walks either. Its collective duty is another: per attempt, the other ranks expect two
    announcements (join, send) over the trainer's group. The session makes them once its sync has
    started (`metadata()` is its first call); when an attempt ends before that (no engine
    reachable, the session refused the senders setting), `finish()` announces "no group, skip" so
    the other ranks finish the attempt with rank 0.
    """

    source: ShardedWeightSource

    def __init__(self, source: ShardedWeightSource, timeout_s: float) -> None:
        super().__init__(source)
        self.sender_index = source.sender_index
        self.num_senders = source.num_senders
        self.process_group = source.process_group
        self.collective_pieces = source.collective_pieces
        self.timeout_s = timeout_s
        self._started = False
        self._channel: SenderChannel | None = None

    @property
    def stable_pieces(self) -> bool:
        return self.source.stable_pieces

    def sharded_refusal(self) -> str | None:
        return self.source.sharded_refusal()

    def begin(self) -> None:
        super().begin()
        self._started = False

    def metadata(self) -> list[TensorSpec]:
        self._started = True
        return super().metadata()

    def owners(self) -> OwnerMap:
        try:
            return self.source.owners()
        except Exception as exc:
            self.error = exc
            raise

    def local_piece(self, name: str) -> torch.Tensor:
        try:
            return self.source.local_piece(name)
        except Exception as exc:
            self.error, self.error_in_walk = exc, True
            raise

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(())  # nothing to drain: no rank walks in a sync where every rank sends

    def finish(self) -> None:
        if not self._started:
            self._started = True
            if self._channel is None:
                self._channel = SenderChannel(self.process_group, timeout_s=self.timeout_s)
            self._channel.publish(join_message(None, {}))
            self._channel.publish(send_message("skip"))
        self._it, self._done = None, True
