"""The engine-side half of a rollout adapter: join, validate, receive and load.

Runs inside the engine's worker process (the reference receiver, vLLM's worker extension). It owns
the receiving CheckpointEngine, caches decoded manifests by digest and drives a loader with each
bucket's tensors as they land. Staged (issue 28): `receive(stage=...)` keeps the checked version
(`pipeline/staging.py`) without touching the live weights, `swap()` makes it live (the engine calls
it between two of its steps) and `discard()` drops it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from ckpt_engine.delta.request import DeltaRequest
from ckpt_engine.pipeline.staging import StagedBuckets, StagedCopy, StagingCopy
from ckpt_engine.staged import StagedVersion
from ckpt_engine.engine import CheckpointEngine, Rendezvous
from ckpt_engine.manifest import BucketManifest, ManifestBudget, ManifestError, TensorSpec, decode_manifest
from ckpt_engine.planning.regions import ReceivePlan
from ckpt_engine.registry import CheckpointEngineRegistry
from ckpt_engine.rollout_adapters.base import STAGES, JoinOptions, ReceiveReport, check_manifest_against
from ckpt_engine.rollout_adapters.region_receiver import RegionLoader, RegionReceiver

__all__ = ["BucketLoader", "ReceiverBusyError", "RegionLoader", "WeightReceiver"]

logger = logging.getLogger(__name__)

BucketLoader = Callable[[list[tuple[str, torch.Tensor]]], int]
"""Loads one bucket's (name, tensor) pairs; returns how many tensors it loaded."""


class ReceiverBusyError(RuntimeError):
    """A second controller asked for a join, validate or receive while one is in flight here."""


