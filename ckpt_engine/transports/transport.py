"""Transport: how one bucket's bytes move between rotating slots of a weight-sync group.

A transport owns the group's links and slot memory: it builds a process group per sender at join
(or maps a peer's buffers), posts one broadcast (or a coalesced group) from or into
a slot, waits for it within `timeout_s`, and orders the loader's copies after the transfer (work
handles, streams and events, or flags through the rendezvous store). The pipeline decides what
travels; it never touches a stream, an event or a process group itself.

Collective contract: every rank of the group calls `join` once; per sync the senders post their
own buckets in their order, the receivers post every sender's buckets in each sender's order.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ckpt_engine.engine import Rendezvous, TransferError
from ckpt_engine.transports.shared_tensors import Placement

__all__ = ["SLACK", "Frames", "SourceSharing", "Transport", "TransportOptions"]

SLACK = 64
"""Room after a bucket's data in each slot, for the 8-byte-aligned checksum."""


@dataclass(frozen=True, kw_only=True)
class TransportOptions:
    """What a transport takes from `checkpoint_engine.engine_kwargs.<backend>` besides the
    pipeline's options (`pipeline.options.EngineOptions`); a transport with options of its own
    declares a subclass beside it (`NixlOptions`) as its `Options`."""

    device: str | int | torch.device | None = None
    """The device this side's slots live on (None: the transport's default)."""

    def __post_init__(self) -> None:
        if self.device is not None:
            try:
                torch.device(self.device)
            except (RuntimeError, TypeError, ValueError):
                raise ValueError(f"device must be a device such as 'cpu', 'cuda:0' or an index, got {self.device!r}") from None


