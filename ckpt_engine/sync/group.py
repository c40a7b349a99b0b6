"""The sender's end of a session's weight-sync group: the rendezvous store, the transport engine
with its buffers, the join of every engine, and the plan it sends. Kept across syncs; rebuilt only
when the number of senders changes or a failure dropped it. Also which transport a session streams
over (`backend_for`) and whether its group can move patches (`delta_unsupported`)."""

from __future__ import annotations

import concurrent.futures as cf
import logging
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ckpt_engine.config import CheckpointEngineConfig
from ckpt_engine.fp8.warm import warm_up as warm_fp8
from ckpt_engine.manifest import BucketManifest, TensorSpec, encode_manifest
from ckpt_engine.planning.buckets import auto_bucket_size_bytes
from ckpt_engine.planning.ownership import OwnerMap, owner_key
from ckpt_engine.rollout_adapters.base import JoinOptions, RolloutAdapter
from ckpt_engine.rollout_adapters.capabilities import lacking
from ckpt_engine.sync.fanout import wait_for_joins
from ckpt_engine.engine import CheckpointEngine, Rendezvous
from ckpt_engine.registry import CheckpointEngineRegistry
from ckpt_engine.store import serve_store

__all__ = ["SyncGroup", "backend_for", "delta_unsupported"]

logger = logging.getLogger(__name__)

_SETTLE_S = 2.0
"""After a failed join, how long members on their way to the rendezvous get to reach it."""


def backend_for(config: CheckpointEngineConfig, rollouts: Sequence[RolloutAdapter]) -> str:
    """`checkpoint_engine.backend` (`auto` resolved by device), unless the engines declare the one
    wire they read (`capabilities.transport`, e.g. SGLang's): then that one, refused by name
    when the config names another or the engines disagree."""
    wires = {r.capabilities.transport for r in rollouts}
    if wires == {None}:
        return CheckpointEngineRegistry.resolve_name(config.backend)
    if len(wires) > 1:
        kinds = ", ".join(f"{r.name}: {r.capabilities.transport or 'any'}" for r in rollouts)
        raise ValueError(f"these engines read different wires ({kinds}); sync each kind through a session of its own")
    wire = next(iter(wires))
    assert wire is not None
    if config.backend not in ("auto", wire):
        raise ValueError(
            f"engine(s) {', '.join(r.name for r in rollouts)} read only the {wire!r} wire, not "
            f"checkpoint_engine.backend={config.backend!r}; leave backend at 'auto' (or set {wire!r})"
        )
    return wire


def delta_unsupported(engine: CheckpointEngine, backend: str, rollouts: Sequence[RolloutAdapter]) -> str | None:
    """Why this group cannot take patch syncs (the backend or engines by name), or None."""
    if not engine.supports_delta:
        return f"the {backend} backend does not send patches"
    missing = lacking(rollouts, "delta")
    return f"engine(s) {', '.join(missing)} do not take patches" if missing else None


