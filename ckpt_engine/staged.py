"""StagedVersion (issue 28): a version received and checked while the engine serves, not yet live.

Declared here, below the transports that return one (`CheckpointEngine.receive_staged`) and the
receivers that keep one until the swap; the implementations live in `pipeline/staging.py`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import ClassVar

import torch

__all__ = ["Bucket", "StagedVersion"]

Bucket = list[tuple[str, torch.Tensor]]
"""What a loader takes: one bucket's (name, tensor) pairs."""


class StagedVersion(ABC):
    """One version received and checked, not yet live."""

    mode: ClassVar[str]
    """`patches` or `full` (`RolloutAdapter.receive(stage=...)`)."""

    @abstractmethod
    def apply(self) -> Iterator[Bucket]:
        """Make the version live (call between two engine steps): yields what the engine's loader
        takes, bucket by bucket (tensors already live are yielded themselves: a loader's copy of
        a tensor onto itself is skipped). Applying twice is refused."""

    @abstractmethod
    def discard(self) -> None:
        """Drop the version; the live weights stay the previous version."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Memory the staged version holds (beyond a kept staging copy)."""
