"""nccl_handoff: several senders, one receiver, and a sender on the receiver's own device hands its
buckets over in memory.

NCCL refuses two ranks of one GPU in one communicator, so a trainer rank that shares the rollout
receiver's GPU cannot broadcast to it. Here such a "local" sender builds no process group: the
receiver maps its rotating send buffers (CUDA IPC; /dev/shm files on CPU) as that sender's receive
slots, and "bucket ready" / "slot free" travel as flags through the rendezvous store, as in
`colocated.py`. Every other sender broadcasts over its own groups exactly as in the pipelined core.
Which senders are local is decided at join (`handoff_plan.py`): every rank publishes its device
identity and the first receiver rank decides for all. With no local sender this engine is the
pipelined core, unchanged.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from ckpt_engine.transports.gloo import GlooCheckpointEngine
from ckpt_engine.transports.handoff_plan import agree_on_local_senders, wait_keys
from ckpt_engine.transports.nccl import NcclCheckpointEngine
from ckpt_engine.transports.pipelined import PipelinedBroadcastEngine
from ckpt_engine.transports.shared_buffers import device_identity, map_buffers, share_buffers, unlink_files, validate_descriptors
from ckpt_engine.transports.wire_views import SLACK
from ckpt_engine.delta.request import DeltaRequest
from ckpt_engine.transports.base import Rendezvous, SendStats, TransferError
from ckpt_engine.manifest import Bucket, BucketManifest

__all__ = ["HandoffCheckpointEngine"]

logger = logging.getLogger(__name__)

NAME = "nccl_handoff"


@dataclass(frozen=True)
class _LocalWork:
    """A local sender's bucket posted on the receiver: done when its "ready" flag is in the store."""

    store: Any
    key: str
    sender: int
    ordinal: int

    def is_completed(self) -> bool:
        return bool(self.store.check([self.key]))


