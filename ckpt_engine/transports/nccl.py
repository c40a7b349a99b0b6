"""nccl: the pipelined broadcast between CUDA devices.

Packing runs on the caller's current stream (where the weights were produced), the broadcast on a
side stream; events order the two per rotating buffer, so the host never waits on the device except
for the last bucket.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch

from ckpt_engine.transports.pipelined import PipelinedBroadcastEngine

__all__ = ["NcclCheckpointEngine"]


class NcclCheckpointEngine(PipelinedBroadcastEngine):
    device_type = "cuda"
    # A bucket of a few large tensors goes as one coalesced group of per-tensor broadcasts (no pack
    # or unpack copy; 0.99 of a raw broadcast on 2xH200 in bench/nccl_coalesced_probe.py); buckets
    # of many small tensors (MoE experts) are packed: per-message cost would dominate there.
    default_group_max_tensors = 64

    def __init__(self, *, high_priority: bool = True, **kwargs: Any) -> None:
        """`high_priority`: NCCL's streams (and ours) get the device's highest stream priority, so
        the block scheduler starts a bucket's collective ahead of pending blocks of other kernels:
        in fully-async RL the trainer keeps computing while it syncs. (In the stand-alone bench,
        where only our own copies compete, it made no measurable difference: bench/RESULTS.md.)"""
        if not isinstance(high_priority, bool):
            raise ValueError(f"high_priority must be true or false, got {high_priority!r}")
        self.high_priority = high_priority
        super().__init__(**kwargs)

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
        opts.is_high_priority_stream = self.high_priority
        group = torch.distributed.ProcessGroupNCCL(store, rank, world_size, opts)
        return group

    def _new_stream(self) -> Any:
        # torch maps a priority below the device's range to its highest one.
        return torch.cuda.Stream(device=self.device, priority=-8 if self.high_priority else 0)

    def _new_event(self) -> Any:
        return torch.cuda.Event()

    def _current_stream(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def _stream_ctx(self, stream: Any) -> Any:
        return torch.cuda.stream(stream)
