"""PipelinedEngine: the CheckpointEngine every built-in backend is, composed of a transport (how
bytes move between slots), a sender and a receiver (what moves, in which order, and its checks).

Each backend file names its transport (`GlooCheckpointEngine` = this engine over `GlooTransport`).
Per plan, everything a rank keeps lives in one `PlanState`, made for a manifest digest and dropped
whole when a sync brings another plan or the group is left.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any, ClassVar

import torch

from ckpt_engine.delta.request import DeltaRequest
from ckpt_engine.delta.warm import warm_up
from ckpt_engine.manifest import BucketManifest
from ckpt_engine.pipeline.delta_bases import check_scatter_below
from ckpt_engine.pipeline.options import PipelineOptions
from ckpt_engine.pipeline.plan_state import PlanState
from ckpt_engine.pipeline.receiver import Receiver
from ckpt_engine.pipeline.sender import Sender
from ckpt_engine.staged import StagedVersion
from ckpt_engine.transports.base import CheckpointEngine, Rendezvous, SendStats
from ckpt_engine.transports.transport import Transport

__all__ = ["PipelinedEngine"]


class PipelinedEngine(CheckpointEngine):
    """Senders stream their buckets to every receiver through `transport_cls`."""

    transport_cls: ClassVar[type[Transport]]
    supports_many_senders = True
    supports_delta = True

    def __init__(
        self,
        *,
        bucket_size_bytes: int,
        num_buffers: int = 2,
        timeout_s: float = 300.0,
        verify: bool = False,
        device: str | int | torch.device | None = None,
        num_lanes: int | None = None,
        solo_bytes: int | None = None,
        group_max_tensors: int | None = None,
        delta_scatter_below: float | None = None,
        **transport_options: Any,
    ) -> None:
        """`transport_options`: what one transport takes besides the shared options (nccl:
        `high_priority`; nccl_handoff: `local_senders`, `high_priority`)."""
        super().__init__(bucket_size_bytes=bucket_size_bytes, num_buffers=num_buffers, timeout_s=timeout_s, verify=verify)
        if solo_bytes is not None and (not isinstance(solo_bytes, int) or isinstance(solo_bytes, bool) or solo_bytes < 0):
            raise ValueError(f"solo_bytes must be an int >= 0 (0: never), got {solo_bytes!r}")
        if group_max_tensors is not None and (not isinstance(group_max_tensors, int) or isinstance(group_max_tensors, bool) or group_max_tensors < 0):
            raise ValueError(f"group_max_tensors must be an int >= 0 (0: never), got {group_max_tensors!r}")
        lanes = num_lanes if num_lanes is not None else self.transport_cls.default_num_lanes
        if not isinstance(lanes, int) or lanes < 1:
            raise ValueError(f"num_lanes must be an int >= 1, got {num_lanes!r}")
        self.transport = self.transport_cls(
            device=device, bucket_size_bytes=bucket_size_bytes, num_buffers=num_buffers, num_lanes=lanes, timeout_s=timeout_s,
            **transport_options,
        )
        self.device = self.transport.device
        self.num_lanes = lanes
        self.solo_bytes = (solo_bytes if solo_bytes is not None else self.transport.default_solo_bytes) or None
        self.group_max_tensors = group_max_tensors if group_max_tensors is not None else self.transport.default_group_max_tensors
        self.delta_scatter_below = check_scatter_below(delta_scatter_below)
        self.options = options = PipelineOptions(bucket_size_bytes, num_buffers, timeout_s, verify, self.group_max_tensors)
        self.sender = Sender(self.transport, options, self, scatter_below=self.delta_scatter_below)
        self.receiver = Receiver(self.transport, options)
        self._state: PlanState | None = None

    # --- fault hooks (declared: fault tests override them) ---------------------------------------
    def _tamper_hook(self, bucket_index: int, message: torch.Tensor) -> None:
        """Called after a bucket is packed (or encoded), before it is sent; fault tests corrupt here."""

    def _tamper_size_hook(self, bucket_index: int, kind: int, size: int) -> int:
        """The payload size a delta frame header announces; fault tests make a sender lie here."""
        return size

    def _tamper_header_hook(self, bucket_index: int, header: torch.Tensor) -> None:
        """Called on a delta frame's sealed header before it is sent; fault tests corrupt it here."""

    # --- lifecycle -------------------------------------------------------------------------------
    def prepare(self) -> dict[str, Any]:
        return self.transport.prepare()

    @property
    def is_sender(self) -> bool:
        return self.transport.is_sender

    @property
    def num_senders(self) -> int:
        return self.transport.num_senders

    def init_process_group(self, rendezvous: Rendezvous, rank: int) -> None:
        """Join the weight-sync group (see `Transport.join`); a group that may carry patches loads
        the delta kernels now, not inside the first patch sync's waits (`delta.warm`)."""
        self.transport.join(rendezvous, rank)
        self.rank, self.world_size = rank, rendezvous.world_size
        if self.transport.refuse_delta() is None:
            warm_up(self.device)

    @property
    def group(self) -> Any:
        """The underlying process group (for benchmarks measuring the raw link on the same group)."""
        self._require_group()
        return self.transport.group

    def _require_group(self) -> None:
        if self.transport.group is None:
            raise RuntimeError("call init_process_group() before sending or receiving")
        if self.transport.broken:
            raise RuntimeError("the weight-sync group is broken by an earlier failure; finalize() and rejoin")

    def _state_for(self, manifest: BucketManifest) -> PlanState:
        state = self._state
        if state is None or state.digest != manifest.digest:
            if manifest.num_senders != self.transport.num_senders:
                raise ValueError(f"the manifest plans {manifest.num_senders} senders but this group has {self.transport.num_senders}")
            state = self._state = PlanState(manifest, self.num_buffers, self.num_lanes)
        return state

    def _refuse(self, delta: DeltaRequest | None) -> None:
        why = self.transport.refuse_delta() if delta is not None else None
        if why is not None:
            raise ValueError(why)

    def send_weights(
        self, manifest: BucketManifest, weights: Iterable[tuple[str, torch.Tensor]], *, stable: bool = False, delta: DeltaRequest | None = None
    ) -> SendStats:
        """See CheckpointEngine.send_weights; the sync itself is `Sender.send`."""
        self._refuse(delta)
        self._require_group()
        if not self.is_sender:
            raise RuntimeError(f"send_weights() runs on sender ranks [0, {self.num_senders}), this is rank {self.rank}")
        return self.sender.send(self._state_for(manifest), manifest, weights, stable=stable, delta=delta)

    def receive_buckets(
        self, manifest: BucketManifest, destinations: Mapping[str, torch.Tensor] | None = None, *, delta: DeltaRequest | None = None
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """See CheckpointEngine.receive_buckets; the sync itself is `Receiver.receive`."""
        self._refuse(delta)
        self._require_group()
        if self.is_sender:
            raise RuntimeError(f"receive_buckets() runs on receiver ranks, not on a sender (rank {self.rank})")
        yield from self.receiver.receive(self._state_for(manifest), manifest, destinations, delta)

    def receive_staged(self, manifest: BucketManifest, destinations: Mapping[str, torch.Tensor] | None, *, delta: DeltaRequest) -> StagedVersion:
        """See CheckpointEngine.receive_staged; the sync itself is `DeltaReceiver.receive_staged`."""
        self._refuse(delta)
        self._require_group()
        if self.is_sender:
            raise RuntimeError(f"receive_staged() runs on receiver ranks, not on a sender (rank {self.rank})")
        return self.receiver.receive_staged(self._state_for(manifest), manifest, destinations, delta)

    def restamp_bases(self, manifest: BucketManifest, destinations: Mapping[str, torch.Tensor]) -> None:
        state = self._state
        if state is not None and state.digest == manifest.digest and state.bases.inplace and state.bases.stamps:
            state.bases.stamps = {n: (t.data_ptr(), t._version) for n, t in destinations.items() if n in state.bases.stamps}

    @property
    def delta_base_bytes(self) -> int:
        """Memory the base images take on this rank."""
        return self._state.bases.nbytes if self._state is not None else 0

    @property
    def last_delta_stats(self) -> dict[str, float]:
        return self.sender.last_delta_stats if self.is_sender else self.receiver.last_delta_stats

    @property
    def send_plan_builds(self) -> int:
        """How many send plans this engine has recorded (tests check that a plan is reused, and rebuilt
        when a source's tensors moved)."""
        return self.sender.send_plan_builds

    @property
    def receive_plan_builds(self) -> int:
        """How many receive plans this engine has made (tests check reuse and rebuilds)."""
        return self.receiver.receive_plan_builds

    def finalize(self) -> None:
        self.transport.close()
        self._state = None  # it holds buffer views and the trainer's tensors
        self.sender.drop_stage()

    def abort(self) -> None:
        """Break the group so peers blocked in a collective fail fast instead of timing out."""
        self.transport.abort()
        if self._state is not None:
            self._state.bases.sync_id = None
