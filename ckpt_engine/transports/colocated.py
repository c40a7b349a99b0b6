"""colocated: sender and receiver on one device (or one host), no collective at all.

A stable sender shares its own tensors once (`shared_tensors.py`) and the receiver's loader copies
straight out of them, one copy per byte; otherwise the sender packs each bucket into rotating
buffers shared the same way, which the loader reads in place. Only flags travel, through the
rendezvous store ("offered" / "taken", "bucket k is ready" / "slot is free"), or through memory
when both ends share one process (`in_process.py`).
"""

from __future__ import annotations

import datetime
import logging
from typing import Any

import msgpack
import torch

from ckpt_engine.engine import Rendezvous, TransferError
from ckpt_engine.transports import in_process
from ckpt_engine.transports.shared_buffers import map_buffers, share_buffers, unlink_files, validate_descriptors
from ckpt_engine.transports.shared_tensors import (
    Placement, can_share, describe_tensors, map_tensors, placement, probe_host_sharing,
)
from ckpt_engine.transports.transport import SLACK, SourceSharing, Transport

__all__ = ["ColocatedTransport"]

logger = logging.getLogger(__name__)

_ABORTED = b"aborted"
"""A flag's value where the peer aborted the sync instead."""
_CLOSED = b"closed"
"""A flag's value where the peer closed its end (`close()`) with the sync in flight."""
_ENDS = {_ABORTED: "aborted this sync", _CLOSED: "closed its end of the group mid-sync"}


