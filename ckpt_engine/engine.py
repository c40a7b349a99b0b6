"""The engine contract: `CheckpointEngine`, the lifecycle of one side of a weight-sync group, and
what travels with it (`Rendezvous`, `Topology`, `SendStats`, `TransferError`).

It sits above both `pipeline/` and `transports/`, so neither imports the other through it; the
registry (`registry.py`) builds an engine for a transport's name. Collective contract: every
member (the senders, then every receiver rank) calls `init_process_group` once; per sync the
senders call `send_weights` while every receiver iterates `receive_buckets` over the same
manifest; `finalize` releases buffers and group.
"""

from __future__ import annotations

import datetime
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ckpt_engine.planning.buckets import plan_buckets
from ckpt_engine.delta.request import DeltaRequest
from ckpt_engine.manifest import BucketManifest, TensorSpec
from ckpt_engine.planning.ownership import OwnerMap
from ckpt_engine.staged import StagedVersion

__all__ = ["CheckpointEngine", "Rendezvous", "SendStats", "TransferError", "Topology"]


class TransferError(RuntimeError):
    """A collective failed or timed out mid-stream, or a bucket failed its checksum."""


@dataclass(frozen=True)
class Rendezvous:
    """Where and how a member joins the weight-sync group; travels as a plain dict (msgpack)."""

    host: str
    port: int
    token: str
    world_size: int
    backend: str
    timeout_s: float
    num_senders: int = 1
    """Ranks [0, num_senders) send; every other rank receives from each of them."""

    _KEYS = ("host", "port", "token", "world_size", "backend", "timeout_s")

    def __post_init__(self) -> None:  # every transport's join relies on it: checked once, here
        senders = self.num_senders
        if not isinstance(senders, int) or isinstance(senders, bool) or not 1 <= senders < self.world_size:
            raise ValueError(f"rendezvous.num_senders must be an int in [1, world_size), got {senders!r}")

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self._KEYS}
        if self.num_senders != 1:
            d["num_senders"] = self.num_senders
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Rendezvous:
        if not isinstance(d, dict) or not set(cls._KEYS) <= set(d) or not set(d) <= {*cls._KEYS, "num_senders"}:
            raise ValueError(
                f"rendezvous must be a map with host, port, token, world_size, backend, timeout_s (and num_senders); got {d!r:.200}"
            )
        checks = (
            ("host", str), ("port", int), ("token", str), ("world_size", int), ("backend", str), ("timeout_s", (int, float)),
        )
        for key, typ in checks:
            if not isinstance(d[key], typ) or isinstance(d[key], bool):
                raise ValueError(f"rendezvous.{key} has the wrong type: {d[key]!r}")
        if not 0 < d["port"] < 65536 or d["world_size"] < 2 or d["timeout_s"] <= 0 or not d["token"]:
            raise ValueError(f"rendezvous values out of range: {d!r}")
        return cls(**d)

    def connect_store(self, is_master: bool = False) -> torch.distributed.Store:
        """A client of the rendezvous TCPStore, every key prefixed by this group's token."""
        store = torch.distributed.TCPStore(
            self.host,
            self.port,
            is_master=is_master,
            timeout=datetime.timedelta(seconds=self.timeout_s),
            wait_for_workers=False,
        )
        return torch.distributed.PrefixStore(f"{self.token}/", store)


@dataclass(frozen=True)
class Topology:
    """Rank layout of one weight-sync group: senders first, then each receiver's ranks."""

    num_senders: int
    receiver_offsets: tuple[int, ...]
    world_size: int


@dataclass
class SendStats:
    """What the sender measured; seconds are wall time on the sender's host."""

    bytes: int = 0
    tensors: int = 0
    buckets: int = 0
    export_s: float = 0.0
    pack_s: float = 0.0
    total_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


