"""CheckpointEngine: the lifecycle every transport backend implements.

Collective contract: one weight-sync group holds the sender (rank 0) and every receiver rank. All
members call `init_process_group` once; then, per sync, the sender calls `send_weights` while every
receiver iterates `receive_weights` over the same manifest. `finalize` releases buffers and group.
"""

from __future__ import annotations

import datetime
import logging
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ckpt_engine.buckets import plan_buckets
from ckpt_engine.manifest import BucketManifest, TensorSpec

__all__ = ["CheckpointEngine", "Rendezvous", "SendStats", "TransferError", "Topology"]

logger = logging.getLogger(__name__)


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

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("host", "port", "token", "world_size", "backend", "timeout_s")}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Rendezvous:
        if not isinstance(d, dict) or set(d) != {"host", "port", "token", "world_size", "backend", "timeout_s"}:
            raise ValueError(f"rendezvous must be a map with host, port, token, world_size, backend, timeout_s; got {d!r:.200}")
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
    transfer_s: float = 0.0
    total_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


class CheckpointEngine(ABC):
    """One side (sender or receiver) of the weight-sync group."""

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

    def plan(self, specs: Sequence[TensorSpec]) -> BucketManifest:
        """The sender's bucket plan for this engine's buffers and transport."""
        return plan_buckets(specs, self.bucket_size_bytes, solo_bytes=self.solo_bytes)

    @classmethod
    def build_topology(cls, num_senders: int, receiver_world_sizes: Sequence[int]) -> Topology:
        """Pure rank assignment: senders take ranks [0, num_senders), receivers follow in order."""
        if num_senders != 1:
            raise ValueError(f"{cls.__name__} supports exactly one sender, got {num_senders}")
        offsets, rank = [], num_senders
        for size in receiver_world_sizes:
            if size < 1:
                raise ValueError(f"every receiver needs at least one rank, got {size}")
            offsets.append(rank)
            rank += size
        return Topology(num_senders, tuple(offsets), rank)

    @abstractmethod
    def prepare(self) -> dict[str, Any]:
        """Allocate the rotating buffers; returns a description (device, bytes) for reports."""

    @abstractmethod
    def init_process_group(self, rendezvous: Rendezvous, rank: int) -> None:
        """Join the weight-sync group; collective over all `rendezvous.world_size` members."""

    @abstractmethod
    def send_weights(
        self, manifest: BucketManifest, weights: Iterable[tuple[str, torch.Tensor]], *, stable: bool = False
    ) -> SendStats:
        """Sender only: stream `weights` (in manifest order) to every receiver.

        A yielded tensor may be read only until the next one is requested (a sharded trainer frees
        its gathered parameters), unless `stable` says every yielded tensor stays valid and
        unchanged until this call returns, which lets the engine skip copies.
        """

    @abstractmethod
    def receive_buckets(
        self, manifest: BucketManifest, destinations: Mapping[str, torch.Tensor] | None = None
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Receiver only: yield the complete tensors of each bucket as it lands.

        `destinations` (optional) maps names to the loader's own tensors: a tensor split over
        several buckets, or alone in its bucket, whose destination has the wire layout is received
        right there, and the destination itself is yielded (copying it onto itself is skipped by
        `batched_copy_`). A failed sync then leaves those destinations half-new, as any failed
        load does: the caller keeps the engine paused until a sync succeeds.

        The tensors are views of a rotating buffer, valid until the next item is requested; a
        loader copies them into its parameters (on the current stream) before asking for more. A
        loader that keeps a reference past that point (vLLM's layerwise reload holds tensors of a
        layer until the layer is complete) must clone it, or it will read the next bucket's bytes.
        """

    def receive_weights(
        self, manifest: BucketManifest, destinations: Mapping[str, torch.Tensor] | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Receiver only: the same tensors one by one, for loaders that take (name, tensor) pairs."""
        for bucket in self.receive_buckets(manifest, destinations):
            yield from bucket

    @abstractmethod
    def finalize(self) -> None:
        """Release buffers and leave the group. Safe to call twice."""
