"""Small collective helpers the transports share: waiting on several works, coalescing."""

from __future__ import annotations

import datetime
import time
from typing import Any

import torch

__all__ = ["WorkList", "coalesced_broadcast"]


class WorkList:
    """Several pending works waited on as one, within one deadline."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self, timeout: datetime.timedelta) -> bool:
        deadline = time.monotonic() + timeout.total_seconds()
        for work in self.works:
            work.wait(datetime.timedelta(seconds=max(0.001, deadline - time.monotonic())))
        return True

    def is_completed(self) -> bool:
        """Whether every work has finished (successfully or not: `wait` then says which)."""
        return all(work.is_completed() for work in self.works)


def coalesced_broadcast(group: Any, msgs: list[torch.Tensor]) -> Any:
    """Broadcasts from group rank 0 of every message as one NCCL group (one launch); the current
    stream waits for it. Ranks must pass the same number of messages with the same sizes."""
    group._start_coalescing()
    try:
        for m in msgs:
            group.broadcast(m, 0)
    finally:
        work = group._end_coalescing()
    work.wait()
    return work
