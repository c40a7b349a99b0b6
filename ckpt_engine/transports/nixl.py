"""nixl: a one-sided pull transport over NIXL (UCX: shared memory or TCP on a host, NVLink /
cuda_ipc or RDMA between GPUs), behind the registry as `checkpoint_engine.backend: nixl`.

Senders register their rotating slots with a NIXL agent once, at join, and publish where they lie
(`nixl_agent.SlotOffer`, msgpack through the rendezvous store). Per bucket a sender packs into its
slot and announces it (`ready`: slot, offset, bytes); every receiver then READs the bytes it needs
straight from the sender's memory into its own slot, and says `free` as soon as its read is done:
the sender reuses a slot once every receiver's read of it is done, not after their loaders ran.
Each receiver reads at its own pace and only what it is sent for: with receive plans (region
delivery) every receiver set is a group of its own (`pipeline/region_groups.py`), so a TP/EP rank
reads its regions and nothing else. Checksums (`verify`), versions, staged dense syncs and the
failure semantics are the pipeline's, as on every transport; delta frames are not carried (a delta
sync is refused by name: `frames` is None).

Failures: any rank's abort writes the group's `abort` key, which every wait here looks at (at
least twice a second), so a receiver whose loader or checksum failed stops its sender within a
second, naming it; a dead peer is found by the session (its RPC fails) or by the timeout.
The rate guardrail (`nixl_rate.py`) checks every link's achieved GB/s at the end of each sync.
"""

from __future__ import annotations

import datetime
import logging
import time
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from ckpt_engine.engine import Rendezvous, TransferError
from ckpt_engine.transports.nixl_agent import NixlAgent, SlotOffer, load_nixl
from ckpt_engine.transports.nixl_rate import SLOW_ACTIONS, PullRates
from ckpt_engine.transports.transport import SLACK, Transport, TransportOptions

__all__ = ["NixlOptions", "NixlTransport"]

logger = logging.getLogger(__name__)

_API = load_nixl()  # a missing package fails the registry's import of this module, by name, with the install line

_POLL_S = 0.5
"""How long one store wait runs before the abort flag and the deadline are looked at again."""
_MAX_NAP_S = 2e-4
"""Longest sleep between two looks at a read in flight: the read's end is seen within ~0.2 ms of it
(a 1.28 GB read over NVLink takes ~3.5 ms; at 1 ms the loader and the `free` came ~0.5 ms late)."""
_ANNOUNCE_S = 5e-4
"""How often a receiver waiting for one read looks at the store for its next buckets' announcements,
so their reads are posted while this one is in flight (a look is one round trip to the store)."""
_MAX_PROGRESS_NAP_S = 1e-4
"""Longest sleep between two progress calls of a waiting sender (its receivers' reads over TCP move
only while it progresses)."""
_STORE_S = 5e-4
"""How often a waiting sender looks at the store (a round trip to the rendezvous host)."""


def _trace(what: str, rank: int | None, ordinal: int, sender: int | None = None, at: float | None = None) -> None:
    """One phase edge of the per-bucket timeline at DEBUG (`docs/nixl.md`, "Where a sync's time goes")."""
    if logger.isEnabledFor(logging.DEBUG):
        when = time.perf_counter() if at is None else at
        logger.debug("nixl trace %.6f rank %s %s bucket %d%s", when, rank, what, ordinal, "" if sender is None else f" from sender {sender}")


