"""nccl_handoff: several senders, one receiver, and a sender on the receiver's own device hands its
buckets over in memory.

NCCL refuses two ranks of one GPU in one communicator. Such a "local" sender builds no process
group: the receiver maps its rotating send buffers as that sender's receive slots, and "bucket
ready" / "slot free" travel as flags through the rendezvous store, as in `colocated.py`. Every
other sender broadcasts through the `remote` transport (nccl on CUDA, gloo on CPU). Which senders
are local is decided at join (`agree_on_local_senders`); with none this transport is its remote one.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from ckpt_engine.engine import Rendezvous, TransferError
from ckpt_engine.transports.gloo import GlooTransport
from ckpt_engine.transports.nccl import NcclTransport
from ckpt_engine.transports.process_groups import ProcessGroupTransport
from ckpt_engine.transports.shared_buffers import device_identity, map_buffers, share_buffers, unlink_files, validate_descriptors
from ckpt_engine.transports.transport import SLACK, Frames, Transport, TransportOptions

__all__ = ["HandoffOptions", "HandoffTransport"]

logger = logging.getLogger(__name__)

NAME = "nccl_handoff"


@dataclass(frozen=True, kw_only=True)
class HandoffOptions(TransportOptions):
    """nccl_handoff's own option (besides `device`)."""

    local_senders: list[int] | None = None
    """An override for tests and benchmarks that emulate a placement: exactly these senders hand
    over in memory, whatever their device identities say (they must still share memory with the
    receiver: same host on CPU, same GPU on CUDA). The first receiver rank's value decides for
    every rank. None: decided from the ranks' device identities at join."""

    def __post_init__(self) -> None:
        super().__post_init__()
        senders = self.local_senders
        if senders is not None:
            ok = isinstance(senders, (list, tuple)) and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in senders)
            if not ok or len(set(senders)) != len(senders):
                raise ValueError(f"local_senders must be a list of distinct sender ranks (ints >= 0), got {senders!r}")
        kind = torch.device(self.device).type if self.device is not None else None
        if kind not in (None, "cuda", "cpu"):
            raise ValueError(f"the {NAME} backend runs on cuda or cpu devices, got device={self.device!r}")


def wait_keys(store: Any, keys: list[str], what: str, timeout_s: float, rank: int | None) -> None:
    """Wait for store keys within `timeout_s`; a TransferError names what was awaited."""
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except Exception as exc:
        raise TransferError(f"rank {rank}: {what} did not arrive within {timeout_s}s: {exc}") from exc


def agree_on_local_senders(
    store: Any, *, rank: int, num_senders: int, world_size: int, identity: str, override: Sequence[int] | None,
    timeout_s: float, backend: str,
) -> frozenset[int]:
    """Collective over the group's ranks: the senders that share the (single) receiver's device.
    Every rank publishes its device identity; the first receiver rank compares them (or applies
    `override`) and publishes the verdict, so every rank acts on the same decision and a refusal
    reaches every rank as one error: a ValueError when a sender shares a receiver's device but the
    group has more than one receiver rank."""
    store.set(f"handoff/identity/{rank}", identity)
    if rank == num_senders:
        keys = [f"handoff/identity/{r}" for r in range(world_size)]
        wait_keys(store, keys, "every rank's device identity", timeout_s, rank)
        ids = [store.get(k).decode() for k in keys]
        local = [s for s in range(num_senders) if ids[s] in ids[num_senders:]] if override is None else list(override)
        error = None
        if override is not None and any(s >= num_senders for s in override):
            error = f"{backend}: local_senders={list(override)} names senders outside [0, {num_senders})"
        elif local and world_size - num_senders != 1:
            error = (f"{backend}: senders {local} share a device with a receiver and hand their buckets over in memory, "
                     f"which needs exactly one receiver rank; this group has {world_size - num_senders} (use one receiver "
                     "rank, or put the receivers on devices no sender uses)")
        store.set("handoff/plan", msgpack.packb({"local": local, "error": error}))
    wait_keys(store, ["handoff/plan"], "the receiver's hand-off plan", timeout_s, rank)
    try:
        plan = msgpack.unpackb(store.get("handoff/plan"), raw=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise ValueError(f"{backend}: undecodable hand-off plan in the rendezvous store: {exc}") from exc
    if not isinstance(plan, dict) or set(plan) != {"local", "error"} or not isinstance(plan["error"], (str, type(None))):
        raise ValueError(f"{backend}: malformed hand-off plan in the rendezvous store: {plan!r:.200}")
    if plan["error"] is not None:
        raise ValueError(plan["error"])
    local = plan["local"]
    if not isinstance(local, list) or not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s < num_senders for s in local):
        raise ValueError(f"{backend}: malformed hand-off plan in the rendezvous store: {plan!r:.200}")
    return frozenset(local)