class CheckpointEngine(ABC):
    """One side (sender or receiver) of the weight-sync group."""

    name: str = "checkpoint engine"
    """The backend's name, for messages."""
    supports_many_senders: bool = False
    """Whether ranks [0, num_senders) may each stream the pieces they own (see `plan`)."""
    device_type: str | None = None
    """The kind of device this backend's tensors live on ("cpu", "cuda", "npu"; None: any), so a
    configured `device` of another kind is refused when the config is loaded."""
    max_ranks: int | None = None
    """The most ranks one group may hold (None: any)."""
    device: torch.device | None = None
    """The device this side's buffers live on (None: the backend has none of its own)."""

    def __init__(self, *, bucket_size_bytes: int, num_buffers: int = 2, timeout_s: float = 300.0, verify: bool = False) -> None:
        if num_buffers < 2:
            raise ValueError(f"num_buffers must be >= 2, got {num_buffers}")
        self.bucket_size_bytes = bucket_size_bytes
        self.num_buffers = num_buffers
        self.timeout_s = timeout_s
        self.verify = verify
        self.rank: int | None = None
        self.world_size: int | None = None
        self.solo_bytes: int | None = None
        """Tensors of at least this size travel in a bucket of their own (see `plan_buckets`)."""

    def plan(self, specs: Sequence[TensorSpec], *, num_senders: int = 1, owners: OwnerMap | None = None) -> BucketManifest:
        """The bucket plan for this engine's buffers and transport (a pure function: every sender
        computes the same one from the same metadata and ownership)."""
        return plan_buckets(specs, self.bucket_size_bytes, solo_bytes=self.solo_bytes, num_senders=num_senders, owners=owners)

    @property
    def supports_delta(self) -> bool:
        """Whether `send_weights` / `receive_buckets` take a `delta` request (base copies, patches)
        on this engine as joined."""
        return False

    def build_topology(self, num_senders: int, receiver_world_sizes: Sequence[int]) -> Topology:
        """Pure rank assignment: senders take ranks [0, num_senders), receivers follow in order."""
        if not isinstance(num_senders, int) or isinstance(num_senders, bool) or num_senders < 1:
            raise ValueError(f"num_senders must be an int >= 1, got {num_senders!r}")
        if num_senders > 1 and not self.supports_many_senders:
            raise ValueError(f"the {self.name} backend supports exactly one sender, got {num_senders}")
        offsets, rank = [], num_senders
        for size in receiver_world_sizes:
            if size < 1:
                raise ValueError(f"every receiver needs at least one rank, got {size}")
            offsets.append(rank)
            rank += size
        if self.max_ranks is not None and rank > self.max_ranks:
            raise ValueError(f"the {self.name} backend holds at most {self.max_ranks} ranks, senders included; got {rank - num_senders} receiver ranks")
        return Topology(num_senders, tuple(offsets), rank)

    @abstractmethod
    def prepare(self) -> dict[str, Any]:
        """Allocate the rotating buffers; returns a description (device, bytes) for reports."""

    @abstractmethod
    def init_process_group(self, rendezvous: Rendezvous, rank: int) -> None:
        """Join the weight-sync group; collective over all `rendezvous.world_size` members."""

    @abstractmethod
    def send_weights(
        self,
        manifest: BucketManifest,
        weights: Iterable[tuple[str, torch.Tensor]],
        *,
        stable: bool = False,
        delta: DeltaRequest | None = None,
    ) -> SendStats:
        """Sender only: stream `weights` to every receiver.

        `weights` yields, in the order of this sender's buckets, one tensor per piece it owns: the full
        tensor with one sender, else this rank's local piece (the bytes the manifest gives it, in the
        tensor's layout). A yielded tensor may be read only until the next one is requested (a sharded
        trainer frees its gathers), unless `stable` says every one stays valid and unchanged until this
        call returns, which lets the engine skip copies. `delta`: keep (and use) base copies of what was
        sent, so later syncs send only changed words; every rank of the group passes the same request.
        """

    @abstractmethod
    def receive_buckets(
        self,
        manifest: BucketManifest,
        destinations: Mapping[str, torch.Tensor] | None = None,
        *,
        delta: DeltaRequest | None = None,
        repeatable: bool = False,
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Receiver only: yield the complete tensors of each bucket as it lands.

        With `delta`, every bucket is taken and checked first (patches against the sender's checksum),
        and nothing is yielded until all passed, so a corrupt patch leaves the engine's weights untouched.

        `destinations` (optional) maps names to the loader's own tensors: a tensor in the wire layout is
        received right there where the bucket plan allows it, and the destination itself is yielded. A
        failed sync then leaves those half-new, as any failed load does: the caller keeps the engine
        paused until a sync succeeds.

        The tensors are views of a rotating buffer, valid until the next item is requested: a loader that
        keeps a reference past that point (vLLM's layerwise reload holds a layer's tensors until the
        layer is complete) must clone it.

        `repeatable`: the caller's loads land each tensor whole where a second load of the same name
        would (into the live tensors, no layerwise reload; a digest of what landed taken again after each pass), so a
        bucket may be yielded again, the later bytes replacing the earlier: a transport may then start
        copying before the sender has checked its walk (`SourceSharing`'s provisional offer).
        """

    def receive_staged(self, manifest: BucketManifest, destinations: Mapping[str, torch.Tensor] | None, *, delta: DeltaRequest) -> StagedVersion:
        """Receiver only, a patch sync (issue 28): take and check every frame as `receive_buckets`
        does, but write nothing of `destinations` (the live weights, the in-place base): the
        checked version is returned, to be applied between two engine steps or discarded.
        Pipelined backends implement it."""
        raise NotImplementedError(f"{type(self).__name__} does not stage patch syncs")

    def restamp_bases(self, manifest: BucketManifest, destinations: Mapping[str, torch.Tensor]) -> None:
        """Receiver only: the in-place delta base of `manifest` was received into other tensors (a
        staging copy) and copied bit for bit into `destinations`; they are the base from now on."""

    @property
    def maps_sender_memory(self) -> bool:
        """Whether a receive may copy straight out of a colocated sender's own tensors (one copy a
        byte): its host work (every copy's launch) then comes in one burst, and the device copies
        after it alone. A receiving engine keeps other host work off that burst (`vllm/routes.py`)."""
        return False

    @property
    def delta_base_bytes(self) -> int:
        """Memory this rank's delta bases take."""
        return 0

    @property
    def last_delta_stats(self) -> dict[str, float]:
        """What this rank measured in its last delta sync (wire bytes, patch buckets, seconds)."""
        return {}

    def abort(self) -> None:
        """Break the group so peers blocked in a collective fail fast instead of timing out."""

    @abstractmethod
    def finalize(self) -> None:
        """Release buffers and leave the group. Safe to call twice."""