class ColocatedTransport(Transport, SourceSharing):
    """Shared-tensor or shared-buffer hand-off between one sender (rank 0) and one receiver (rank 1)."""

    name = "colocated"
    supports_many_senders = False
    max_ranks = 2
    """One sender (rank 0) and one receiver rank; the receiver maps the sender's buffers (no delta
    frames: `frames` is None)."""
    stable_sources = False
    """The receiver reads the shared buffers: every bucket must be packed into them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._store: Any = None
        self._flags: Any = None
        """Where this sync's flags go: the rendezvous store, or the sender's in-memory store when both
        ends share one process (`in_process.py`)."""
        self._flags_desc: dict[str, Any] | None = None  # the sender's published in-memory store
        self._shm_paths: list[str] = []
        self._seq = 0  # syncs since join; namespaces the flags of one sync
        self._read: list[str] = []
        """Flags this rank read and no one reads again: deleted while the device copies (`_forget_read`),
        not between the offer and the first copy or after the last."""
        self._here = False
        """Both ends share one process (their flags go through the in-memory store): a sender that
        made a provisional offer waits until the receiver has looked at it before it checks its walk."""
        self._offers = 0  # offers this sync (sender) or taken (receiver): a provisional one may be followed by a second
        self._look_due = False  # the receiver took a provisional offer and has not yet said it looked
        self._answered = False  # the receiver told the sender how its copies out of the offer ended (`taken`)
        self._judge_due = False  # the sender made a provisional offer and has not yet judged it
        self._in_sync = False
        """A sync is in flight on this end (from `begin_*` to its last flag): the peer may wait on it,
        so a `close()` then tells it (`_CLOSED`)."""
        self._sent = 0
        self._received = 0
        self._released = 0
        self._can_map = False  # the receiver can map this sender's tensors (learnt at join)
        self._probe: torch.Tensor | None = None
        self._offered: list[torch.UntypedStorage] = []
        """The offered tensors' memory, held: no tensor made later can have an offered address. A
        tensor object alone does not hold it: `.data = ...` frees its old memory, and on the host a
        new shared segment then often maps at the very address the receiver mapped the old one from."""
        self._offered_placement: Placement | None = None
        self._local: dict[str, Any] = {}
        """What this sender published for a receiver in its own process (`in_process.publish`):
        its buffers', its latest offer's."""
        self._generation = 0  # bumped whenever the offered tensors' handles change
        self._mapped: list[torch.Tensor] = []
        self._mapped_generation = 0
        self.mappings = 0
        """How many times this receiver mapped a sender's tensors (once per offer generation)."""

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
        """The store this pair's flags go through once joined (the rendezvous store, or the in-memory
        one of a pair in one process); None before the join."""
        return self._flags

    def reads_in_place(self, sender: int) -> bool:
        return True

    def join(self, rendezvous: Rendezvous, rank: int) -> None:
        if self._flags is not None:
            raise RuntimeError("init_process_group() was already called; call finalize() first to rejoin")
        if rendezvous.world_size != 2 or rank not in (0, 1):
            raise ValueError("the colocated backend pairs exactly one sender (rank 0) and one receiver (rank 1)")
        store = rendezvous.connect_store()
        self._seq = 0
        self.rank, self.world_size = rank, 2
        size = self.bucket_size_bytes + SLACK
        timeout = datetime.timedelta(seconds=rendezvous.timeout_s)  # the peer may start seconds later: the join's bound, not a sync's
        if rank == 0:
            self.buffers, descs, self._shm_paths = share_buffers(self.device, self.num_buffers, size)
            here = torch.distributed.HashStore()  # the flags of a receiver in this process (`in_process.py`)
            here.set_timeout(datetime.timedelta(seconds=self.timeout_s))
            self._flags_desc = in_process.publish(here)
            msg: dict[str, Any] = {"size": size, "buffers": descs, "flags": self._flags_desc}
            if self.device.type == "cuda":
                msg["local"] = self._local["buffers"] = in_process.publish(list(self.buffers))
            if self.device.type == "cpu":
                self._probe, msg["probe"] = probe_host_sharing()
            store.set("colocated/buffers", msgpack.packb(msg, use_bin_type=True))
            try:
                store.wait(["colocated/can_map"], timeout)
                answer = store.get("colocated/can_map")
                if answer not in (b"0", b"1"):  # the receiver could not map the buffers: its reason
                    raise TransferError(f"colocated sender: the receiver could not map its shared buffers: {answer.decode(errors='replace')}")
                shares_process = store.get("colocated/flags") == b"here"  # set before `can_map`
            except BaseException:  # a failed join leaves no shared files behind
                unlink_files(self._shm_paths)
                self._shm_paths = []
                in_process.forget(self._flags_desc)
                raise
            self._can_map = answer == b"1"
            if not shares_process:
                in_process.forget(self._flags_desc)
            flags = here if shares_process else store
        else:
            store.wait(["colocated/buffers"], timeout)
            try:
                info = msgpack.unpackb(store.get("colocated/buffers"), raw=False)
                probe = info.pop("probe", None) if isinstance(info, dict) else None
                local = in_process.find(info.pop("local", None)) if isinstance(info, dict) else None
                found = in_process.find(info.pop("flags", None)) if isinstance(info, dict) else None
                descs = validate_descriptors(info, self.num_buffers, size, "the colocated sender")
                self.buffers = list(local) if local is not None else map_buffers(self.device, descs, size)
            except Exception as exc:  # told to the sender, which would otherwise wait out the join's bound
                store.set("colocated/can_map", f"{type(exc).__name__}: {exc}".encode())  # type: ignore[arg-type]  # a Store takes bytes too
                raise
            store.set("colocated/flags", b"here" if found is not None else b"store")  # type: ignore[arg-type]  # a Store takes bytes too
            store.set("colocated/can_map", b"1" if probe is None or self._maps(probe) else b"0")  # type: ignore[arg-type]  # a Store takes bytes too
            flags = found if found is not None else store
        # A flag is read by `get`, which waits for it within the store's own bound (one round trip fewer
        # than a `wait` and then a `get`: ~70 us each on the 2-core CPU box): this transport's bound.
        store.set_timeout(datetime.timedelta(seconds=self.timeout_s))
        self._store, self._flags, self._here = store, flags, flags is not store
        self.broken = False
        logger.info("colocated rank %d mapped %d shared buffers of %d bytes", rank, self.num_buffers, size)

    def _maps(self, probe: Any) -> bool:
        """Whether the sender's probe tensor maps here (host sharing through /proc works)."""
        try:
            return len(map_tensors(probe, self.device)) == 1
        except (OSError, RuntimeError, ValueError) as exc:
            logger.info("colocated: the sender's shared tensors cannot be mapped here (%s); every sync goes through the buffers", exc)
            return False

    def close(self) -> None:
        """Drop the store, buffers and mappings. Closed mid-sync (a session closed past its lock's
        bound, an engine's `leave` while it receives), it first puts `_CLOSED` where the peer waits
        next, as `abort()` does: else the peer waits out `timeout_s` for flags that never come."""
        flags, in_sync = self._flags, self._in_sync and not self.broken
        self._store, self._flags, self._read = None, None, []  # this end's own sync fails at its next flag
        self._in_sync = False
        if flags is not None and in_sync:
            logger.warning("colocated rank %s closed mid-sync: telling its peer", self.rank)
            self._tell_peer(flags, _CLOSED)
        in_process.forget(self._flags_desc)
        self._flags_desc = None
        self.buffers = []
        self._probe = None
        self._offered, self._offered_placement, self._mapped = [], None, []
        self._mapped_generation = 0  # a sender joined next counts its offers from 1 again
        unlink_files(self._shm_paths)
        for local in self._local.values():
            in_process.forget(local)
        self._local = {}

    def abort(self) -> None:
        """Put `_ABORTED` where the peer waits next (no collective breaks on its own here)."""
        self.broken = True
        if self._flags is not None:
            self._tell_peer(self._flags, _ABORTED)

    def _tell_peer(self, flags: Any, why: bytes) -> None:
        """Set every flag the peer may wait on next to `why`: a sender's next bucket, offer and (after a
        provisional offer) verdict; a receiver's next releases, its copies' answer and its look."""
        if self.is_sender:
            keys = [self._key("ready", self._sent), self._key("offer", self._offers)]
            keys += [self._key("verdict", 0)] if self._judge_due else []
        else:  # the sender waits on the oldest bucket of each slot it refills, not in order: all it may hold
            keys = [self._key("free", k) for k in range(self._released, self._received + self.num_buffers + 1)]
            keys += [] if self._answered else [self._key("taken", 0)]
            keys += [self._key("looked", 0)] if self._look_due else []
        try:
            for key in keys:
                flags.set(key, why)
        except Exception as exc:  # the store itself is gone: the peer's wait ends at its bound
            logger.warning("colocated rank %s could not tell its peer it %s: %s", self.rank, _ENDS[why], exc)

    # --- flags through the store instead of collectives ------------------------------------------
    def _key(self, what: str, k: int) -> str:
        return f"s{self._seq}/{what}/{k}"

    @property
    def _live(self) -> Any:
        """The flags, for a sync's next step; closed (from another thread), the sync fails here."""
        flags = self._flags
        if flags is None:
            self.broken = True
            raise TransferError(f"rank {self.rank}: this end of the colocated group was closed mid-sync")
        return flags

    def _ended(self, answer: bytes, who: str, what: str) -> None:
        """Raise where `answer` says the peer aborted or closed its end instead of `what`."""
        end = _ENDS.get(answer)
        if end is not None:
            self.broken = True
            raise TransferError(f"rank {self.rank}: the {who} {end} before {what}")

    def _wait_key(self, key: str, what: str) -> None:
        """Wait for the flag `key` (within `timeout_s`), then delete it: read once. The peer's abort
        or close in its place raises."""
        answer = self._get_key(key, what)
        self._live.delete_key(key)
        self._ended(answer, "peer", what)

    def _get_key(self, key: str, what: str) -> bytes:
        """The flag `key`'s value once it is set, within the store's bound: `timeout_s`, set at join (a pair
        in one process shares the sender's, which one session's configuration gives both ends)."""
        flags = self._live
        try:
            return flags.get(key)
        except Exception as exc:
            self.broken = True
            raise TransferError(f"rank {self.rank}: {what} did not arrive within {self.timeout_s}s: {exc}") from exc

    def begin_send(self, own_index: list[int]) -> None:
        self._seq += 1
        self._sent = 0
        self._offers = 0
        self._judge_due = False
        self._in_sync = True

    def begin_receive(self) -> None:
        # The mapped sender tensors stay across syncs (mapping 339 tensors' handles costs more than
        # copying their 15 GB); they go when the offer's generation changes or at close.
        self._seq += 1
        self._received = 0
        self._released = 0
        self._offers = 0
        self._look_due = False
        self._answered = False
        self._in_sync = True

    def end_receive(self) -> None:
        self._release_pending()
        self._in_sync = False  # the sender waits on nothing more of this sync

    def wait_slot(self, slot: int, works: list[Any]) -> None:
        if works[slot] is not None:
            self._wait_key(self._key("free", works[slot]), f"release of bucket {works[slot]}")
            works[slot] = None

    def post(self, gid: int, slot: int, msg: torch.Tensor) -> Any:
        if not self.is_sender:
            # Called once the loader is done with the previous bucket in this slot: release it.
            self._release_pending()
            return None
        self.device_sync_point()
        k = self._sent
        self._sent += 1
        self._live.set(self._key("ready", k), b"1")
        return k

    def post_group(self, gid: int, slot: int, msgs: list[torch.Tensor]) -> Any:
        raise RuntimeError("the colocated transport never sends a bucket as a group (receivers read the slots in place)")

    def drain_slots(self, works: list[Any]) -> None:
        for k in works:
            if k is not None:
                self._wait_key(self._key("free", k), f"release of bucket {k}")
        self._in_sync = False  # every bucket released: the receiver waits on nothing more

    def _release_pending(self) -> None:
        if self._released < self._received:
            self.device_sync_point()
            flags = self._live
            while self._released < self._received:
                flags.set(self._key("free", self._released), b"1")
                self._released += 1

    def finish(self, k: int, sender: int, slot: int, work: Any, label: str) -> None:
        self._release_pending()
        self._wait_key(self._key("ready", k), f"bucket {k}")
        self._received = k + 1

    def release(self, slot: int) -> None:
        pass

    # --- the sender's own tensors, mapped by the receiver (SourceSharing) -------------------------
    @property
    def source_sharing(self) -> SourceSharing | None:
        return self

    @property
    def offer_generation(self) -> int:
        """How many times this sender's tensor handles have travelled (tests check they are reused)."""
        return self._generation

    def can_share(self, t: torch.Tensor) -> bool:
        return self._can_map and can_share(t, self.device)

    def offer(self, tensors: list[torch.Tensor] | None, placed: Placement | None = None, provisional: bool = False) -> None:
        flags = self._live
        key = self._key("offer", self._offers)
        self._offers += 1
        if tensors is None:
            flags.set(key, msgpack.packb({"generation": None}))
            return
        if (placed if placed is not None else placement(tensors)) != self._offered_placement:
            # Held until the next change: the receiver's mappings stay over live tensors.
            old = self._generation
            self._generation += 1
            info = describe_tensors(tensors, self.device)
            flags.set(f"colocated/sources/{self._generation}", msgpack.packb(info, use_bin_type=True))
            if old:
                flags.delete_key(f"colocated/sources/{old}")
            in_process.forget(self._local.pop("offer", None))
            if "local" in info:
                self._local["offer"] = info["local"]
            # Read again: sharing a host storage by descriptor may have moved it (not one `share_memory_()` made).
            self._offered, self._offered_placement = [t.untyped_storage() for t in tensors], placement(tensors)
        self.device_sync_point()  # the source's writes are done before the receiver reads
        flags.set(key, msgpack.packb({"generation": self._generation, "provisional": provisional}))
        self._judge_due = provisional

    def wait_looked(self) -> None:
        if not self._here:  # in another process the receiver's copies do not wait for this one's interpreter
            return
        key = self._key("looked", 0)
        self._get_key(key, "the receiver's look at the provisional offer")
        self._live.delete_key(key)  # in memory: no round trip

    def judge(self, stands: bool, error: str | None = None) -> None:
        self._judge_due = False
        self._live.set(self._key("verdict", 0), error.encode() if error is not None else b"stands" if stands else b"moved")

    def _forget_read(self) -> None:
        while self._read:
            self._live.delete_key(self._read.pop())

    def wait_taken(self) -> None:
        self._forget_read()  # the last sync's flag: the receiver is copying now
        key = self._key("taken", 0)
        answer = self._get_key(key, "the receiver's copies from this sender's tensors")
        self._read.append(key)
        self._ended(answer, "receiver", "its answer on its copies")
        if answer != b"ok":
            self.broken = True
            raise TransferError(f"rank {self.rank}: the receiver failed while copying from this sender's tensors: {answer.decode(errors='replace')}")
        self._in_sync = False  # the receiver answered: it waits on nothing more of this sync

    def take(self) -> tuple[list[torch.Tensor] | None, bool]:
        if self._offers:  # the second offer of a sync: the provisional one and its verdict are read
            self._forget_read()
        key = self._key("offer", self._offers)
        self._offers += 1
        raw = self._get_key(key, "the sender's offer")
        self._ended(raw, "sender", "its offer")
        try:
            offer = msgpack.unpackb(raw, raw=False)
        except (ValueError, msgpack.UnpackException) as exc:
            raise TransferError(f"rank {self.rank}: undecodable offer from the colocated sender: {exc}") from exc
        generation = offer.get("generation", 0) if isinstance(offer, dict) else 0
        if generation is None:  # the slots: no copies out of the sender's tensors follow (no `taken`)
            self._live.delete_key(key)
            return None, False
        self._read.append(key)  # deleted once the copies are queued (`taken`)
        if not isinstance(generation, int) or isinstance(generation, bool) or generation < 1:
            raise TransferError(f"rank {self.rank}: malformed offer from the colocated sender: {offer!r:.200}")
        provisional = offer.get("provisional") is True
        self._look_due = provisional and self._here
        if generation != self._mapped_generation:
            self._mapped = []  # drop the old mappings first
            info = msgpack.unpackb(self._live.get(f"colocated/sources/{generation}"), raw=False)
            self._mapped, self._mapped_generation = map_tensors(info, self.device), generation
            self.mappings += 1
        return self._mapped, provisional

    def verdict(self) -> bool:
        self._looked()
        key = self._key("verdict", 0)
        answer = self._get_key(key, "the sender's check of its provisional offer")
        self._read.append(key)
        self._ended(answer, "sender", "its verdict on its provisional offer")
        if answer in (b"stands", b"moved"):
            return answer == b"stands"
        self.broken = True
        raise TransferError(f"rank {self.rank}: the sender failed while checking its provisional offer: {answer.decode(errors='replace')}")

    def _looked(self) -> None:
        """Tell a sender in this process waiting on it (`wait_looked`) that this receiver looked (once)."""
        if self._look_due:
            self._look_due = False
            self._live.set(self._key("looked", 0), b"1")

    def taken(self, error: str | None = None) -> None:
        failure = None
        if error is not None:
            self._looked()  # a sender waiting for the look goes on to the answer below
        self._forget_read()
        if error is None:
            try:
                self.device_sync_point()  # the loader's copies out of the sender's tensors are done
            except TransferError as exc:
                failure, error = exc, str(exc)
        self._live.set(self._key("taken", 0), b"ok" if error is None else error.encode())
        self._answered = True
        self._in_sync = False  # answered: the sender waits on nothing more of this sync
        if failure is not None:
            raise failure