@dataclass(frozen=True)
class _LocalWork:
    """A local sender's bucket posted on the receiver: done when its "ready" flag is in the store."""

    store: Any
    key: str
    sender: int
    ordinal: int

    def is_completed(self) -> bool:
        return bool(self.store.check([self.key]))


class HandoffTransport(Transport):
    """Remote senders through `remote` (nccl on CUDA, gloo on CPU); a sender sharing the one
    receiver's device hands its slots over through shared memory and store flags."""

    name = NAME
    Options = HandoffOptions

    def __init__(self, options: TransportOptions, **kwargs: Any) -> None:
        opts = options if isinstance(options, HandoffOptions) else HandoffOptions(device=options.device)
        self.local_senders_override = None if opts.local_senders is None else sorted(opts.local_senders)
        cuda = torch.device(opts.device).type == "cuda" if opts.device is not None else torch.cuda.is_available()
        self.remote: ProcessGroupTransport = NcclTransport(opts, **kwargs) if cuda else GlooTransport(opts, **kwargs)
        self.default_solo_bytes = self.remote.default_solo_bytes
        self.default_group_max_tensors = self.remote.default_group_max_tensors
        super().__init__(TransportOptions(device=self.remote.device), **kwargs)
        self._local: frozenset[int] = frozenset()
        self._store: Any = None
        self._seq = 0  # dense syncs since join; namespaces the flags of one sync
        self._count: dict[int, int] = {}  # per local sender: buckets handed over (sender) / posted (receiver)
        self._released: dict[int, int] = {}  # receiver: per local sender, buckets handed back
        self._held: dict[int, tuple[int, int]] = {}  # receiver: slot -> (sender, ordinal) read, not yet handed back
        self._mapped: set[int] = set()  # receiver slots that are a local sender's memory
        self._shm_paths: list[str] = []
        self._own_index: list[int] = []  # local sender: manifest index of each of its buckets

    # --- the remote transport's state is this one's ----------------------------------------------
    @classmethod
    def resolve_device(cls, device: str | int | torch.device | None) -> torch.device:
        assert device is not None  # resolved by the remote transport already
        return torch.device(device)

    rank = property(lambda self: self.remote.rank, lambda self, v: setattr(self.remote, "rank", v))
    world_size = property(lambda self: self.remote.world_size, lambda self, v: setattr(self.remote, "world_size", v))
    num_senders = property(lambda self: self.remote.num_senders, lambda self, v: setattr(self.remote, "num_senders", v))
    buffers = property(lambda self: self.remote.buffers, lambda self, v: setattr(self.remote, "buffers", v))
    broken = property(lambda self: self.remote.broken, lambda self, v: setattr(self.remote, "broken", v))

    @property
    def local_senders(self) -> list[int]:
        """The senders that hand their buckets over in memory in this group (set at join)."""
        return sorted(self._local)

    @property
    def uses_streams(self) -> bool:
        return self.remote.uses_streams

    def new_event(self) -> Any:
        return self.remote.new_event()

    def current_stream(self) -> Any:
        return self.remote.current_stream()

    def alloc_buffers(self, count: int) -> None:
        self.remote.alloc_buffers(count)

    def describe(self) -> dict[str, Any]:
        info = self.remote.describe()
        info["buffer_bytes"] = sum(b.numel() for i, b in enumerate(self.buffers) if i not in self._mapped)
        return info

    def prepare(self) -> dict[str, Any]:
        self.remote.prepare()
        return self.describe()

    @property
    def group(self) -> Any:
        group = self.remote.group
        return group if group is not None or not self._local else self._store

    @property
    def groups(self) -> dict[int, Any]:
        return self.remote.groups

    @property
    def frames(self) -> Frames | None:
        """The remote transport's, while no sender hands over in memory."""
        return None if self._local else self.remote.frames

    def reads_in_place(self, sender: int) -> bool:
        return sender in self._local

    # --- join ------------------------------------------------------------------------------------
    def join(self, rendezvous: Rendezvous, rank: int) -> None:
        """Waits for the other ranks within the rendezvous's timeout, as the process-group joins do
        (ranks start seconds apart); the engine's `timeout_s` bounds each sync."""
        if self.group is not None:
            raise RuntimeError("init_process_group() was already called; call finalize() first to rejoin")
        senders, world = rendezvous.num_senders, rendezvous.world_size
        store = rendezvous.connect_store()
        self.rank = rank
        self._local = agree_on_local_senders(
            store, rank=rank, num_senders=senders, world_size=world, identity=device_identity(self.device),
            override=self.local_senders_override, timeout_s=rendezvous.timeout_s, backend=NAME,
        )
        self._seq = 0
        if not self._local:
            self.remote.join(rendezvous, rank)
            return
        self._store, self.num_senders, self.world_size = store, senders, world
        nb, size = self.num_buffers, self.bucket_size_bytes + SLACK
        self.remote.clear_slots()
        self._mapped = set()
        if rank in self._local:
            buffers, descs, self._shm_paths = share_buffers(self.device, nb, size)
            self.remote.add_slots(buffers)
            store.set(f"handoff/buffers/{rank}", msgpack.packb({"size": size, "buffers": descs}, use_bin_type=True))
            try:
                self._await_mapping(store, rendezvous.timeout_s)
            except BaseException:  # a failed join leaves no shared files behind
                unlink_files(self._shm_paths)
                self._shm_paths = []
                raise
        elif self.is_sender:
            self.remote.alloc_buffers(nb)
        else:
            for s in range(senders):
                if s not in self._local:
                    self.remote.alloc_buffers(len(self.buffers) + nb)
                    continue
                self._map_sender(store, s, rendezvous.timeout_s)
        # The remote transport's groups, less the local senders'.
        own = ([] if rank in self._local else [rank]) if self.is_sender else [s for s in range(senders) if s not in self._local]
        self.remote.join_groups(store, own)
        logger.info("rank %d/%d joined %s group %s; senders %s hand over in memory", rank, world, NAME, rendezvous.token[:8], sorted(self._local))

    def _map_sender(self, store: Any, sender: int, timeout_s: float) -> None:
        """Receiver: map a local sender's published buffers as its slots, then tell it so (or why not)."""
        nb, size = self.num_buffers, self.bucket_size_bytes + SLACK
        key = f"handoff/buffers/{sender}"
        wait_keys(store, [key], f"sender {sender}'s shared buffers", timeout_s, self.rank)
        try:
            try:
                descs = validate_descriptors(msgpack.unpackb(store.get(key), raw=False), nb, size, f"sender {sender}")
            except (ValueError, msgpack.UnpackException) as exc:
                raise ValueError(f"{NAME}: sender {sender}'s shared buffers: {exc}") from exc
            slots = map_buffers(self.device, descs, size)
        except Exception as exc:
            store.set(f"handoff/mapped/{sender}", f"the receiver (rank {self.rank}) could not map them: {exc}".encode())
            raise
        self._mapped.update(range(len(self.buffers), len(self.buffers) + nb))
        self.remote.add_slots(slots)
        store.set(f"handoff/mapped/{sender}", b"1")

    def _await_mapping(self, store: Any, timeout_s: float) -> None:
        """Local sender: join returns only once the receiver has mapped this rank's buffers. A
        sender that failed and closed before then unlinked (host) or freed (CUDA) them under the
        receiver, whose join then failed with a misleading "not on this host" and left the remote
        senders waiting out their group timeout (the CI flake of test_a_failed_local_sender_is_named)."""
        key = f"handoff/mapped/{self.rank}"
        wait_keys(store, [key], "the receiver's mapping of this sender's shared buffers", timeout_s, self.rank)
        answer = store.get(key)
        store.delete_key(key)
        if answer != b"1":
            raise TransferError(f"rank {self.rank}: {NAME}: {answer.decode(errors='replace')}")

    def close(self) -> None:
        self.remote.close()
        self._local, self._store, self._mapped, self._held = frozenset(), None, set(), {}
        unlink_files(self._shm_paths)

    def abort(self) -> None:
        self.remote.abort()
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

    # --- flags -----------------------------------------------------------------------------------
    def _key(self, sender: int, what: str, ordinal: int) -> str:
        return f"handoff/{self._seq}/{sender}/{what}/{ordinal}"

    def _take_flag(self, key: str, what: str, peer: str) -> None:
        """Wait (at most `timeout_s`) for a flag, then consume it; "abort" means the peer failed."""
        try:
            self._store.wait([key], datetime.timedelta(seconds=self.timeout_s))
            value = self._store.get(key)
            self._store.delete_key(key)
        except Exception as exc:
            self.broken = True
            raise TransferError(f"rank {self.rank}: {what} did not arrive within {self.timeout_s}s: {exc}") from exc
        if value != b"1":
            self.broken = True
            raise TransferError(f"rank {self.rank}: {what} failed: {peer} aborted the sync")

    # --- one sync --------------------------------------------------------------------------------
    def begin_send(self, own_index: list[int]) -> None:
        if self._local:
            self._seq += 1
            if self.rank in self._local:
                self._count[self.rank] = 0
                self._own_index = own_index

    def begin_receive(self) -> None:
        if self._local:
            self._seq += 1
            self._count = {s: 0 for s in self._local}
            self._released = {s: 0 for s in self._local}
            self._held = {}

    def end_receive(self) -> None:
        if self._local:
            self._release(list(self._held))  # the last buckets of every local sender

    # --- sender ----------------------------------------------------------------------------------
    def wait_slot(self, slot: int, works: list[Any]) -> None:
        if self.rank not in self._local:
            return self.remote.wait_slot(slot, works)
        if works[slot] is not None:
            self._take_flag(self._key(self.rank, "free", works[slot]), f"release of bucket {self._own_index[works[slot]]}", "the receiver")
            works[slot] = None

    def drain_slots(self, works: list[Any]) -> None:
        if self.rank not in self._local:
            return self.remote.drain_slots(works)
        for ordinal in works:
            if ordinal is not None:
                self._take_flag(self._key(self.rank, "free", ordinal), f"release of bucket {self._own_index[ordinal]}", "the receiver")

    def post(self, gid: int, slot: int, msg: torch.Tensor) -> Any:
        sender = self.rank if self.is_sender else gid
        if sender not in self._local:
            return self.remote.post(gid, slot, msg)
        assert self.rank is not None
        if self.is_sender:
            self.device_sync_point()  # the bucket is packed before the receiver may read it
            ordinal = self._count[self.rank]
            self._count[self.rank] = ordinal + 1
            self._store.set(self._key(self.rank, "ready", ordinal), b"1")
            return ordinal
        self._release([slot])  # the loader is done with the bucket this slot held: hand it back
        ordinal = self._count[sender]
        self._count[sender] = ordinal + 1
        return _LocalWork(self._store, self._key(sender, "ready", ordinal), sender, ordinal)

    def post_group(self, gid: int, slot: int, msgs: list[torch.Tensor]) -> Any:
        return self.remote.post_group(gid, slot, msgs)  # a local sender's buckets are never grouped

    # --- receiver --------------------------------------------------------------------------------
    def landed(self, work: Any) -> bool:
        if isinstance(work, _LocalWork):
            return work.is_completed()
        return self.remote.landed(work)

    def finish(self, k: int, sender: int, slot: int, work: Any, label: str) -> None:
        if not isinstance(work, _LocalWork):
            return self.remote.finish(k, sender, slot, work, label)
        self._take_flag(work.key, f"bucket {k} from sender {work.sender}", f"sender {work.sender}")
        self._held[slot] = (work.sender, work.ordinal)

    def release(self, slot: int) -> None:
        if slot not in self._mapped:
            self.remote.release(slot)

    def _release(self, slots: list[int]) -> None:
        """Hand slots back to their local sender once the loader's copies out of them are done."""
        held = [self._held.pop(s) for s in slots if s in self._held]
        if not held:
            return
        self.device_sync_point()
        for sender, ordinal in held:
            self._store.set(self._key(sender, "free", ordinal), b"1")
            self._released[sender] = ordinal + 1

    def wait_compute(self, what: str) -> None:
        self.remote.wait_compute(what)