class SyncGroup:
    """Hosts the rendezvous store (free port from the OS, a fresh token per group) and holds the
    sender's engine. `engine`: one the caller made (kept until the group is dropped)."""

    def __init__(
        self, config: CheckpointEngineConfig, backend: str, host: str, device: str | torch.device | None, engine: CheckpointEngine | None
    ) -> None:
        self.config, self.backend, self.host, self.device = config, backend, host, device
        self.engine = engine
        self.ready = False
        self.token: str | None = None
        """The joined group's rendezvous token (what each engine rank reports it joined)."""
        self.num_senders = 1
        self._store: Any = None
        self._plan_key: tuple[Any, ...] | None = None
        self.manifest: BucketManifest | None = None
        self.encoded = b""

    def take_device(self, source_device: torch.device | str | int | None) -> None:
        """Fix the sender's device from the weight source's (`WeightSource.device`) when neither
        the session nor `engine_kwargs.<backend>.device` names one; refuse, before anything is
        paused, a named device or a joined group on another accelerator than the source's tensors.
        Host tensors (or a source that cannot tell) change nothing: the transport's default."""
        if source_device is None:
            return
        source_device = torch.device(source_device)  # a source may hold a name ("cuda:1") or an index
        if source_device.type == "cpu" or source_device.index is None:
            return
        kind = CheckpointEngineRegistry.get(self.backend).device_type
        if kind is not None and kind != source_device.type:
            return  # gloo reads device tensors through the host
        key = f"checkpoint_engine.engine_kwargs.{self.backend}.device"
        named = self.device if self.device is not None else self.config.kwargs_for(self.backend).get("device")
        if named is not None:
            want = torch.device(named) if not isinstance(named, int) else torch.device(source_device.type, named)
            if want.type == source_device.type and want.index is not None and want != source_device:
                raise ValueError(
                    f"the weight source's tensors are on {source_device} but the {self.backend} sender is set to {want} "
                    f"({key} or the session's device): set it to {source_device} or leave it unset"
                )
        elif self.engine is not None and self.engine.device != source_device:
            raise ValueError(
                f"the weight source's tensors are on {source_device} but this session's {self.backend} group was joined "
                f"from {self.engine.device}; use one session per trainer device (or set {key})"
            )
        else:
            self.device = source_device

    def new_engine(self, bucket_size: int) -> CheckpointEngine:
        # A bucket the buffers cannot fit is refused here, before any engine is asked to join.
        self.config.check_memory(str(self.device) if self.device is not None else None)
        kwargs = self.config.kwargs_for(self.backend)
        if self.device is not None:
            kwargs.setdefault("device", self.device)
        return CheckpointEngineRegistry.new(
            self.backend, bucket_size_bytes=bucket_size, num_buffers=self.config.num_buffers,
            timeout_s=self.config.timeout_s, verify=self.config.verify, **kwargs,
        )

    def _bucket_size(self) -> int:
        if self.config.bucket_size_bytes is not None:
            return self.config.bucket_size_bytes
        device = str(self.device) if self.device is not None else ("cuda" if self.backend == "nccl" else "cpu")
        return auto_bucket_size_bytes(device, self.config.num_buffers)

    def current(self, num_senders: int) -> CheckpointEngine | None:
        """The joined group's engine if it serves `num_senders` senders, else None (and a group
        for another count is dropped)."""
        if num_senders != self.num_senders:
            self.drop()
        return self.engine if self.ready and self.engine is not None else None

    def build(
        self, num_senders: int, rollouts: Sequence[RolloutAdapter], pool: cf.ThreadPoolExecutor,
        announce: Callable[[Rendezvous, dict[str, Any]], None] | None = None,
    ) -> tuple[CheckpointEngine, Rendezvous, dict[str, str]]:
        """Join the sender and every engine into a new group (`announce`: tells the other trainer
        ranks first). Returns the engine, the rendezvous and {engine: why} for engines that failed
        to join (then the group is dropped)."""
        self.num_senders = num_senders
        if self.engine is None:
            self.engine = self.new_engine(self._bucket_size())
        engine = self.engine
        topo = engine.build_topology(num_senders, [r.world_size for r in rollouts])
        if self._store is None:
            self._store = serve_store(self.host, self.config.timeout_s)
        rdzv = Rendezvous(
            self.host, self._store.port, uuid.uuid4().hex, topo.world_size, self.backend, self.config.timeout_s, num_senders
        )
        options = JoinOptions(engine.bucket_size_bytes, engine.num_buffers, engine.verify, self.config.kwargs_for(self.backend))
        if announce is not None:
            announce(rdzv, options.to_dict())
        futures = {r.name: pool.submit(r.join, rdzv, off, options) for r, off in zip(rollouts, topo.receiver_offsets)}
        # The sender joins in a thread of its own while the engines' joins are watched: the first
        # engine that fails to join ends the set-up at once instead of after `timeout_s`.
        sender = pool.submit(self._join_sender, engine, rdzv)
        failed = wait_for_joins(sender, futures, self.config.timeout_s)
        if failed:
            # Closing the store wakes every member waiting in the rendezvous (the sender's thread,
            # the engines that did join) instead of leaving them there for timeout_s. A member
            # still connecting would retry until timeout_s instead, so the store stays a moment.
            cf.wait([*futures.values(), sender], timeout=min(_SETTLE_S, self.config.timeout_s))
            self._store = None
            sender.add_done_callback(lambda _: engine.finalize())
            self.engine = None
            return engine, rdzv, failed
        self.ready, self.token = True, rdzv.token
        logger.info("weight-sync group %s ready: %d ranks over %s", rdzv.token[:8], topo.world_size, self.backend)
        return engine, rdzv, failed

    def _join_sender(self, engine: CheckpointEngine, rdzv: Rendezvous) -> None:
        """The sender's join; with an FP8 wire it also compiles the quantize kernels on the sender's
        device (`fp8/warm.py`) while the engines join, so no sync pays the compile."""
        engine.init_process_group(rdzv, 0)
        if self.config.wire_dtype == "fp8" and engine.device is not None:
            warm_fp8(engine.device)

    def plan(self, specs: list[TensorSpec], engine: CheckpointEngine, owners: OwnerMap | None) -> BucketManifest:
        """The manifest for `specs` (and the many senders' `owners`), made again only when its inputs
        change: a pure function of them, cached across syncs and group rebuilds."""
        key = (engine.bucket_size_bytes, engine.solo_bytes, tuple(specs), self.num_senders, owner_key(owners))
        if key != self._plan_key or self.manifest is None:
            self.manifest = engine.plan(specs, num_senders=self.num_senders, owners=owners)
            self.encoded = encode_manifest(self.manifest)
            self._plan_key = key
        return self.manifest

    def drop(self) -> None:
        """Mark the group for rebuild and free the sender's engine (its buffers and group)."""
        self.ready, self.token = False, None
        if self.engine is not None:
            self.engine.finalize()
            self.engine = None

    def close(self) -> None:
        self.drop()
        self._store = None
