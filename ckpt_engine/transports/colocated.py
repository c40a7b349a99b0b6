"""colocated: sender and receiver on one device (or one host), no collective at all.

The sender's rotating buffers are shared with the one receiver: CUDA IPC handles on GPU, a
file-backed shared mapping on CPU. Only "bucket k is ready" / "slot is free" flags travel, through
the rendezvous store; the bytes never move, the receiver's loader reads them in place.
"""

from __future__ import annotations

import datetime
import logging
from typing import Any

import msgpack
import torch

from ckpt_engine.transports.pipelined import PipelinedBroadcastEngine, _SLACK
from ckpt_engine.transports.shared_buffers import map_buffers, share_buffers, unlink_files, validate_descriptors
from ckpt_engine.transports.base import Rendezvous, TransferError

__all__ = ["ColocatedCheckpointEngine"]

logger = logging.getLogger(__name__)


class ColocatedCheckpointEngine(PipelinedBroadcastEngine):
    """Shared-buffer hand-off between one sender (rank 0) and one receiver (rank 1)."""

    supports_many_senders = False
    supports_delta = False

    def _resolve_device(self, device: str | int | torch.device | None) -> torch.device:
        dev = torch.device("cpu") if device is None else torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        return dev

    @classmethod
    def build_topology(cls, num_senders: int, receiver_world_sizes: Any) -> Any:
        topo = super().build_topology(num_senders, receiver_world_sizes)
        if topo.world_size != 2:
            raise ValueError(f"the colocated backend pairs one sender with one receiver rank, got {topo.world_size - 1} receiver ranks")
        return topo

    def prepare(self) -> dict[str, Any]:
        return {"device": str(self.device), "buffer_bytes": sum(b.numel() for b in self._buffers), "num_buffers": self.num_buffers}

    def init_process_group(self, rendezvous: Rendezvous, rank: int) -> None:
        if self._group is not None:
            raise RuntimeError("init_process_group() was already called; call finalize() first to rejoin")
        if rendezvous.world_size != 2 or rank not in (0, 1):
            raise ValueError("the colocated backend pairs exactly one sender (rank 0) and one receiver (rank 1)")
        store = rendezvous.connect_store()
        self._store = store
        self._comm_stream = None
        self._ready, self._free = [], []
        self._shm_paths: list[str] = []
        self._seq = 0
        self.rank, self.world_size = rank, 2
        size = self.bucket_size_bytes + _SLACK
        if rank == 0:
            self._buffers, descs, self._shm_paths = share_buffers(self.device, self.num_buffers, size)
            store.set("colocated/buffers", msgpack.packb({"size": size, "buffers": descs}, use_bin_type=True))
        else:
            store.wait(["colocated/buffers"], datetime.timedelta(seconds=self.timeout_s))
            info = msgpack.unpackb(store.get("colocated/buffers"), raw=False)
            descs = validate_descriptors(info, self.num_buffers, size, "the colocated sender")
            self._buffers = map_buffers(self.device, descs, size)
        self._group = store
        logger.info("colocated rank %d mapped %d shared buffers of %d bytes", rank, self.num_buffers, size)

    def finalize(self) -> None:
        self._group = None
        self._buffers, self._views = [], {}
        unlink_files(getattr(self, "_shm_paths", []))

    def abort(self) -> None:
        self._broken = True

    def _is_direct(self, bucket: Any) -> bool:
        return False  # the receiver reads the shared buffer in place; nothing to skip

    def _is_direct_whole(self, bucket: Any) -> bool:
        return False

    def _is_grouped(self, bucket: Any) -> bool:
        return False

    # --- flags through the store instead of collectives --------------------------------------
    def _key(self, what: str, k: int) -> str:
        return f"s{self._seq}/{what}/{k}"

    def _wait_key(self, key: str, what: str) -> None:
        try:
            self._store.wait([key], datetime.timedelta(seconds=self.timeout_s))
        except Exception as exc:
            self._broken = True
            raise TransferError(f"rank {self.rank}: {what} did not arrive within {self.timeout_s}s: {exc}") from exc
        self._store.delete_key(key)

    def send_weights(self, manifest: Any, weights: Any, *, stable: bool = False, delta: Any = None) -> Any:
        if delta is not None:
            raise ValueError("the colocated backend hands buffers over in place; delta sync does not apply (use delta=off)")
        self._seq += 1
        self._sent = 0
        # The receiver reads the shared buffers: every bucket must be packed into them.
        return super().send_weights(manifest, weights, stable=False)

    def _sender_slot_free(self, slot: int, works: list[Any]) -> None:
        if works[slot] is not None:
            self._wait_key(self._key("free", works[slot]), f"release of bucket {works[slot]}")
            works[slot] = None

    def _sender_broadcast(self, slot: int, msg: torch.Tensor, lane: int) -> Any:
        self._device_sync_point()
        k = self._sent
        self._sent += 1
        self._store.set(self._key("ready", k), b"1")
        return k

    def _sender_drain(self, works: list[Any]) -> None:
        for k in works:
            if k is not None:
                self._wait_key(self._key("free", k), f"release of bucket {k}")

    def receive_buckets(self, manifest: Any, destinations: Any = None, *, delta: Any = None) -> Any:
        if delta is not None:
            raise ValueError("the colocated backend hands buffers over in place; delta sync does not apply (use delta=off)")
        self._seq += 1
        self._received = 0
        self._released = 0
        yield from super().receive_buckets(manifest, destinations)
        self._release_pending()

    def _post_receive(self, slot: int, msg: torch.Tensor, lane: int) -> Any:
        # Called once the loader is done with the previous bucket in this slot: release it.
        self._release_pending()
        return None

    def _release_pending(self) -> None:
        if self._released < self._received:
            self._device_sync_point()
            while self._released < self._received:
                self._store.set(self._key("free", self._released), b"1")
                self._released += 1

    def _finish_receive(self, slot: int, work: Any, k: int) -> None:
        self._release_pending()
        self._wait_key(self._key("ready", k), f"bucket {k}")
        self._received = k + 1