class Transport(ABC):
    """One rank's end of the weight-sync group's links."""

    name: ClassVar[str] = "transport"
    Options: ClassVar[type[TransportOptions]] = TransportOptions
    """This transport's typed options."""
    device_type: ClassVar[str | None] = None
    """The kind of device its slots live on ("cpu", "cuda", "npu"; None: any)."""
    supports_many_senders: ClassVar[bool] = True
    """Whether ranks [0, num_senders) may each stream the pieces they own."""
    max_ranks: ClassVar[int | None] = None
    """The most ranks one group may hold (None: any)."""
    default_solo_bytes = 0
    """Tensors of at least this size get a bucket of their own (0: never); see `plan_buckets`."""
    default_group_max_tensors = 0
    """A bucket of at most this many tensors travels as one coalesced group of per-tensor messages
    (0: never). Both sides derive the choice from the manifest, so they must agree on it."""
    stable_sources: ClassVar[bool] = True
    """Whether a sender may rely on stable sources (record copy plans, send from their memory)."""
    one_sided: ClassVar[bool] = False
    """Receivers read the senders' registered memory (nixl): there is no broadcast on this transport."""

    def __init__(self, options: TransportOptions, *, bucket_size_bytes: int, num_buffers: int, timeout_s: float) -> None:
        self.device = self.resolve_device(options.device)
        self.bucket_size_bytes = bucket_size_bytes
        self.num_buffers = num_buffers
        self.timeout_s = timeout_s
        self.rank: int | None = None
        self.world_size: int | None = None
        self.num_senders = 1
        self.buffers: list[torch.Tensor] = []
        """Slot memory: a sender's `num_buffers` slots, a receiver's `num_buffers` per sender."""
        self.broken = False
        """Set by any failure: the group must be finalized and rejoined."""

    # --- device ----------------------------------------------------------------------------------
    @classmethod
    def resolve_device(cls, device: str | int | torch.device | None) -> torch.device:
        return torch.device("cpu")

    @property
    def uses_streams(self) -> bool:
        """Whether device work is ordered by streams and events (else by host work handles)."""
        return False

    def new_event(self) -> Any:
        return None

    def current_stream(self) -> Any:
        return None

    def device_sync_point(self) -> None:
        """The host waits until this rank's work so far on the current stream is done (one event;
        a no-op on a CPU device): before handing a buffer over to, or back from, another process."""
        if self.device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            self.wait_event(ev, "local copies")

    def wait_event(self, event: Any, what: str) -> None:
        """Host wait on one event with a deadline (accelerators only; no device-wide sync)."""
        deadline = time.monotonic() + self.timeout_s
        while not event.query():
            if time.monotonic() > deadline:
                self.broken = True
                raise TransferError(f"rank {self.rank}: {what} did not finish within {self.timeout_s}s")
            time.sleep(2e-5)  # the sync's end is detected within ~0.1 ms; the thread stays idle

    # --- membership ------------------------------------------------------------------------------
    @property
    def is_sender(self) -> bool:
        return self.rank is not None and self.rank < self.num_senders

    def alloc_buffers(self, count: int) -> None:
        while len(self.buffers) < count:
            self.buffers.append(torch.empty(self.bucket_size_bytes + SLACK, dtype=torch.uint8, device=self.device))
            self.on_new_slot()

    def add_slots(self, buffers: list[torch.Tensor]) -> None:
        """Slots whose memory was made elsewhere (mapped from a peer, or shared with one)."""
        for buf in buffers:
            self.buffers.append(buf)
            self.on_new_slot()

    def clear_slots(self) -> None:
        self.buffers = []

    def slot(self, slot: int) -> torch.Tensor:
        """Slot `slot`'s memory. Gone (`close()` dropped every slot while a sync ran on another
        thread: a session closed past its lock's bound, an engine's `leave`), the sync fails here."""
        buffers = self.buffers
        if not buffers:
            self.broken = True
            raise TransferError(f"rank {self.rank}: this end's slots were dropped mid-sync (its group was closed)")
        return buffers[slot]

    def on_new_slot(self) -> None:
        """A slot was added to `buffers` (streamed transports give it its events)."""

    def describe(self) -> dict[str, Any]:
        """For reports: the device and the slot memory this rank allocated."""
        return {"device": str(self.device), "buffer_bytes": sum(b.numel() for b in self.buffers), "num_buffers": len(self.buffers)}

    def prepare(self) -> dict[str, Any]:
        if not self.buffers:
            self.alloc_buffers(self.num_buffers)
        return self.describe()

    @abstractmethod
    def join(self, rendezvous: Rendezvous, rank: int) -> None:
        """Join the weight-sync group (collective over every member); allocates the slots."""

    @property
    @abstractmethod
    def group(self) -> Any:
        """The first link of this rank (its first process group, or the store), None before join."""

    @property
    def groups(self) -> dict[int, Any]:
        """Process groups by sender (empty where none exist)."""
        return {}

    @abstractmethod
    def abort(self) -> None:
        """Break the links so peers blocked in a collective fail fast."""

    @abstractmethod
    def close(self) -> None:
        """Leave the group and drop the slots. Safe to call twice."""

    @property
    def frames(self) -> Frames | None:
        """How this transport, as joined, carries delta frames: unslotted messages of any size
        (None: it carries none, and a delta sync is refused)."""
        return None

    @property
    def source_sharing(self) -> SourceSharing | None:
        """This transport's way of letting the receiver copy straight out of a stable sender's own
        tensors (None: every byte goes through the slots)."""
        return None

    def reads_in_place(self, sender: int) -> bool:
        """Whether receivers read `sender`'s slots in place: every bucket of it must be packed
        into its slot (no message from a source's memory, no direct or grouped receive)."""
        return False

    # --- one sync --------------------------------------------------------------------------------
    def begin_send(self, own_index: list[int]) -> None:
        """A sender starts a sync; `own_index`: the manifest index of each of its buckets."""

    def begin_receive(self) -> None:
        """A receiver starts a sync."""

    def end_receive(self) -> None:
        """A receiver's loader has issued its copies of the last bucket."""

    # --- slotted messages ------------------------------------------------------------------------
    @abstractmethod
    def wait_slot(self, slot: int, works: list[Any]) -> None:
        """Sender: before packing into `slot`, wait until its previous broadcast has left."""

    @abstractmethod
    def post(self, gid: int, slot: int, msg: torch.Tensor) -> Any:
        """One broadcast on group `gid` from its sender: out of slot `slot` (sender) or into it
        (receiver), ordered after the current stream's work and, on receivers, after the slot's
        previous loader copies."""

    @abstractmethod
    def post_group(self, gid: int, slot: int, msgs: list[torch.Tensor]) -> Any:
        """Like `post`, for one coalesced group of messages (same sizes and order on every rank)."""

    def landed(self, work: Any) -> bool:
        """Whether a receive has finished (host work), so `finish` will not block; a failed
        receive counts as finished and raises there."""
        return work is not None and work.is_completed()

    @abstractmethod
    def finish(self, k: int, sender: int, slot: int, work: Any, label: str) -> None:
        """Receiver: bucket `k` (manifest index, from `sender`) has landed in `slot` before the
        loader reads it (the host waits on host work, the compute stream on an accelerator)."""

    @abstractmethod
    def release(self, slot: int) -> None:
        """Receiver: the loader has issued its copies out of `slot`; it may be refilled."""

    @abstractmethod
    def drain_slots(self, works: list[Any]) -> None:
        """Sender: every slotted broadcast has left (within the timeout)."""

    def wait_compute(self, what: str) -> None:
        """The host waits for the work queued on the current stream so far (the loader's copies,
        the patches): no-op on host work."""


