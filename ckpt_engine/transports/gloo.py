"""gloo: the pipelined broadcast over CPU tensors (TCP), for CPU-only clusters and tests.

Ordering is kept with gloo's asynchronous work handles: a slot is refilled once the work that
read (sender) or wrote (receiver) it has completed, each wait bounded by `timeout_s`.
"""

from __future__ import annotations

import datetime
from typing import Any, ClassVar

import torch

from ckpt_engine.pipeline.engine import PipelinedEngine
from ckpt_engine.transports.collectives import WorkList
from ckpt_engine.transports.process_groups import ProcessGroupTransport
from ckpt_engine.transports.transport import Transport

__all__ = ["GlooCheckpointEngine", "GlooTransport"]


class GlooTransport(ProcessGroupTransport):
    """Host process groups; every wait is on a work handle, with the timeout."""

    name = "gloo"
    # On CPU every pack or unpack copy takes core time that the socket copies need too, while an
    # extra message costs little (bench/RESULTS.md): tensors of 1 MiB and up travel alone, from the
    # sender's memory into the receiver's destination when both allow it.
    default_solo_bytes = 1 << 20

    @classmethod
    def resolve_device(cls, device: str | int | torch.device | None) -> torch.device:
        if device is not None and torch.device(device).type != "cpu":
            raise ValueError(f"the gloo backend moves CPU tensors; got device={device!r} (use nccl or hccl)")
        return torch.device("cpu")

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

    def post(self, gid: int, slot: int | None, msg: torch.Tensor, *, after_producer: bool = True) -> Any:
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

    def settle(self, gid: int, work: Any, what: str) -> None:
        if work is not None:
            self.wait_work(work, what)

    def drain(self, works: list[Any], what: str) -> None:
        for work in works:
            self.wait_work(work, what)


class GlooCheckpointEngine(PipelinedEngine):
    """The pipeline over gloo."""

    transport_cls: ClassVar[type[Transport]] = GlooTransport
    device_type = "cpu"
