"""`LocalLoraRollout`: the RolloutAdapter side shared by adapter-sync engines whose receiving rank
is a `LoraReceiverCore` in the calling process (the reference receiver, SGLang's controller side).

Such an engine never pauses (a sync never touches a version a request uses); validate, receive and
leave are the core's, under one lock that also guards the engine's own version bookkeeping. Each
engine adds only what differs: its `engine_key`, how `finalize` installs a version, its health.
"""

from __future__ import annotations

import threading
from typing import Any, Generic, TypeVar

from ckpt_engine.delta.request import DeltaRequest
from ckpt_engine.manifest import BucketManifest
from ckpt_engine.rollout_adapters.base import JoinOptions, ManifestRejectedError, ReceiveReport, RolloutAdapter
from ckpt_engine.rollout_adapters.capabilities import EngineCapabilities
from ckpt_engine.rollout_adapters.lora_receiver import LoraReceiverCore
from ckpt_engine.engine import Rendezvous

__all__ = ["LocalLoraRollout"]

T = TypeVar("T")


class LocalLoraRollout(RolloutAdapter, Generic[T]):
    """Join / validate / receive / leave through an in-process `LoraReceiverCore`; nothing to pause."""

    capabilities = EngineCapabilities(delta=True, many_senders=True, weights="adapters")

    def __init__(self, name: str, core: LoraReceiverCore[T]) -> None:
        self.name = name
        self.core = core
        self._lock = threading.Lock()
        """Guards the core's versions against requests beginning / ending on other threads."""

    def join(self, rendezvous: Rendezvous, rank_offset: int, options: JoinOptions) -> None:
        self.core.join(rendezvous.to_dict(), rank_offset, options.to_dict())

    def validate(self, manifest: BucketManifest, encoded: bytes) -> None:
        with self._lock:
            reply = self.core.validate(encoded, manifest.digest)
        if not reply["accepted"]:
            raise ManifestRejectedError(self.name, reply["problems"] or ["rejected"])

    def pause(self, mode: str) -> None:
        """Nothing to pause: a sync never touches a version a request uses."""

    def receive(self, manifest: BucketManifest, delta: DeltaRequest | None = None) -> ReceiveReport:
        return ReceiveReport.from_dict(self.core.receive(manifest.digest, delta.to_dict() if delta is not None else None))

    def resume(self) -> None:
        """Nothing was paused."""

    def health(self) -> dict[str, Any]:
        return self.core.health()

    def leave(self) -> None:
        self.core.leave()
