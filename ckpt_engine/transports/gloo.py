"""gloo: the pipelined broadcast over CPU tensors (TCP), for CPU-only clusters and tests."""

from __future__ import annotations

import datetime
from typing import Any

import torch

from ckpt_engine.transports.pipelined import PipelinedBroadcastEngine

__all__ = ["GlooCheckpointEngine"]


class GlooCheckpointEngine(PipelinedBroadcastEngine):
    device_type = "cpu"
    # On CPU every pack or unpack copy takes core time that the socket copies need too, while an
    # extra message costs little (bench/RESULTS.md): tensors of 1 MiB and up travel alone, from the
    # sender's memory into the receiver's destination when both allow it.
    default_solo_bytes = 1 << 20

    def _resolve_device(self, device: str | int | torch.device | None) -> torch.device:
        if device is not None and torch.device(device).type != "cpu":
            raise ValueError(f"the gloo backend moves CPU tensors; got device={device!r} (use nccl or hccl)")
        return torch.device("cpu")

    def _make_group(self, store: torch.distributed.Store, rank: int, world_size: int) -> Any:
        return torch.distributed.ProcessGroupGloo(store, rank, world_size, datetime.timedelta(seconds=self.timeout_s))
