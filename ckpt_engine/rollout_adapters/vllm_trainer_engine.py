"""ckpt-engine behind vLLM's trainer-side API: `TrainerWeightTransferEngine` for `backend="ckpt_engine"`.

A trainer written against vLLM's weight-transfer API switches to ckpt-engine by its init info:

    info = CkptEngineTrainerInitInfo(rank=rank, num_workers=1, config=CheckpointEngineConfig(backend="gloo"))
    engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=ModuleSource(model))
    engine.send_weights()            # every trainer rank, after each optimizer step

The sender (rank 0) hosts the rendezvous, drives the engine through `client` (vLLM's own routes or
`LLM` methods) and streams the pipelined buckets; other ranks only walk the source, whose gathers
are collectives. Importing this module registers the backend with vLLM's factories.
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import datetime
import logging
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
)

from ckpt_engine.planning.buckets import auto_bucket_size_bytes
from ckpt_engine.config import CheckpointEngineConfig
from ckpt_engine.transports.base import CheckpointEngine, Rendezvous
from ckpt_engine.manifest import BucketManifest, encode_manifest
from ckpt_engine.transports.registry import CheckpointEngineRegistry
from ckpt_engine.rollout_adapters.base import JoinOptions, ManifestRejectedError
from ckpt_engine.rollout_adapters.vllm_clients import EngineControl
from ckpt_engine.rollout_adapters.vllm_plugin import BACKEND_NAME, register
from ckpt_engine.rollout_adapters.vllm_transfer_engine import NEED_MANIFEST
from ckpt_engine.sync.report import SOURCE, SyncError, SyncReport
from ckpt_engine.sources.vllm import VllmWeightSourceAdapter

__all__ = ["CkptEngineTrainerInitInfo", "CkptEngineTrainerWeightTransferEngine"]

logger = logging.getLogger(__name__)

_REJECTED = "ckpt_engine rejected the manifest: "


@dataclass
class CkptEngineTrainerInitInfo(TrainerInitInfo):
    """Trainer-side settings; the ones the workers must share travel to them at `trainer_init`."""

    backend: ClassVar[str] = BACKEND_NAME

    num_workers: int = 1
    """vLLM worker ranks that receive (tensor x pipeline x data parallel size)."""
    host: str = "127.0.0.1"
    """Address of this trainer that the workers reach to join the weight-sync group."""
    config: CheckpointEngineConfig = field(default_factory=CheckpointEngineConfig)
    """Transport, bucket size, buffers, timeout, verify and pause mode, as for `sync_rollout_weights`."""
    engine_name: str = "vllm"
    """How errors name the engine."""
    stable_tensors: bool = False
    """The source's tensors stay valid and unchanged until `send_weights` returns (e.g. a plain,
    unsharded module's parameters), so the transport may send from them without copying."""

    def __post_init__(self) -> None:
        if not isinstance(self.num_workers, int) or isinstance(self.num_workers, bool) or self.num_workers < 1:
            raise ValueError(f"num_workers must be an int >= 1, got {self.num_workers!r}")
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"host must be a non-empty address, got {self.host!r}")
        if not isinstance(self.config, CheckpointEngineConfig):
            raise ValueError(f"config must be a CheckpointEngineConfig, got {type(self.config).__name__}")


