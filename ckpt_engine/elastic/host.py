"""What an engine process must expose for peer joins (`service.PeerService` drives it): its held
tensors and the guards that keep it from serving a half-written state."""

from __future__ import annotations

from typing import Protocol

import torch

__all__ = ["PeerHost"]


class PeerHost(Protocol):
    """The reference receiver's worker (`TorchRefWorker`) is one; an engine that holds its weights
    as named tensors can be another."""

    tensors: dict[str, torch.Tensor]
    """What this rank holds, by name (a TP/EP rank: its slices), updated in place by every sync."""
    version: int | None
    """The version held completely (None: none, or a load in progress)."""
    last_version: int | None
    stale: bool
    """A load failed part-way: out of service until a complete one."""
    receiving: bool
    received: str | None
    """A trainer transfer completed and not yet finalized (None: none). A pull drops it, so a
    trainer's finalize after a pull is refused instead of stamping its version on the pull's bytes."""

    def pause(self, mode: str) -> None:
        """Stop serving (no request reads the weights after this returns)."""

    def resume(self) -> None:
        """Serve again (refused while stale)."""