class HandoffCheckpointEngine(PipelinedBroadcastEngine):
    """Remote senders broadcast over NCCL (gloo on CPU); a sender sharing the one receiver's device
    hands its buffers over through shared memory. The device type comes from `device`."""

    supports_delta = False
    """No patches through this backend (a sync session with `delta: auto` stays dense here, and
    `delta: on` is refused before any engine pauses); the engine itself refuses a delta request
    while a sender hands over in memory."""

    def __new__(cls, **kwargs: Any) -> HandoffCheckpointEngine:
        if cls is HandoffCheckpointEngine:  # pick the transport of the remote senders by device
            dev = kwargs.get("device")
            kind = torch.device(dev).type if dev is not None else ("cuda" if torch.cuda.is_available() else "cpu")
            if kind not in ("cuda", "cpu"):
                raise ValueError(f"the {NAME} backend runs on cuda or cpu devices, got device={dev!r}")
            cls = _NcclHandoff if kind == "cuda" else _GlooHandoff
        return super().__new__(cls)

    def __init__(self, *, local_senders: Sequence[int] | None = None, high_priority: bool = True, **kwargs: Any) -> None:
        """`local_senders`: an override for tests and benchmarks that emulate a placement: exactly
        these senders hand over in memory, whatever their device identities say (they must still
        share memory with the receiver: same host on CPU, same GPU on CUDA). The first receiver
        rank's value decides for every rank. `high_priority`: see the nccl backend (CUDA only)."""
        if local_senders is not None:
            ok = isinstance(local_senders, (list, tuple)) and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in local_senders)
            if not ok or len(set(local_senders)) != len(local_senders):
                raise ValueError(f"local_senders must be a list of distinct sender ranks (ints >= 0), got {local_senders!r}")
        self.local_senders_override = None if local_senders is None else sorted(local_senders)
        if isinstance(self, NcclCheckpointEngine):
            kwargs["high_priority"] = high_priority
        super().__init__(**kwargs)
        self._local: frozenset[int] = frozenset()
        self._store: Any = None
        self._seq = 0  # dense syncs since join; namespaces the flags of one sync
        self._count: dict[int, int] = {}  # per local sender: buckets handed over (sender) / posted (receiver)
        self._released: dict[int, int] = {}  # receiver: per local sender, buckets handed back
        self._held: dict[int, tuple[int, int]] = {}  # receiver: slot -> (sender, ordinal) read, not yet handed back
        self._mapped: set[int] = set()  # receiver slots that are a local sender's memory
        self._shm_paths: list[str] = []
        self._own_index: list[int] = []  # local sender: manifest index of each of its buckets

    @property
    def local_senders(self) -> list[int]:
        """The senders that hand their buckets over in memory in this group (set at join)."""
        return sorted(self._local)

    def prepare(self) -> dict[str, Any]:
        info = super().prepare()
        info["buffer_bytes"] = sum(b.numel() for i, b in enumerate(self._buffers) if i not in self._mapped)
        return info

    # --- join ----------------------------------------------------------------------------------
    def init_process_group(self, rendezvous: Rendezvous, rank: int) -> None:
        if self._group is not None:
            raise RuntimeError("init_process_group() was already called; call finalize() first to rejoin")
        senders, world = rendezvous.num_senders, rendezvous.world_size
        if not 1 <= senders < world:
            raise ValueError(f"num_senders must be in [1, world_size), got {senders}")
        store = rendezvous.connect_store()
        self.rank = rank
        self._local = agree_on_local_senders(
            store, rank=rank, num_senders=senders, world_size=world, identity=device_identity(self.device),
            override=self.local_senders_override, timeout_s=self.timeout_s, backend=NAME,
        )
        self._seq = 0
        if not self._local:
            super().init_process_group(rendezvous, rank)
            return
        self._store, self.num_senders, self.world_size = store, senders, world
        nb, size = self.num_buffers, self.bucket_size_bytes + SLACK
        self._buffers, self._ready, self._free, self._mapped = [], [], [], set()
        if rank in self._local:
            self._buffers, descs, self._shm_paths = share_buffers(self.device, nb, size)
            self._ready = [self._new_event() for _ in self._buffers]
            self._free = [self._new_event() for _ in self._buffers]
            store.set(f"handoff/buffers/{rank}", msgpack.packb({"size": size, "buffers": descs}, use_bin_type=True))
        elif self.is_sender:
            self._alloc_buffers(nb)
        else:
            for s in range(senders):
                if s not in self._local:
                    self._alloc_buffers(len(self._buffers) + nb)
                    continue
                key = f"handoff/buffers/{s}"
                wait_keys(store, [key], f"sender {s}'s shared buffers", self.timeout_s, rank)
                try:
                    descs = validate_descriptors(msgpack.unpackb(store.get(key), raw=False), nb, size, f"sender {s}")
                except (ValueError, msgpack.UnpackException) as exc:
                    raise ValueError(f"{NAME}: sender {s}'s shared buffers: {exc}") from exc
                self._mapped.update(range(len(self._buffers), len(self._buffers) + nb))
                self._buffers += map_buffers(self.device, descs, size)
                self._ready += [self._new_event() for _ in range(nb)]
                self._free += [self._new_event() for _ in range(nb)]
        # The pipelined core's groups, less the local senders'.
        own = ([] if rank in self._local else [rank]) if self.is_sender else [s for s in range(senders) if s not in self._local]
        self._join_groups(store, own)
        if self._group is None:  # a local sender: the store is its only link
            self._group = store
        logger.info("rank %d/%d joined %s group %s; senders %s hand over in memory", rank, world, NAME, rendezvous.token[:8], sorted(self._local))

    def finalize(self) -> None:
        super().finalize()
        self._local, self._store, self._mapped, self._held = frozenset(), None, set(), {}
        unlink_files(self._shm_paths)

    def abort(self) -> None:
        super().abort()
        if self._local and self._store is not None:
            try:
                self._signal_abort()
            except Exception as exc:  # the store may be gone too; the peer then times out
                logger.warning("%s: could not tell the peer about the abort: %s", NAME, exc)

    def _signal_abort(self) -> None:
        """Answer every flag the peer may be waiting on with "abort", so it fails now, not after
        `timeout_s`: the next "ready" a local sender owes, or the "free"s a receiver owes."""
        if self.rank in self._local:
            self._store.set(self._key(self.rank, "ready", self._count.get(self.rank, 0)), b"abort")
        elif not self.is_sender:
            for s in self._local:
                first = self._released.get(s, 0)
                for ordinal in range(first, first + self.num_buffers):
                    self._store.set(self._key(s, "free", ordinal), b"abort")

    # --- flags ---------------------------------------------------------------------------------
    def _key(self, sender: int, what: str, ordinal: int) -> str:
        return f"handoff/{self._seq}/{sender}/{what}/{ordinal}"

    def _take_flag(self, key: str, what: str, peer: str) -> None:
        """Wait (at most `timeout_s`) for a flag, then consume it; "abort" means the peer failed."""
        try:
            self._store.wait([key], datetime.timedelta(seconds=self.timeout_s))
            value = self._store.get(key)
            self._store.delete_key(key)
        except Exception as exc:
            self._broken = True
            raise TransferError(f"rank {self.rank}: {what} did not arrive within {self.timeout_s}s: {exc}") from exc
        if value != b"1":
            self._broken = True
            raise TransferError(f"rank {self.rank}: {what} failed: {peer} aborted the sync")

    # --- which buckets skip the buffer (never a local sender's: the receiver reads its buffer) --
    def _is_direct(self, bucket: Bucket) -> bool:
        return bucket.sender not in self._local and super()._is_direct(bucket)

    def _is_direct_whole(self, bucket: Bucket) -> bool:
        return bucket.sender not in self._local and super()._is_direct_whole(bucket)

    def _is_grouped(self, bucket: Bucket) -> bool:
        return bucket.sender not in self._local and super()._is_grouped(bucket)

    def _refuse_delta(self, delta: DeltaRequest | None) -> None:
        if delta is not None and self._local:
            raise ValueError(
                f"the {NAME} backend does not do delta syncs while senders {sorted(self._local)} hand over in memory; use delta=off"
            )

    # --- sender --------------------------------------------------------------------------------
    def send_weights(
        self, manifest: BucketManifest, weights: Iterable[tuple[str, torch.Tensor]], *, stable: bool = False, delta: DeltaRequest | None = None
    ) -> SendStats:
        self._refuse_delta(delta)
        if self._local:
            self._seq += 1
            if self.rank in self._local:
                self._count[self.rank] = 0
                self._own_index = self._schedule(manifest).by_sender[self.rank]
        return super().send_weights(manifest, weights, stable=stable, delta=delta)

    def _may_borrow(self) -> bool:
        return self.rank not in self._local  # the receiver reads this sender's buffers: every bucket is packed there

    def _sender_slot_free(self, slot: int, works: list[Any]) -> None:
        if self.rank not in self._local:
            return super()._sender_slot_free(slot, works)
        if works[slot] is not None:
            self._take_flag(self._key(self.rank, "free", works[slot]), f"release of bucket {self._own_index[works[slot]]}", "the receiver")
            works[slot] = None

    def _sender_broadcast(self, slot: int, msg: torch.Tensor, gid: int) -> Any:
        if self.rank not in self._local:
            return super()._sender_broadcast(slot, msg, gid)
        self._device_sync_point()  # the bucket is packed before the receiver may read it
        ordinal = self._count[self.rank]
        self._count[self.rank] = ordinal + 1
        self._store.set(self._key(self.rank, "ready", ordinal), b"1")
        return ordinal

    def _sender_drain(self, works: list[Any]) -> None:
        if self.rank not in self._local:
            return super()._sender_drain(works)
        for ordinal in works:
            if ordinal is not None:
                self._take_flag(self._key(self.rank, "free", ordinal), f"release of bucket {self._own_index[ordinal]}", "the receiver")

    # --- receiver ------------------------------------------------------------------------------
    def receive_buckets(
        self, manifest: BucketManifest, destinations: Mapping[str, torch.Tensor] | None = None, *, delta: DeltaRequest | None = None
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        self._refuse_delta(delta)
        if not self._local:
            yield from super().receive_buckets(manifest, destinations, delta=delta)
            return
        self._seq += 1
        self._count = {s: 0 for s in self._local}
        self._released = {s: 0 for s in self._local}
        self._held = {}
        yield from super().receive_buckets(manifest, destinations)
        self._release(list(self._held))  # the last buckets of every local sender

    def _post_receive(self, slot: int, msg: torch.Tensor, gid: int) -> Any:
        sender = gid // self.num_lanes
        if sender not in self._local:
            return super()._post_receive(slot, msg, gid)
        self._release([slot])  # the loader is done with the bucket this slot held: hand it back
        ordinal = self._count[sender]
        self._count[sender] = ordinal + 1
        return _LocalWork(self._store, self._key(sender, "ready", ordinal), sender, ordinal)

    def _step_ready(self, k: int, work: Any) -> bool:
        if isinstance(work, _LocalWork):
            return work.is_completed()
        return super()._step_ready(k, work)

    def _finish_receive(self, slot: int, work: Any, k: int | str) -> None:
        if not isinstance(work, _LocalWork):
            return super()._finish_receive(slot, work, k)
        label = str(k) if "sender" in str(k) else f"{k} from sender {work.sender}"
        self._take_flag(work.key, f"bucket {label}", f"sender {work.sender}")
        self._held[slot] = (work.sender, work.ordinal)

    def _release(self, slots: list[int]) -> None:
        """Hand slots back to their local sender once the loader's copies out of them are done."""
        held = [self._held.pop(s) for s in slots if s in self._held]
        if not held:
            return
        self._device_sync_point()
        for sender, ordinal in held:
            self._store.set(self._key(sender, "free", ordinal), b"1")
            self._released[sender] = ordinal + 1


class _NcclHandoff(HandoffCheckpointEngine, NcclCheckpointEngine):
    """CUDA: remote senders over NCCL, a sender on the receiver's GPU through CUDA IPC."""


class _GlooHandoff(HandoffCheckpointEngine, GlooCheckpointEngine):
    """CPU: remote senders over gloo, a sender on the receiver's host through /dev/shm files."""