class WeightReceiver:
    """One receiving rank: `join` once, then `validate` and `receive` per sync.

    One operation at a time: while a join, validate or receive is in flight, another is refused
    (ReceiverBusyError) instead of queued, because a second sync's join would tear the group out
    from under the running receive and its buckets would interleave with the first sync's.
    """

    def __init__(self, device: str | torch.device | None = None, plan: ReceivePlan | None = None) -> None:
        self.device = device
        self.engine: CheckpointEngine | None = None
        self.group: str | None = None
        """The token of the weight-sync group this receiver joined (None: none); a controller that
        finds another one here knows the engine restarted or joined elsewhere, and rejoins it."""
        self.regions = RegionReceiver(plan)
        """Region delivery: this rank's plan, its accepted assignments and its receiver-set groups."""
        self._manifests: dict[str, BucketManifest] = {}
        self.senders = 1
        """The senders of the group joined last: what a manifest's decode budget allows (never its own claim)."""
        self.buckets_received = 0
        """Every bucket this receiver took, dense or patch, staged or not (health shows it)."""
        self.staging = StagingCopy()
        """The staging copy, for `stage="full"`, of the live tensors a sync carries, kept across syncs."""
        self._staged: tuple[StagedVersion, BucketLoader | RegionLoader, str] | None = None
        """The version received staged and not yet swapped in: (it, the loader its apply feeds, digest)."""
        self._discards = 0
        """Bumped by every `discard()`: a staged receive still in flight then keeps nothing."""
        self._keeping = threading.Lock()
        """Orders a receive keeping its staged version against a `discard()` from another thread."""
        self._busy = threading.Lock()
        self._live: Mapping[str, torch.Tensor] = {}
        self._staging_digest = ""
        """The manifest the staging copy was last cut for (`staging_for`)."""
        self._doing = ""
        self._since = 0.0
        self._checked: tuple[str, Any, Any, int | None] | None = None
        """The last accepted check made with `remember`: (digest, expected, extra_check, buffer size);
        the same check of the same manifest again (every sync of an unchanged model and session) is
        not run again."""

    def set_plan(self, plan: ReceivePlan | None) -> None:
        """State what this rank holds (e.g. recorded from the engine's loader after the model loaded);
        an assignment accepted under an earlier plan is dropped (the next validate brings a new one)."""
        self.regions.plan = plan
        self.regions.left_plan()

    @property
    def busy(self) -> bool:
        return self._busy.locked()

    @contextlib.contextmanager
    def exclusive(self, what: str) -> Iterator[None]:
        """Hold this receiver for `what` (a join, validate, receive, swap, or a pull from a peer):
        `what` is refused (ReceiverBusyError) while another of them is in flight."""
        if not self._busy.acquire(blocking=False):
            raise ReceiverBusyError(
                f"this receiver is busy with {self._doing} (for {time.monotonic() - self._since:.1f}s); "
                f"{what} refused: another sync is in flight on this engine"
            )
        self._doing, self._since = what, time.monotonic()
        try:
            yield
        finally:
            self._doing = ""
            self._busy.release()

    def join(self, rendezvous: dict[str, Any] | Rendezvous, rank: int, options: dict[str, Any] | JoinOptions) -> None:
        rdzv = rendezvous if isinstance(rendezvous, Rendezvous) else Rendezvous.from_dict(rendezvous)
        opts = options if isinstance(options, JoinOptions) else JoinOptions.from_dict(options)
        if not isinstance(rank, int) or not 0 < rank < rdzv.world_size:
            raise ValueError(f"receiver rank must be in [1, {rdzv.world_size}), got {rank!r}")
        with self.exclusive(f"a join of group {rdzv.token[:8]}"):
            self._join(rdzv, rank, opts)

    def _join(self, rdzv: Rendezvous, rank: int, opts: JoinOptions) -> None:
        self.leave()
        kwargs = dict(opts.engine_kwargs)
        if self.device is not None:
            kwargs.setdefault("device", self.device)

        def make() -> CheckpointEngine:
            return CheckpointEngineRegistry.new(
                rdzv.backend, bucket_size_bytes=opts.bucket_size_bytes, num_buffers=opts.num_buffers, timeout_s=rdzv.timeout_s,
                verify=opts.verify, **kwargs,
            )

        engine = make()
        engine.init_process_group(rdzv, rank)
        self.engine, self.senders = engine, rdzv.num_senders
        self.group = rdzv.token
        self.regions.joined(rdzv, rank, make)

    def leave(self) -> None:
        self.discard()
        self.regions.left()
        engine, self.engine = self.engine, None
        self.group = None
        if engine is not None:
            engine.finalize()

    def validate(
        self,
        encoded: bytes | None,
        digest: str,
        expected: Mapping[str, TensorSpec] | None,
        extra_check: Callable[[BucketManifest], list[str]] | None = None,
        regions: bytes | None = None,
        budget_specs: Iterable[TensorSpec] | None = None,
        remember: bool = False,
    ) -> dict[str, Any]:
        """Decode (or recall by digest) a manifest and check it against the engine's tensors.

        `extra_check` adds engine-specific rules (e.g. vLLM's stacked parameters must be sent
        whole); a manifest is accepted only when neither finds a problem. `regions`: this rank's
        region assignment for the manifest (region delivery), checked against `expected` too.
        `budget_specs`: without `expected`, the most a manifest may carry (its decode budget).
        `remember`: the checks answer only from the manifest and from `expected` and `extra_check`
        themselves (no state of the engine's that changes), so the manifest accepted last under
        the very same checks and buffers is accepted again without walking its tensors.
        """
        with self.exclusive(f"a validate of manifest {str(digest)[:12]}"):
            reply = self._validate(encoded, digest, expected, extra_check, budget_specs, remember)
            if reply["accepted"] and regions is not None:
                problems = self.regions.accept(regions, self._manifests[digest], expected)
                if problems:
                    self._manifests.pop(digest, None)
                reply = {"accepted": not problems, "need_manifest": False, "problems": problems}
            return reply

    def _validate(
        self,
        encoded: bytes | None,
        digest: str,
        expected: Mapping[str, TensorSpec] | None,
        extra_check: Callable[[BucketManifest], list[str]] | None,
        budget_specs: Iterable[TensorSpec] | None = None,
        remember: bool = False,
    ) -> dict[str, Any]:
        manifest = self._manifests.get(digest)
        buffers = self.engine.bucket_size_bytes if self.engine is not None else None
        checked = self._checked
        if (
            remember and manifest is not None and checked is not None and checked[0] == digest and checked[1] is expected
            and checked[2] == extra_check and checked[3] == buffers
        ):  # per sync this walked every tensor of the manifest (18,867 for Qwen3-30B-A3B) for the same answer
            return {"accepted": True, "need_manifest": False, "problems": []}
        if manifest is None:
            if encoded is None:
                return {"accepted": False, "need_manifest": True, "problems": []}
            try:
                most = expected.values() if expected is not None else budget_specs
                manifest = decode_manifest(encoded, ManifestBudget.expecting(most, senders=self.senders) if most is not None else None)
            except ManifestError as exc:
                return {"accepted": False, "need_manifest": False, "problems": [f"corrupt manifest: {exc}"]}
            if manifest.digest != digest:
                return {"accepted": False, "need_manifest": False, "problems": ["manifest digest differs from the announced one"]}
        problems = check_manifest_against(manifest, expected) if expected is not None else []
        if not problems and extra_check is not None:
            problems = extra_check(manifest)
        if self.engine is not None and manifest.bucket_size_bytes > self.engine.bucket_size_bytes:
            problems.append(f"manifest buckets of {manifest.bucket_size_bytes} bytes exceed this receiver's buffers")
        if not problems:
            self._manifests = {digest: manifest}
            self._checked = (digest, expected, extra_check, buffers) if remember else None
        return {"accepted": not problems, "need_manifest": False, "problems": problems}

    def _validated(self, digest: str, on_start: Callable[[], None] | None) -> BucketManifest:
        """The manifest a receive streams into (accepted by validate()); then `on_start`."""
        manifest = self._manifests.get(digest)
        if manifest is None:
            raise RuntimeError(f"manifest {digest[:12]} was not validated on this receiver; call validate() first")
        if on_start is not None:
            on_start()
        return manifest

    def accepted_manifest(self, digest: str) -> BucketManifest | None:
        """The manifest accepted under `digest` by the last validate(), if any."""
        return self._manifests.get(digest)

    def receive(
        self,
        digest: str,
        loader: BucketLoader,
        destinations: Mapping[str, torch.Tensor] | None = None,
        delta: dict[str, Any] | DeltaRequest | None = None,
        on_start: Callable[[], None] | None = None,
        region_loader: RegionLoader | None = None,
        stage: str | None = None,
        repeatable: bool = False,
    ) -> ReceiveReport:
        """Receive every bucket of an accepted manifest and hand each to `loader`.

        `destinations`, when the engine's tensors have the wire layout, lets tensors split over
        several buckets land in place (see CheckpointEngine.receive_buckets). `delta` (as sent by
        the controller): take patches against this receiver's base copy; the loader then runs
        only after every bucket has been checked. `on_start` runs once the receive is admitted (not
        busy, joined, manifest validated), before any byte lands: a refused receive changes nothing.
        `region_loader`: where the manifest was accepted with a region assignment, it takes this
        rank's `(name, region, tensor)` items instead of `loader`'s pairs.

        `stage` (issue 28; None: load as the buckets land): `"patches"` (a patch sync: each patch is
        checked against `destinations`, the live weights, without writing them) or `"full"` (the
        sync lands in a staging copy of the tensors it carries: `destinations` and the loaders are
        then that copy's, from `staging_for(live, digest)`); nothing live is written and the loaders
        run at `swap()`.

        `repeatable`: `loader` lands each tensor whole where a second load of the same name would, so a
        bucket may come again (see CheckpointEngine.receive_buckets); a live receive only."""
        request = delta if isinstance(delta, DeltaRequest) or delta is None else DeltaRequest.from_dict(delta)
        if stage is not None and stage not in STAGES:
            raise ValueError(f"stage must be one of {', '.join(STAGES)} or None, got {stage!r}")
        if stage == "patches" and (request is None or not request.patches):
            raise ValueError("stage='patches' takes a patch sync (a delta request with patches); stage a dense sync as 'full'")
        if stage == "full" and (destinations is None or destinations is not self.staging.tensors or self._staging_digest != digest):
            raise ValueError("stage='full' receives into the staging copy: pass destinations=staging_for(live, digest) and loaders into it")
        with self.exclusive(f"a receive of manifest {str(digest)[:12]}"):
            try:
                if self._staged is not None:
                    raise RuntimeError(
                        f"a staged version of manifest {self._staged[2][:12]} is waiting for swap() or discard(); "
                        "a receive would overwrite what it holds"
                    )
                if stage is not None:
                    return self._receive_staged(digest, loader, destinations, request, on_start, region_loader, stage)
                if region_loader is not None and self.regions.has(digest):
                    if self.engine is None:
                        raise RuntimeError("call join() before receive()")
                    return self._receive_into(digest, loader, destinations, request, on_start, region_loader)
                return self._receive(digest, loader, destinations, request, on_start, repeatable)
            except Exception as exc:
                # Each receiver talks to rank 0 only: the sender went away or gave up (it aborts the
                # group on any failure, its own or another engine's).
                logger.warning("receive of manifest %s from the sender (rank 0) failed: %s", str(digest)[:12], exc)
                raise

    def _receive(
        self,
        digest: str,
        loader: BucketLoader,
        destinations: Mapping[str, torch.Tensor] | None,
        delta: DeltaRequest | None,
        on_start: Callable[[], None] | None = None,
        repeatable: bool = False,
    ) -> ReceiveReport:
        if self.engine is None:
            raise RuntimeError("call join() before receive()")
        manifest = self._validated(digest, on_start)
        t0 = time.perf_counter()
        load_s, loaded = 0.0, 0
        for bucket in self.engine.receive_buckets(manifest, destinations, delta=delta, repeatable=repeatable):
            self.buckets_received += 1  # every bucket taken, dense or patch, a large tensor's middle chunk too
            if not bucket:  # only a middle chunk of a large tensor landed
                continue
            t1 = time.perf_counter()
            loaded += loader(bucket)
            load_s += time.perf_counter() - t1
        extra = {f"delta_{k}": float(v) for k, v in self.engine.last_delta_stats.items()} if delta is not None else {}
        return ReceiveReport(manifest.num_tensors, manifest.total_bytes, time.perf_counter() - t0, load_s, loaded, extra)

    # --- staged syncs (issue 28) ----------------------------------------------------------------
    def staging_for(self, live: Mapping[str, torch.Tensor], digest: str) -> dict[str, torch.Tensor]:
        """The staging copy, for a `stage="full"` receive of manifest `digest` (accepted by
        validate()), of the tensors of `live` that manifest carries (kept across syncs); `swap()`
        copies exactly those into `live`: a tensor the sync leaves out keeps its bits (issue 45)."""
        manifest = self._manifests.get(digest)
        if manifest is None:
            raise RuntimeError(f"manifest {str(digest)[:12]} was not validated on this receiver; call validate() first")
        self._live, self._staging_digest = live, digest
        return self.staging.for_live(live, (s.name for s in manifest.specs))

    @property
    def staged(self) -> bool:
        """Whether a staged version waits for `swap()` or `discard()`."""
        return self._staged is not None

    def _receive_staged(
        self, digest: str, loader: BucketLoader, destinations: Mapping[str, torch.Tensor] | None, request: DeltaRequest | None,
        on_start: Callable[[], None] | None, region_loader: RegionLoader | None, stage: str,
    ) -> ReceiveReport:
        if self.engine is None:
            raise RuntimeError("call join() before receive()")
        discards = self._discards
        regions = region_loader is not None and self.regions.has(digest)
        if stage == "full":  # lands in the staging copy as a receive lands in place
            live = self._live
            keys = list(self.staging.tensors)
            report = self._receive_into(digest, loader, destinations, request, on_start, region_loader if regions else None)
            manifest = self._manifests[digest]
            engine = self.engine

            def restamp() -> None:  # a delta seed's in-place base now lies in the live tensors
                engine.restamp_bases(manifest, live)

            staged: StagedVersion = StagedCopy([live[n] for n in keys], [self.staging.tensors[n] for n in keys], restamp)
            return self._keep(staged, loader, digest, discards, report)
        assert request is not None
        held: list[list[object]] = []

        def keep(batch: list[Any]) -> int:
            held.append(batch)
            return len(batch)

        if regions:  # every set's patches checked before the loader's turn: its items are kept for the swap
            report = self._receive_into(digest, keep, None, request, on_start, keep)
            return self._keep(StagedBuckets(held), region_loader, digest, discards, report)  # type: ignore[arg-type]
        manifest = self._validated(digest, on_start)
        t0 = time.perf_counter()
        version = self.engine.receive_staged(manifest, destinations, delta=request)
        self.buckets_received += manifest.num_buckets  # every bucket was taken and checked; none is yielded here
        extra = {f"delta_{k}": float(v) for k, v in self.engine.last_delta_stats.items()}
        extra["staged_bytes"] = float(version.nbytes)
        report = ReceiveReport(manifest.num_tensors, manifest.total_bytes, time.perf_counter() - t0, 0.0, 0, extra)
        return self._keep(version, loader, digest, discards, report)

    def _keep(
        self, staged: StagedVersion, loader: BucketLoader | RegionLoader, digest: str, discards: int, report: ReceiveReport,
    ) -> ReceiveReport:
        """Keep a staged version for `swap()`, unless the controller discarded the sync while this
        receive was in flight (the stream failed elsewhere): then it is dropped and the receive fails."""
        with self._keeping:
            if self._discards == discards:
                self._staged = (staged, loader, digest)
                return report
        staged.discard()
        raise RuntimeError(f"the staged receive of manifest {digest[:12]} was discarded while in flight (the sync failed elsewhere)")

    def _receive_into(
        self, digest: str, loader: BucketLoader, destinations: Mapping[str, torch.Tensor] | None, request: DeltaRequest | None,
        on_start: Callable[[], None] | None, region_loader: RegionLoader | None,
    ) -> ReceiveReport:
        if region_loader is not None:
            if on_start is not None:
                on_start()
            extra_stats: dict[str, float] = {}
            report = self.regions.receive(digest, region_loader, destinations, request, extra_stats)
            self.buckets_received += int(extra_stats.pop("buckets", 0))
            return report
        return self._receive(digest, loader, destinations, request, on_start)

    def swap(self) -> float:
        """Make the staged version live: apply it and run the loader kept from its receive over
        what it yields. The engine calls this between two of its steps (no step may read the
        weights meanwhile). Returns the seconds it took. Raises (the live weights then hold the
        previous version, where the staged version could write it back) if nothing is staged."""
        with self.exclusive("a swap"):
            if self._staged is None:
                raise RuntimeError("swap(): nothing is staged; receive(stage=...) first")
            staged, loader, _digest = self._staged
            self._staged = None
            t0 = time.perf_counter()
            for bucket in staged.apply():
                if bucket:
                    loader(bucket)  # type: ignore[arg-type]
            return time.perf_counter() - t0

    def discard(self) -> None:
        """Drop a staged version (a failed stream elsewhere): the live weights were never touched.
        No-op when nothing is staged; a staged receive still in flight keeps nothing (it fails)."""
        with self._keeping:
            self._discards += 1
            staged, self._staged = self._staged, None
        if staged is not None:
            staged[0].discard()
