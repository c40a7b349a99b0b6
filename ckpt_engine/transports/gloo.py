"""gloo: the pipelined broadcast over CPU tensors (TCP), for CPU-only clusters and tests.

Ordering is kept with gloo's asynchronous work handles: a slot is refilled once the work that
read (sender) or wrote (receiver) it has completed, each wait bounded by `timeout_s`.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch

from ckpt_engine.transports.collectives import WorkList
from ckpt_engine.transports.process_groups import ProcessGroupTransport
from ckpt_engine.transports.transport import Frames

__all__ = ["GlooFrames", "GlooTransport"]


class GlooTransport(ProcessGroupTransport):
    """Host process groups; every wait is on a work handle, with the timeout."""

    name = "gloo"
    device_type = "cpu"
    # On CPU every pack or unpack copy takes core time that the socket copies need too, while an
    # extra message costs little (bench/RESULTS.md): tensors of 1 MiB and up travel alone, from the
    # sender's memory into the receiver's destination when both allow it.
    default_solo_bytes = 1 << 20

    @classmethod
    def resolve_device(cls, device: str | int | torch.device | None) -> torch.device:
        if device is not None and torch.device(device).type != "cpu":
            raise ValueError(f"the gloo backend moves CPU tensors; got device={device!r} (use nccl or hccl)")
        return torch.device("cpu")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._frames = GlooFrames(self)

    @property
    def frames(self) -> Frames | None:
        return self._frames

    def make_group(self, store: torch.distributed.Store, rank: int, world_size: int) -> Any:
        return torch.distributed.ProcessGroupGloo(store, rank, world_size, datetime.timedelta(seconds=self.timeout_s))

    def wait_work(self, work: Any, what: str) -> None:
        try:
            work.wait(datetime.timedelta(seconds=self.timeout_s))
        except Exception as exc:
            raise self._failed(what, exc) from exc

    def wait_slot(self, slot: int, works: list[Any]) -> None:
        if works[slot] is not None:
            self.wait_work(works[slot], f"broadcast from buffer {slot}")
            works[slot] = None

    def post(self, gid: int, slot: int, msg: torch.Tensor) -> Any:
        return self.broadcast(gid, msg)

    def broadcast(self, gid: int, msg: torch.Tensor) -> Any:
        """One message from group `gid`'s sender, slotted or a delta frame: gloo reads and writes
        host memory, so there is no ordering to add."""
        return self._groups[gid].broadcast(msg, 0)

    def post_group(self, gid: int, slot: int, msgs: list[torch.Tensor]) -> Any:
        group = self._groups[gid]
        return WorkList([group.broadcast(m, 0) for m in msgs])  # gloo cannot coalesce; same order

    def finish(self, k: int, sender: int, slot: int, work: Any, label: str) -> None:
        self.wait_work(work, f"bucket {label}")

    def release(self, slot: int) -> None:
        pass

    def drain_slots(self, works: list[Any]) -> None:
        for i, work in enumerate(works):
            if work is not None:
                self.wait_work(work, f"broadcast from buffer {i}")


class GlooFrames(Frames):
    """Delta frames over gloo's groups: the host waits on each broadcast's work handle."""

    def __init__(self, transport: GlooTransport) -> None:
        self.t = transport

    def post(self, gid: int, msg: torch.Tensor, *, after_producer: bool = True) -> Any:
        return self.t.broadcast(gid, msg)

    def fresh(self, gid: int, size: int, dtype: torch.dtype = torch.uint8, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        return torch.empty(shape if shape is not None else (size,), dtype=dtype)

    def settle(self, gid: int, work: Any, what: str) -> None:
        if work is not None:
            self.t.wait_work(work, what)

    def drain(self, works: list[Any], what: str) -> None:
        for work in works:
            self.t.wait_work(work, what)
