"""hccl: the pipelined broadcast between Ascend NPUs, through torch_npu.

Same streams-and-events transport as nccl with torch.npu streams and events. torch_npu is imported
here, at module load, so the registry reports a clean "could not be loaded" error on machines
without it.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch_npu  # noqa: F401  (registers torch.npu and ProcessGroupHCCL)

from ckpt_engine.transports.nccl import StreamTransport

__all__ = ["HcclTransport"]


class HcclTransport(StreamTransport):
    name = "hccl"
    device_type = "npu"

    @classmethod
    def resolve_device(cls, device: str | int | torch.device | None) -> torch.device:
        npu = torch.npu  # type: ignore[attr-defined]
        dev = torch.device("npu", npu.current_device()) if device is None else torch.device(device)
        if dev.type != "npu":
            raise ValueError(f"the hccl backend moves NPU tensors; got device={device!r}")
        npu.set_device(dev)
        return dev

    def make_group(self, store: torch.distributed.Store, rank: int, world_size: int) -> Any:
        pg_cls = torch_npu._C._distributed_c10d.ProcessGroupHCCL
        opts = pg_cls.Options()
        opts._timeout = datetime.timedelta(seconds=self.timeout_s)
        return pg_cls(store, rank, world_size, opts)

    def new_stream(self) -> Any:
        return torch.npu.Stream(device=self.device)  # type: ignore[attr-defined]

    def new_event(self) -> Any:
        return torch.npu.Event()  # type: ignore[attr-defined]

    def current_stream(self) -> Any:
        return torch.npu.current_stream(self.device)  # type: ignore[attr-defined]

    def stream_ctx(self, stream: Any) -> Any:
        return torch.npu.stream(stream)  # type: ignore[attr-defined]