@dataclass(frozen=True, kw_only=True)
class NixlOptions(TransportOptions):
    min_gbps: float | None = None
    """The rate guardrail's floor: a receiver whose reads from one sender achieved less than this
    (GB/s over the time a read was in flight) in a sync logs a warning naming the link, or fails
    the sync with `on_slow: error`. None: rates are measured and logged at debug level only."""
    on_slow: str = "warn"
    """What a link below `min_gbps` does: `warn` (a warning per sync and link) or `error` (the sync
    fails on that receiver, which names the link; the engine stays paused and stale as after any
    failed sync)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        m = self.min_gbps
        if m is not None and (isinstance(m, bool) or not isinstance(m, (int, float)) or not m > 0):
            raise ValueError(f"min_gbps must be a positive number of GB/s (or unset), got {m!r}")
        if self.on_slow not in SLOW_ACTIONS:
            raise ValueError(f"on_slow must be one of {', '.join(SLOW_ACTIONS)}, got {self.on_slow!r}")


@dataclass(eq=False)
class _Read:
    """One receiver's read of one sender's bucket: started once the sender announced it."""

    sender: int
    ordinal: int
    slot: int
    msg: torch.Tensor
    req: Any = None
    posted: float = 0.0


class NixlTransport(Transport):
    """Receivers pull every bucket from the senders' registered slots with one-sided READs."""

    name = "nixl"
    Options = NixlOptions
    device_type = None
    """CPU memory or CUDA memory: whichever the slots' device is (UCX picks the wire)."""
    one_sided = True

    def __init__(self, options: TransportOptions, **kwargs: Any) -> None:
        opts = options if isinstance(options, NixlOptions) else NixlOptions(device=options.device)
        super().__init__(opts, **kwargs)
        self.rates = PullRates(opts.min_gbps, opts.on_slow)
        self._store: Any = None
        self._agent: NixlAgent | None = None
        self._seq = 0
        self._sent = 0
        self._posted: list[int] = []
        self._unstarted: list[_Read] = []
        """Reads the pipeline posted whose announcement had not come yet, in post order."""
        self._receivers: list[int] = []

    @classmethod
    def resolve_device(cls, device: str | int | torch.device | None) -> torch.device:
        if device is None:
            return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"the nixl backend reads CPU or CUDA memory, got device={device!r}")
        if dev.type == "cuda":
            dev = dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(dev)
        return dev

    @property
    def group(self) -> Any:
        return self._store

    def reads_in_place(self, sender: int) -> bool:
        return True  # receivers read the senders' slots: every bucket is packed into one

    # --- membership ------------------------------------------------------------------------------
    def join(self, rendezvous: Rendezvous, rank: int) -> None:
        """Collective over the group: senders register their slots and publish their offers;
        receivers load every sender's offer and connect, then say so (or why not), and each
        sender waits for every receiver's word, so a bad offer fails the join on every rank."""
        if self._agent is not None:
            raise RuntimeError("init_process_group() was already called; call finalize() first to rejoin")
        senders = rendezvous.num_senders
        self.num_senders, self.rank, self.world_size = senders, rank, rendezvous.world_size
        self._receivers = list(range(senders, rendezvous.world_size))
        self.prepare()
        if not self.is_sender:
            self.alloc_buffers(self.num_buffers * senders)  # one set of rotating slots per sender
        store: Any = rendezvous.connect_store()  # a Store takes bytes too (its stubs say str)
        timeout = datetime.timedelta(seconds=rendezvous.timeout_s)  # peers may start seconds later: the join's bound
        agent = NixlAgent(_API, f"r{rank}", list(self.buffers))
        try:
            if self.is_sender:
                store.set(f"nixl/offer/{rank}", agent.offer().encode())
                self._store, self._agent = store, agent  # the wait progresses the agent: receivers connect to it meanwhile
                self._wait_progressing(agent, [f"nixl/joined/{r}" for r in self._receivers], "the receivers' joins", time.monotonic() + rendezvous.timeout_s)
                for r in self._receivers:
                    answer = store.get(f"nixl/joined/{r}")
                    if answer != b"ok":
                        raise TransferError(f"rank {rank}: receiver rank {r} could not join the nixl group: {answer.decode(errors='replace')}")
            else:
                try:
                    for s in range(senders):
                        store.wait([f"nixl/offer/{s}"], timeout)
                        offer = SlotOffer.decode(store.get(f"nixl/offer/{s}"), sender=s, num_slots=self.num_buffers, slot_bytes=self.bucket_size_bytes + SLACK)
                        agent.add_peer(s, offer)
                        agent.touch(s, time.monotonic() + rendezvous.timeout_s)
                except Exception as exc:
                    store.set(f"nixl/joined/{rank}", f"{type(exc).__name__}: {exc}".encode())
                    raise
                store.set(f"nixl/joined/{rank}", b"ok")
        except BaseException:
            self._store, self._agent = None, None
            agent.close()
            raise
        self._agent, self._store, self._seq = agent, store, 0
        self.broken = False
        logger.info(
            "rank %d/%d joined nixl group %s as agent %s (%d senders, %d slots of %d bytes on %s)",
            rank, self.world_size, rendezvous.token, agent.name, senders, len(self.buffers), self.bucket_size_bytes + SLACK, self.device,
        )

    def abort(self) -> None:
        """Break the group: every rank's next wait sees the abort key and fails."""
        self.broken = True
        if self._store is not None:
            try:
                self._store.set("nixl/abort", f"rank {self.rank} aborted".encode())
            except Exception as exc:  # the store's host may be the one that failed
                logger.debug("nixl: could not write the abort key: %s", exc)

    def close(self) -> None:
        agent, self._agent = self._agent, None
        if agent is not None:
            agent.close()
        self._store = None
        self.buffers = []

    # --- flags through the store -----------------------------------------------------------------
    def _key(self, what: str, sender: int, ordinal: int, rank: int | None = None) -> str:
        tail = f"/{rank}" if rank is not None else ""
        return f"s{self._seq}/{what}/{sender}/{ordinal}{tail}"

    def _check_abort(self, what: str) -> None:
        if self.broken:
            raise TransferError(f"rank {self.rank}: {what}: the group was aborted on this rank")
        if self._store.check(["nixl/abort"]):
            self.broken = True
            why = self._store.get("nixl/abort").decode(errors="replace")
            raise TransferError(f"rank {self.rank}: {what} stopped: {why} (the nixl group is broken)")

    def _wait(self, keys: list[str], what: str) -> None:
        """Wait for every key within `timeout_s`, looking at the abort key between short waits; a
        sender keeps its agent progressing meanwhile (the receivers' reads of its slots)."""
        deadline = time.monotonic() + self.timeout_s
        if self.is_sender and self._agent is not None:
            self._wait_progressing(self._agent, keys, what, deadline)
            return
        while True:
            left = deadline - time.monotonic()
            try:
                self._store.wait(keys, datetime.timedelta(seconds=max(0.01, min(_POLL_S, left))))
                return
            except Exception as exc:
                self._check_abort(what)
                if time.monotonic() >= deadline:
                    self.broken = True
                    raise TransferError(f"rank {self.rank}: {what} did not arrive within {self.timeout_s}s: {exc}") from exc

    def _wait_progressing(self, agent: NixlAgent, keys: list[str], what: str, deadline: float) -> None:
        """`_wait` on a sender: progress the agent between looks at the store (every `_STORE_S`)."""
        next_store = next_abort = 0.0
        nap = 1e-5
        while True:
            agent.progress()
            now = time.monotonic()
            if now >= next_store:
                if self._store.check(keys):
                    return
                next_store = now + _STORE_S
                if now >= next_abort:
                    self._check_abort(what)
                    next_abort = now + _POLL_S
                    if now >= deadline:
                        self.broken = True
                        raise TransferError(f"rank {self.rank}: {what} did not arrive within {self.timeout_s}s")
            time.sleep(nap)
            nap = min(2 * nap, _MAX_PROGRESS_NAP_S)

    # --- sender ----------------------------------------------------------------------------------
    def begin_send(self, own_index: list[int]) -> None:
        self._seq += 1
        self._sent = 0

    def post(self, gid: int, slot: int, msg: torch.Tensor) -> Any:
        if not self.is_sender:
            return self._post_read(gid, slot, msg)
        assert self.rank is not None
        self.device_sync_point()  # the packed bytes are in memory before anyone reads them
        ordinal = self._sent
        self._sent += 1
        offset = msg.data_ptr() - self.buffers[slot].data_ptr()
        self._store.set(self._key("ready", self.rank, ordinal), msgpack.packb([slot, offset, msg.numel() * msg.element_size()]))
        _trace("packed+announced", self.rank, ordinal)
        return ordinal

    def post_group(self, gid: int, slot: int, msgs: list[torch.Tensor]) -> Any:
        raise RuntimeError("the nixl transport never sends a bucket as a group (receivers read the packed slots)")

    def _wait_free(self, ordinal: int) -> None:
        """Every receiver has read this sender's bucket `ordinal`: its slot may be packed again."""
        assert self.rank is not None
        keys = [self._key("free", self.rank, ordinal, r) for r in self._receivers]
        _trace("waits free", self.rank, ordinal)
        self._wait(keys, f"the receivers' reads of bucket {ordinal}")
        _trace("free seen", self.rank, ordinal)
        for key in keys:
            self._store.delete_key(key)
        self._store.delete_key(self._key("ready", self.rank, ordinal))

    def wait_slot(self, slot: int, works: list[Any]) -> None:
        if works[slot] is not None:
            self._wait_free(works[slot])
            works[slot] = None

    def drain_slots(self, works: list[Any]) -> None:
        for ordinal in works:
            if ordinal is not None:
                self._wait_free(ordinal)

    # --- receiver --------------------------------------------------------------------------------
    def begin_receive(self) -> None:
        self._seq += 1
        self._posted = [0] * self.num_senders
        self._unstarted = []
        self.rates.begin()

    def _post_read(self, gid: int, slot: int, msg: torch.Tensor) -> _Read:
        sender = gid
        read = _Read(sender, self._posted[sender], slot, msg)
        self._posted[sender] += 1
        if not self._start(read):
            self._unstarted.append(read)
        return read

    def _start_announced(self) -> None:
        """Post every read whose announcement has come since: the link then carries bucket k+1
        while this receiver waits for bucket k's read or its loader copies bucket k (before, a read
        was posted only when the pipeline came to finish it, and the link idled meanwhile). A
        sender announces in order, so one look per sender stops at its first unannounced bucket."""
        if not self._unstarted:
            return
        blocked: set[int] = set()
        left: list[_Read] = []
        for read in self._unstarted:
            if read.sender in blocked or not self._start(read):
                blocked.add(read.sender)
                left.append(read)
        self._unstarted = left

    def _start(self, read: _Read) -> bool:
        """Start `read` if its sender has announced the bucket; whether it is started."""
        if read.req is not None:
            return True
        key = self._key("ready", read.sender, read.ordinal)
        if not self._store.check([key]):
            return False
        try:
            slot, offset, nbytes = msgpack.unpackb(self._store.get(key))
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            self.broken = True
            raise TransferError(f"rank {self.rank}: sender {read.sender}'s announcement of its bucket {read.ordinal} is malformed: {exc}") from exc
        local_offset = read.msg.data_ptr() - self.buffers[read.slot].data_ptr()
        want = (read.slot % self.num_buffers, local_offset, read.msg.numel() * read.msg.element_size())
        if (slot, offset, nbytes) != want:
            self.broken = True
            raise TransferError(
                f"rank {self.rank}: sender {read.sender} announced its bucket {read.ordinal} at slot {slot}, offset {offset}, "
                f"{nbytes} bytes; this receiver's plan reads slot {want[0]}, offset {want[1]}, {want[2]} bytes (another plan?)"
            )
        assert self._agent is not None
        read.posted = time.perf_counter()  # before the call: where UCX copies inside it (the CPU box), that is the read
        try:
            read.req = self._agent.read(read.sender, slot, offset, read.msg)
        except Exception as exc:
            self.broken = True
            raise TransferError(f"rank {self.rank}: the read of bucket {read.ordinal} from sender {read.sender} could not start: {exc}") from exc
        _trace("read posted", self.rank, read.ordinal, read.sender, read.posted)
        _trace("read post returned", self.rank, read.ordinal, read.sender)
        return True

    def landed(self, work: Any) -> bool:
        if work is None or not self._start(work):
            return False
        assert self._agent is not None
        return self._agent.state(work.req) != "PROC"

    def finish(self, k: int, sender: int, slot: int, work: Any, label: str) -> None:
        read: _Read = work
        what = f"bucket {label}"
        if not self._start(read):
            self._wait([self._key("ready", read.sender, read.ordinal)], f"{what} (its sender's announcement)")
            self._start(read)
        self._unstarted = [r for r in self._unstarted if r is not read]
        assert self._agent is not None
        deadline = time.monotonic() + self.timeout_s
        next_look = time.monotonic() + _POLL_S
        next_announce = 0.0
        nap = 1e-5
        while (state := self._agent.state(read.req)) == "PROC":
            now = time.monotonic()
            if now >= next_announce:
                self._start_announced()
                next_announce = now + _ANNOUNCE_S
            if now >= next_look:
                self._check_abort(what)
                next_look = now + _POLL_S
                if now >= deadline:
                    self.broken = True
                    raise TransferError(f"rank {self.rank}: the read of {what} did not finish within {self.timeout_s}s")
            time.sleep(nap)
            nap = min(2 * nap, _MAX_NAP_S)  # each look progresses this agent; the sender progresses its own
        if state != "DONE":
            self.broken = True
            raise TransferError(f"rank {self.rank}: the read of {what} failed in NIXL ({state}): did sender {read.sender} leave or die?")
        done = time.perf_counter()
        _trace("read done seen", self.rank, read.ordinal, read.sender)
        nbytes = read.msg.numel() * read.msg.element_size()
        offer = self._agent.peers[read.sender]
        self.rates.add(read.sender, f"from sender {read.sender} (agent {offer.agent}) to rank {self.rank} (agent {self._agent.name})", nbytes, read.posted, done)
        self._store.set(self._key("free", read.sender, read.ordinal, self.rank), b"1")
        _trace("free set", self.rank, read.ordinal, read.sender)
        self._start_announced()  # whatever came meanwhile travels while the loader copies this bucket

    def release(self, slot: int) -> None:
        # The next read into this slot starts at its refill, right after this: the loader's copies
        # out of it must be done first (a no-op on host memory, one event wait on a GPU).
        self.device_sync_point()
        _trace("slot released", self.rank, slot)

    def wait_compute(self, what: str) -> None:
        self.device_sync_point()  # the loader's copies out of the last slot (one event on a GPU, nothing on the host)

    def end_receive(self) -> None:
        failure = self.rates.check()
        if failure is not None:
            self.broken = True
            raise TransferError(f"rank {self.rank}: {failure} (on_slow: error)")