class CkptEngineTrainerWeightTransferEngine(TrainerWeightTransferEngine[CkptEngineTrainerInitInfo]):
    """Trainer side of the `ckpt_engine` backend; `send_weights` is one full sync.

    Order on the sender: validate the manifest (rejected -> ManifestRejectedError, nothing moved,
    engine still serving) -> pause -> stream while the workers load -> finish (layerwise
    post-processing, version stamped) -> prefix-cache reset -> resume. Pause and reset happen when
    `client` is an `EngineControl` (both clients in `vllm_clients.py` are); with a bare vLLM client
    the caller pauses around `send_weights` itself. A failed transfer leaves the engine paused and
    the group is rebuilt on the next call.
    """

    init_info_cls = CkptEngineTrainerInitInfo

    def __init__(
        self,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
        is_sender: bool = True,
        init_info: CkptEngineTrainerInitInfo | None = None,
    ) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.info = init_info if init_info is not None else CkptEngineTrainerInitInfo(rank=0 if is_sender else 1)
        self.config = self.info.config
        self._engine: CheckpointEngine | None = None
        self._store: Any = None
        self._plan_key: tuple[Any, ...] | None = None
        self._manifest: BucketManifest | None = None
        self._encoded = b""
        self._worker_digest: str | None = None
        self.version = 0
        self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-vllm-rpc")

    @classmethod
    def trainer_init(
        cls,
        init_info: CkptEngineTrainerInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> Self:
        """Every trainer rank calls this; the sender joins the workers into its weight-sync group."""
        if source is None:
            raise ValueError("the ckpt_engine trainer engine needs a WeightSource to send from")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, init_info=init_info)
        if engine.is_sender:
            engine._connect()
        return engine

    # --- group ---------------------------------------------------------------------------------
    def _connect(self) -> None:
        """Host the rendezvous, have every worker join (`init_weight_transfer_engine`), join as rank 0."""
        cfg = self.config
        backend = CheckpointEngineRegistry.resolve_name(cfg.backend)
        bucket = cfg.bucket_size_bytes
        if bucket is None:
            bucket = auto_bucket_size_bytes("cuda" if backend == "nccl" else "cpu", cfg.num_buffers)
        engine = CheckpointEngineRegistry.new(
            backend, bucket_size_bytes=bucket, num_buffers=cfg.num_buffers, timeout_s=cfg.timeout_s,
            verify=cfg.verify, **cfg.kwargs_for(backend),
        )
        if self._store is None:
            self._store = torch.distributed.TCPStore(
                self.info.host, 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=cfg.timeout_s)
            )
        rdzv = Rendezvous(self.info.host, self._store.port, uuid.uuid4().hex, 1 + self.info.num_workers, backend, cfg.timeout_s)
        options = JoinOptions(engine.bucket_size_bytes, engine.num_buffers, engine.verify, cfg.kwargs_for(backend))
        init = {"rendezvous": rdzv.to_dict(), "rank_offset": 1, "options": options.to_dict()}
        joined = self._pool.submit(self.client.init_weight_transfer_engine, init)
        try:
            engine.init_process_group(rdzv, 0)
            joined.result(timeout=cfg.timeout_s)
        except Exception as exc:
            engine.finalize()
            raise _sync_error("join", self.info.engine_name, exc, joined, []) from exc
        self._engine, self._worker_digest = engine, None
        logger.info("ckpt_engine: weight-sync group %s ready with %d vLLM workers", rdzv.token[:8], self.info.num_workers)

    def _plan(self, source: VllmWeightSourceAdapter, engine: CheckpointEngine) -> BucketManifest:
        specs = tuple(source.metadata())
        key = (engine.bucket_size_bytes, engine.solo_bytes, specs)
        if key != self._plan_key or self._manifest is None:
            self._manifest = engine.plan(list(specs))
            self._encoded = encode_manifest(self._manifest)
            self._plan_key = key
        return self._manifest

    # --- one sync --------------------------------------------------------------------------------
    def send_weights(self, version: int | None = None) -> SyncReport | None:
        """One sync on every trainer rank; the sender returns its SyncReport, the others None.

        The source is walked exactly once on every rank whatever happens, so ranks whose gathers
        are collectives stay in step even when the sync fails.
        """
        if self.source is None:
            raise RuntimeError("no WeightSource: build the engine with trainer_init(..., source=...)")
        source = VllmWeightSourceAdapter(self.source, is_sender=self.is_sender, stable_tensors=self.info.stable_tensors)
        weights = iter(source.iter_weights())
        try:
            if not self.is_sender:
                return None
            return self._send(source, weights, version if version is not None else self.version + 1)
        finally:
            for _ in weights:
                pass

    def _send(self, source: VllmWeightSourceAdapter, weights: Iterator[tuple[str, torch.Tensor]], version: int) -> SyncReport:
        t0 = time.perf_counter()
        seconds: dict[str, float] = {}
        if self._engine is None:
            self._connect()
        engine = self._engine
        assert engine is not None
        manifest = self._plan(source, engine)
        seconds["plan"] = time.perf_counter() - t0

        t = time.perf_counter()
        self._validate(manifest)
        seconds["validate"] = time.perf_counter() - t

        control = self.client if isinstance(self.client, EngineControl) else None
        pause = self.config.pause_mode
        t = time.perf_counter()
        if control is not None and pause != "none":
            control.pause(pause)
        seconds["pause"] = time.perf_counter() - t

        t = time.perf_counter()
        update = {"phase": "receive", "digest": manifest.digest, "version": str(version)}
        source_failed: list[BaseException] = []
        received = self._pool.submit(self.client.update_weights, update)
        try:
            stats = engine.send_weights(manifest, _tagged(weights, source_failed), stable=source.stable_tensors)
            received.result(timeout=self.config.timeout_s)
        except Exception as exc:
            engine.finalize()  # closing the sender's group wakes workers blocked on it
            self._engine = None
            if source_failed:  # the trainer's own source raised; the engine is only left stale
                raise SyncError("transfer", {SOURCE: f"{type(exc).__name__}: {exc}"}, [self.info.engine_name]) from exc
            raise _sync_error("transfer", self.info.engine_name, exc, received, [self.info.engine_name]) from exc
        seconds["transfer"] = time.perf_counter() - t
        seconds.update(export=stats.export_s, pack=stats.pack_s, send=stats.total_s)

        t = time.perf_counter()
        self.client.finish_weight_update(str(version))
        if control is not None:
            control.reset_prefix_cache()
        seconds["finalize"] = time.perf_counter() - t
        t = time.perf_counter()
        if control is not None and pause != "none":
            control.resume()
        seconds["resume"] = time.perf_counter() - t
        self.version = version
        seconds["total"] = time.perf_counter() - t0
        return SyncReport(
            version=version, bytes=manifest.total_bytes, tensors=manifest.num_tensors, buckets=manifest.num_buckets,
            engines=1, seconds=seconds,
            gbps=manifest.total_bytes / seconds["transfer"] / 1e9 if seconds["transfer"] > 0 else 0.0,
        )

    def _validate(self, manifest: BucketManifest) -> None:
        """Open an update and have every worker check the manifest; a reject raises with its problems.

        The manifest travels only when the workers may not hold it yet (first sync, new plan, or a
        worker that answers `need_manifest`)."""
        encoded = base64.b64encode(self._encoded).decode("ascii")
        send = None if self._worker_digest == manifest.digest else encoded
        for attempt in range(2):
            self.client.start_weight_update()
            try:
                self.client.update_weights({"phase": "validate", "digest": manifest.digest, "manifest": send})
            except Exception as exc:  # vLLM closes the update when update_weights raises
                text = str(exc)
                if attempt == 0 and send is None and NEED_MANIFEST in text:
                    send = encoded
                    continue
                self._worker_digest = None
                if _REJECTED in text:
                    raise ManifestRejectedError(self.info.engine_name, _problems(text)) from exc
                raise SyncError("validate", {self.info.engine_name: text}, []) from exc
            self._worker_digest = manifest.digest
            return

    def shutdown(self) -> None:
        """Leave the weight-sync group on the workers and here."""
        if self.is_sender and self._engine is not None:
            shutdown = getattr(self.client, "shutdown_weight_transfer_engine", None)
            try:
                if callable(shutdown):
                    shutdown()
            except Exception as exc:
                logger.warning("ckpt_engine: workers did not leave the group cleanly: %s", exc)
        if self._engine is not None:
            self._engine.finalize()
            self._engine = None
        self._store = None
        self._pool.shutdown(wait=False, cancel_futures=True)


def _tagged(weights: Iterator[tuple[str, torch.Tensor]], failed: list[BaseException]) -> Iterator[tuple[str, torch.Tensor]]:
    """The source's pairs; an exception the source raises is recorded in `failed` on its way out."""
    try:
        yield from weights
    except BaseException as exc:
        failed.append(exc)
        raise


def _sync_error(stage: str, engine: str, exc: BaseException, rpc: cf.Future[Any], stale: list[str]) -> SyncError:
    """Name the engine's own error when its RPC already failed, and keep what the sender saw."""
    sender = f"{type(exc).__name__}: {exc}"
    worker = rpc.exception() if rpc.done() and not rpc.cancelled() else None
    if worker is None:
        return SyncError(stage, {engine: sender}, stale)
    return SyncError(stage, {engine: f"{type(worker).__name__}: {worker}"}, stale, sender_error=sender)


def _problems(text: str) -> list[str]:
    """The worker's problem list out of an error that crossed vLLM's RPC (and maybe HTTP)."""
    tail = text[text.index(_REJECTED) + len(_REJECTED) :]
    for end in ('"', "'", "\n", "\\n"):
        tail = tail.split(end, 1)[0]
    return [p.strip() for p in tail.split("; ") if p.strip()]


register()