class Frames(ABC):
    """Delta frames: unslotted messages (a frame header, then its payload) on a transport's groups,
    which a transport offers as `Transport.frames` where it can carry them.

    Per delta sync, senders `post` their frames in bucket order; receivers allocate each with
    `fresh`, `post` it, `settle` a header before reading it on the host (`reading`), and order the
    compute stream after a payload with `landed_event` / `wait_landed`."""

    @abstractmethod
    def post(self, gid: int, msg: torch.Tensor, *, after_producer: bool = True) -> Any:
        """One broadcast of `msg` on group `gid` from its sender, ordered after the current
        stream's work; `after_producer=False`: a receiver's message allocated with `fresh`, which
        lands without waiting for the compute stream."""

    @abstractmethod
    def fresh(self, gid: int, size: int, dtype: torch.dtype = torch.uint8, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """A receive buffer the group's broadcast may write at once."""

    @abstractmethod
    def settle(self, gid: int, work: Any, what: str) -> None:
        """Wait, with the timeout, for one broadcast on group `gid` (the host then reads its
        bytes); on an accelerator, for everything queued on that group's stream."""

    @abstractmethod
    def drain(self, works: list[Any], what: str) -> None:
        """Every frame posted has left (within the timeout)."""

    def landed_event(self, gid: int) -> Any:
        """An event after the work queued on group `gid` (None where the host waits instead)."""
        return None

    def wait_landed(self, event: Any) -> None:
        """The compute stream waits for `landed_event`'s event."""

    def reading(self, gid: int) -> AbstractContextManager[None]:
        """Where a received header is copied to the host: the group's own stream."""
        return nullcontext()


class SourceSharing(ABC):
    """A transport whose receiver maps a stable sender's own tensors and copies straight out of them
    (one copy per byte, no slot): colocated processes on one device.

    Per sync, right after `begin_send` / `begin_receive`: the sender calls `offer` (its tensors, or
    None for a sync through the slots), then `wait_taken`; the receiver calls `take`, and after the
    loader's copies `taken`. The sender keeps its tensors unchanged until `wait_taken` returns.

    A provisional offer (the last sync's tensors, offered before this sync's walk is checked against
    them) is followed by the sender's `judge`; the receiver asks for it with `verdict` (before or after
    its copies) and, where the walk moved, takes the sender's second offer with another `take`."""

    @abstractmethod
    def can_share(self, t: torch.Tensor) -> bool:
        """Whether the receiver can map `t` where it lies (no copy, nothing moved on the sender)."""

    @abstractmethod
    def offer(self, tensors: list[torch.Tensor] | None, placed: Placement | None = None, provisional: bool = False) -> None:
        """Sender: the tensors (manifest order, non-empty ones) this sync's bytes are copied from;
        handles travel only when they differ from the last offer's. None: the slots carry this sync.
        `placed`: their `placement`, if the caller read it since they last moved (not read again).
        `provisional`: the last sync's tensors, to be judged (`judge`) once this sync's walk is read."""

    @abstractmethod
    def wait_looked(self) -> None:
        """Sender, after a provisional offer: wait until the receiver looked at it, where the two share
        one interpreter (its copies are then queued before this rank's walk takes the interpreter)."""

    @abstractmethod
    def judge(self, stands: bool, error: str | None = None) -> None:
        """Sender: whether the provisional offer stands (this sync's walk lies as it does), or `error`
        ended the walk."""

    @abstractmethod
    def wait_taken(self) -> None:
        """Sender: the receiver has copied every byte (within the timeout; its failure is raised here)."""

    @abstractmethod
    def take(self) -> tuple[list[torch.Tensor] | None, bool]:
        """Receiver: the sender's offered tensors, mapped (None: this sync goes through the slots), and
        whether the offer is provisional (`verdict` says if it stands)."""

    @abstractmethod
    def verdict(self) -> bool:
        """Receiver, after a provisional `take`: whether the offer stands (waited for; the sender's
        failure is raised). False: the sender's next offer follows (`take` again)."""

    @abstractmethod
    def taken(self, error: str | None = None) -> None:
        """Receiver: the loader's copies are done (waited for here), or `error` ended the sync."""
