"""PipelinedEngine: the CheckpointEngine every built-in backend is, composed of a transport (how
bytes move between slots), a sender and a receiver (what moves, in which order, and its checks).

The registry builds it for a transport's name (`CheckpointEngineRegistry.new("gloo", ...)` is this
engine over `GlooTransport`). Per plan, everything a rank keeps lives in one `PlanState`, made for a manifest digest and dropped
whole when a sync brings another plan or the group is left.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from ckpt_engine.delta.request import DeltaRequest
from ckpt_engine.delta.warm import warm_up
from ckpt_engine.engine import CheckpointEngine, Rendezvous, SendStats
from ckpt_engine.fp8.layout import FP8_NAME
from ckpt_engine.manifest import BucketManifest, TensorSpec
from ckpt_engine.pipeline.options import PipelineOptions, split_options
from ckpt_engine.pipeline.plan_state import PlanState
from ckpt_engine.pipeline.receiver import Receiver
from ckpt_engine.pipeline.sender import Sender
from ckpt_engine.planning.buckets import plan_buckets
from ckpt_engine.planning.ownership import OwnerMap
from ckpt_engine.staged import StagedVersion
from ckpt_engine.transports.transport import Transport

__all__ = ["PipelinedEngine"]


class PipelinedEngine(CheckpointEngine):
    """Senders stream their buckets to every receiver through a `transport_cls` transport."""

    def __init__(
        self, transport_cls: type[Transport], *, bucket_size_bytes: int, num_buffers: int = 2, timeout_s: float = 300.0,
        verify: bool = False, **engine_kwargs: Any,
    ) -> None:
        """`engine_kwargs`: `EngineOptions` and the transport's own typed options
        (`transport_cls.Options`), by name; see `pipeline.options.split_options`."""
        super().__init__(bucket_size_bytes=bucket_size_bytes, num_buffers=num_buffers, timeout_s=timeout_s, verify=verify)
        opts, transport_opts = split_options(transport_cls, engine_kwargs)
        self.name, self.device_type = transport_cls.name, transport_cls.device_type
        self.supports_many_senders, self.max_ranks = transport_cls.supports_many_senders, transport_cls.max_ranks
        self.transport = transport_cls(transport_opts, bucket_size_bytes=bucket_size_bytes, num_buffers=num_buffers, timeout_s=timeout_s)
        self.device: torch.device = self.transport.device
        self.solo_bytes = (opts.solo_bytes if opts.solo_bytes is not None else self.transport.default_solo_bytes) or None
        self._solo_set = opts.solo_bytes is not None
        self.group_max_tensors = opts.group_max_tensors if opts.group_max_tensors is not None else self.transport.default_group_max_tensors
        self.delta_scatter_below = float(opts.delta_scatter_below)
        self.options = options = PipelineOptions(bucket_size_bytes, num_buffers, timeout_s, verify, self.group_max_tensors)
        self.sender = Sender(self.transport, options, self, scatter_below=self.delta_scatter_below)
        self.receiver = Receiver(self.transport, options)
        self._state: PlanState | None = None

    # --- fault hooks (declared: fault tests override them) ---------------------------------------
    def plan(self, specs: Sequence[TensorSpec], *, num_senders: int = 1, owners: OwnerMap | None = None) -> BucketManifest:
        """As the base plans; a plan of the FP8 wire (codes among its tensors) with `solo_bytes`
        left unset also puts each tensor of at least half a bucket in a bucket of its own. Those
        travel as they are (a bf16 embedding, the head): over a transport that posts messages, the
        first bucket then moves from the tensor's own memory at once while the next one quantizes,
        instead of waiting for a fill (2xH200, Qwen2.5-7B: 0.598 x the bf16 sync against 0.620 x;
        bench/RESULTS.md). Decided from the options and specs alone, so every rank plans alike."""
        if self._solo_set or self.solo_bytes is not None or not any(s.dtype == FP8_NAME for s in specs):
            return super().plan(specs, num_senders=num_senders, owners=owners)
        return plan_buckets(specs, self.bucket_size_bytes, solo_bytes=self.bucket_size_bytes // 2, num_senders=num_senders, owners=owners)

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
    def maps_sender_memory(self) -> bool:
        return self.transport.source_sharing is not None

    @property
    def num_senders(self) -> int:
        return self.transport.num_senders

    def init_process_group(self, rendezvous: Rendezvous, rank: int) -> None:
        """Join the weight-sync group (see `Transport.join`); a group that may carry patches loads
        the delta kernels now, not inside the first patch sync's waits (`delta.warm`)."""
        self.transport.join(rendezvous, rank)
        self.rank, self.world_size = rank, rendezvous.world_size
        if self.supports_delta:
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
            state = self._state = PlanState(manifest, self.num_buffers)
        return state

    @property
    def supports_delta(self) -> bool:
        """Whether the transport, as joined, carries delta frames."""
        return self.transport.frames is not None

    def _ready(self, delta: DeltaRequest | None, call: str, sender: bool) -> None:
        """Refuse `call` before anything moves: a delta request the transport cannot carry, no
        (or a broken) group, or the wrong side (senders send, receivers receive)."""
        if delta is not None and not self.supports_delta:
            raise ValueError(f"the {self.name} backend does not do delta syncs as joined (use delta=off)")
        self._require_group()
        if sender and not self.is_sender:
            raise RuntimeError(f"{call}() runs on sender ranks [0, {self.num_senders}), this is rank {self.rank}")
        if not sender and self.is_sender:
            raise RuntimeError(f"{call}() runs on receiver ranks, not on a sender (rank {self.rank})")

    def send_weights(
        self, manifest: BucketManifest, weights: Iterable[tuple[str, torch.Tensor]], *, stable: bool = False, delta: DeltaRequest | None = None
    ) -> SendStats:
        """See CheckpointEngine.send_weights; the sync itself is `Sender.send`."""
        self._ready(delta, "send_weights", sender=True)
        return self.sender.send(self._state_for(manifest), manifest, weights, stable=stable, delta=delta)

    def receive_buckets(
        self, manifest: BucketManifest, destinations: Mapping[str, torch.Tensor] | None = None, *, delta: DeltaRequest | None = None,
        repeatable: bool = False,
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """See CheckpointEngine.receive_buckets; the sync itself is `Receiver.receive`."""
        self._ready(delta, "receive_buckets", sender=False)
        yield from self.receiver.receive(self._state_for(manifest), manifest, destinations, delta, repeatable)

    def receive_staged(self, manifest: BucketManifest, destinations: Mapping[str, torch.Tensor] | None, *, delta: DeltaRequest) -> StagedVersion:
        """See CheckpointEngine.receive_staged; the sync itself is `DeltaReceiver.receive_staged`."""
        self._ready(delta, "receive_staged", sender=False)
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
        return (self.sender.delta if self.is_sender else self.receiver.delta).last_stats

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

    def abort(self) -> None:
        """Break the group so peers blocked in a collective fail fast instead of timing out."""
        self.transport.abort()
        if self._state is not None:
            self._state.bases.sync_id = None
