"""colocated: sender and receiver on one device (or one host), no collective at all.

The sender's rotating buffers are shared with the one receiver: CUDA IPC handles on GPU, a
file-backed shared mapping on CPU. Only "bucket k is ready" / "slot is free" flags travel, through
the rendezvous store; the bytes never move, the receiver's loader reads them in place.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Sequence
from typing import Any, ClassVar

import msgpack
import torch

from ckpt_engine.pipeline.engine import PipelinedEngine
from ckpt_engine.transports.base import Rendezvous, Topology, TransferError
from ckpt_engine.transports.shared_buffers import map_buffers, share_buffers, unlink_files, validate_descriptors
from ckpt_engine.transports.transport import SLACK, Transport

__all__ = ["ColocatedCheckpointEngine", "ColocatedTransport"]

logger = logging.getLogger(__name__)


class ColocatedTransport(Transport):
    """Shared-buffer hand-off between one sender (rank 0) and one receiver (rank 1)."""

    name = "colocated"
    supports_delta = False
    stable_sources = False
    """The receiver reads the shared buffers: every bucket must be packed into them."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._store: Any = None
        self._shm_paths: list[str] = []
        self._seq = 0  # syncs since join; namespaces the flags of one sync
        self._sent = 0
        self._received = 0
        self._released = 0

    @classmethod
    def resolve_device(cls, device: str | int | torch.device | None) -> torch.device:
        dev = torch.device("cpu") if device is None else torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        return dev

    def prepare(self) -> dict[str, Any]:
        return {"device": str(self.device), "buffer_bytes": sum(b.numel() for b in self.buffers), "num_buffers": self.num_buffers}

    @property
    def group(self) -> Any:
        return self._store

    def refuse_delta(self) -> str | None:
        return "the colocated backend hands buffers over in place; delta sync does not apply (use delta=off)"

    def reads_in_place(self, sender: int) -> bool:
        return True

    def join(self, rendezvous: Rendezvous, rank: int) -> None:
        if self._store is not None:
            raise RuntimeError("init_process_group() was already called; call finalize() first to rejoin")
        if rendezvous.world_size != 2 or rank not in (0, 1):
            raise ValueError("the colocated backend pairs exactly one sender (rank 0) and one receiver (rank 1)")
        store = rendezvous.connect_store()
        self._seq = 0
        self.rank, self.world_size = rank, 2
        size = self.bucket_size_bytes + SLACK
        if rank == 0:
            self.buffers, descs, self._shm_paths = share_buffers(self.device, self.num_buffers, size)
            store.set("colocated/buffers", msgpack.packb({"size": size, "buffers": descs}, use_bin_type=True))
        else:
            store.wait(["colocated/buffers"], datetime.timedelta(seconds=self.timeout_s))
            info = msgpack.unpackb(store.get("colocated/buffers"), raw=False)
            descs = validate_descriptors(info, self.num_buffers, size, "the colocated sender")
            self.buffers = map_buffers(self.device, descs, size)
        self._store = store
        self.broken = False
        logger.info("colocated rank %d mapped %d shared buffers of %d bytes", rank, self.num_buffers, size)

    def close(self) -> None:
        self._store = None
        self.buffers = []
        unlink_files(self._shm_paths)

    def abort(self) -> None:
        self.broken = True

    # --- flags through the store instead of collectives ------------------------------------------
    def _key(self, what: str, k: int) -> str:
        return f"s{self._seq}/{what}/{k}"

    def _wait_key(self, key: str, what: str) -> None:
        try:
            self._store.wait([key], datetime.timedelta(seconds=self.timeout_s))
        except Exception as exc:
            self.broken = True
            raise TransferError(f"rank {self.rank}: {what} did not arrive within {self.timeout_s}s: {exc}") from exc
        self._store.delete_key(key)

    def begin_send(self, own_index: list[int]) -> None:
        self._seq += 1
        self._sent = 0

    def begin_receive(self) -> None:
        self._seq += 1
        self._received = 0
        self._released = 0

    def end_receive(self) -> None:
        self._release_pending()

    def wait_slot(self, slot: int, works: list[Any]) -> None:
        if works[slot] is not None:
            self._wait_key(self._key("free", works[slot]), f"release of bucket {works[slot]}")
            works[slot] = None

    def post(self, gid: int, slot: int | None, msg: torch.Tensor, *, after_producer: bool = True) -> Any:
        if slot is None:
            raise RuntimeError("the colocated transport carries slotted buckets only")
        if not self.is_sender:
            # Called once the loader is done with the previous bucket in this slot: release it.
            self._release_pending()
            return None
        self.device_sync_point()
        k = self._sent
        self._sent += 1
        self._store.set(self._key("ready", k), b"1")
        return k

    def post_group(self, gid: int, slot: int, msgs: list[torch.Tensor]) -> Any:
        raise RuntimeError("the colocated transport never sends a bucket as a group (receivers read the slots in place)")

    def drain_slots(self, works: list[Any]) -> None:
        for k in works:
            if k is not None:
                self._wait_key(self._key("free", k), f"release of bucket {k}")

    def _release_pending(self) -> None:
        if self._released < self._received:
            self.device_sync_point()
            while self._released < self._received:
                self._store.set(self._key("free", self._released), b"1")
                self._released += 1

    def finish(self, k: int, sender: int, slot: int, work: Any, label: str) -> None:
        self._release_pending()
        self._wait_key(self._key("ready", k), f"bucket {k}")
        self._received = k + 1

    def release(self, slot: int) -> None:
        pass

    def settle(self, gid: int, work: Any, what: str) -> None:
        raise RuntimeError("the colocated transport carries slotted buckets only")

    def drain(self, works: list[Any], what: str) -> None:
        raise RuntimeError("the colocated transport carries slotted buckets only")


class ColocatedCheckpointEngine(PipelinedEngine):
    """The pipeline over shared buffers: one sender, one receiver rank."""

    transport_cls: ClassVar[type[Transport]] = ColocatedTransport
    supports_many_senders = False
    supports_delta = False

    @classmethod
    def build_topology(cls, num_senders: int, receiver_world_sizes: Sequence[int]) -> Topology:
        topo = super().build_topology(num_senders, receiver_world_sizes)
        if topo.world_size != 2:
            raise ValueError(f"the colocated backend pairs one sender with one receiver rank, got {topo.world_size - 1} receiver ranks")
        return topo
