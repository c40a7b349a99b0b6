"""What an engine process must expose for peer joins (`service.PeerService` drives it): its held
tensors and the guards that keep it from serving a half-written state."""

from __future__ import annotations

from typing import Protocol

import torch

__all__ = ["Offered", "PeerHost"]


class Offered(Protocol):
    """What a serving peer offers (`peer_source.PeerSource` reads it): named tensors of one version.
    The reference receiver offers its live tensors; a vLLM worker its staging copy of the version it
    serves (`rollout_adapters/vllm/peer.py`: vLLM's live weights are post-processed)."""

    tensors: dict[str, torch.Tensor]
    """What this rank offers, by name (a TP/EP rank: its slices)."""
    version: int | None
    """The version they hold completely (None: none, or a load in progress)."""
    stale: bool
    """A load failed part-way: out of service until a complete one."""
    receiving: bool


class PeerHost(Offered, Protocol):
    """An engine whose pulls land in the tensors it serves (`pull.pull_version`): the reference
    receiver's worker (`TorchRefWorker`); an engine that holds its weights as named tensors can be
    another. Its `tensors` are updated in place by every sync."""

    last_version: int | None
    received: str | None
    """A trainer transfer completed and not yet finalized (None: none). A pull drops it, so a
    trainer's finalize after a pull is refused instead of stamping its version on the pull's bytes."""

    def pause(self, mode: str) -> None:
        """Stop serving (no request reads the weights after this returns)."""

    def resume(self) -> None:
        """Serve again (refused while stale)."""
