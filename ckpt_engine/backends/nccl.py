"""nccl: the pipelined broadcast between CUDA devices.

Packing runs on the caller's current stream (where the weights were produced), the broadcast on a
side stream; events order the two per rotating buffer, so the host never waits on the device except
for the last bucket.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch

from ckpt_engine.backends.pipelined import PipelinedBroadcastEngine

__all__ = ["NcclCheckpointEngine"]


class NcclCheckpointEngine(PipelinedBroadcastEngine):
    device_type = "cuda"

    def _resolve_device(self, device: str | int | torch.device | None) -> torch.device:
        if not torch.cuda.is_available():
            raise ValueError("the nccl backend needs CUDA, and torch sees no CUDA device here (use gloo on CPU)")
        dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        if dev.type != "cuda":
            raise ValueError(f"the nccl backend moves CUDA tensors; got device={device!r}")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(dev)
        return dev

    def _make_group(self, store: torch.distributed.Store, rank: int, world_size: int) -> Any:
        opts = torch.distributed.ProcessGroupNCCL.Options()
        opts._timeout = datetime.timedelta(seconds=self.timeout_s)
        group = torch.distributed.ProcessGroupNCCL(store, rank, world_size, opts)
        return group

    def _new_stream(self) -> Any:
        return torch.cuda.Stream(device=self.device)

    def _new_event(self) -> Any:
        return torch.cuda.Event()

    def _current_stream(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def _stream_ctx(self, stream: Any) -> Any:
        return torch.cuda.stream(stream)
