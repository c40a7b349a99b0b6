"""The reference receiver's process side: its tensors, its receiver, its weight version.

`TorchRefRollout` (`rollout.py`) is the controller's handle; this object is what the spawned
process (`serve.py`, or a Ray actor) serves over its control port.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from ckpt_engine.copies import batched_copy_
from ckpt_engine.delta.warm import warmed
from ckpt_engine.elastic.service import PeerService
from ckpt_engine.installed import InstalledRequest
from ckpt_engine.installed_held import HeldDigests, HeldFold, HeldLaunch
from ckpt_engine.manifest import TensorSpec
from ckpt_engine.planning.receive_sets import cut_region
from ckpt_engine.planning.regions import ReceivePlan, Region
from ckpt_engine.rollout_adapters.engine_lease import EngineLease
from ckpt_engine.rollout_adapters.torch_ref.load_gate import LoadGate
from ckpt_engine.rollout_adapters.receiver import WeightReceiver
from ckpt_engine.rollout_adapters.torch_ref.models import RefModel
from ckpt_engine.rollout_adapters.torch_ref.steps import EngineSteps, staging_room
from ckpt_engine.versions import check_step, check_version
from ckpt_engine.sources.base import spec_of

__all__ = ["TorchRefWorker"]

logger = logging.getLogger(__name__)


class TorchRefWorker:
    """The receiving process: its tensors, its receiver, its weight version.

    As one rank of a TP / EP engine (`sharded`) it holds only its slices (`planning/tp_ep.py`):
    its tensors have the slices' shapes, and it states that plan at join."""

    def __init__(
        self, tensors: dict[str, torch.Tensor], model: torch.nn.Module | None = None, load_delay_s: float = 0.0,
        plan: ReceivePlan | None = None, expected: dict[str, TensorSpec] | None = None, staging_budget_bytes: int | None = None,
        step_interval_s: float | None = None,
    ) -> None:
        self.tensors = tensors
        self.model = model
        self.gate = LoadGate.from_env(load_delay_s)
        self.plan = plan
        self.regions: dict[str, Region | None] = {}
        """The one region of each held tensor (None: whole), as `plan` says."""
        if plan is not None:
            for name, rs in plan.holds.items():
                if rs is not None and len(rs) != 1:
                    raise ValueError(f"the reference receiver holds one region per tensor; {name!r} has {len(rs)}")
                self.regions[name] = rs[0] if rs is not None else None
        self.receiver = WeightReceiver(plan=plan)
        self.version: int | None = None
        """The version held completely; None before the first sync and while partially loaded."""
        self.last_version: int | None = None
        """The highest version ever finalized: versions never go down."""
        self.paused = False
        self.stale = False
        self.receiving = False
        self.received: str | None = None
        """Digest of the transfer that completed since the last finalize (None: none did)."""
        self.expected = expected if expected is not None else {n: spec_of(n, t) for n, t in tensors.items()}
        self.lease = EngineLease()
        self.staging_budget_bytes = staging_budget_bytes
        """Cap on a dense staging copy (None: the free memory alone decides)."""
        self.steps = EngineSteps(tensors, lambda: self.version, step_interval_s if step_interval_s is not None else 0.0)
        if step_interval_s is not None:
            self.steps.start()
        self.peers = PeerService(self, self.receiver.exclusive, self.gate.pass_through)  # peer joins (ckpt_engine.elastic)
        self.held = HeldDigests(tensors, self.regions)  # installed-weight checks

    @classmethod
    def of(cls, model: RefModel, **kw: Any) -> TorchRefWorker:
        """A worker over `model`'s tensors (see `models.py`)."""
        return cls(model.tensors, model=model.module, plan=model.plan, expected=model.expected, **kw)

    def load_bucket(self, pairs: list[tuple[str, torch.Tensor]], into: dict[str, torch.Tensor] | None = None, delay: bool = True) -> int:
        """Whole tensors (a sync without region delivery): a sharded rank keeps its slices.
        `into`: the tensors to load (default: the live ones; a staging copy for `stage="full"`)."""
        if delay:
            self.gate.pass_through()
        if self.plan is not None:
            pairs = [(n, cut_region(t, self.regions[n])) for n, t in pairs if n in self.regions]
        target = into if into is not None else self.tensors
        batched_copy_([target[n] for n, _ in pairs], [t for _, t in pairs])
        return len(pairs)

    def load_regions(
        self, items: list[tuple[str, Region | None, torch.Tensor]], into: dict[str, torch.Tensor] | None = None, delay: bool = True,
    ) -> int:
        """Region delivery: each item is one of this rank's regions, in the region's shape."""
        if delay:
            self.gate.pass_through()
        target = into if into is not None else self.tensors
        batched_copy_([target[n] for n, _, _ in items], [t for _, _, t in items])
        return len(items)

    # --- RPC handlers (plain msgpack types in and out) ----------------------------------------
    def handlers(self) -> dict[str, Any]:
        """RPC methods; those that change the engine's state carry the caller's `owner`."""
        return {
            "join": self._owned(lambda rendezvous, rank, options: self.receiver.join(rendezvous, rank, options)),
            "leave": self._owned(self.receiver.leave),
            "validate": self._owned(
                lambda encoded, digest, regions=None: self.receiver.validate(encoded, digest, self.expected, regions=regions)
            ),
            "receive_plans": self._owned(lambda: [self.plan.to_wire() if self.plan is not None else None]),
            "pause": self._owned(self.pause),
            "receive": self._owned(self.receive),
            "finalize": self._versioned(self.finalize),
            "resume": self._owned(self.resume),
            "swap": self._versioned(self.swap),
            "discard": self._owned(self.receiver.discard),
            "staging_room": self._owned(self.staging_room),
            "installed": self._owned(lambda request: self.held.report(InstalledRequest.from_wire(request)).to_wire()),
            "claim": self.claim,
            "release": self.lease.release,
            "health": self.health,
            "get_tensor": self.get_tensor,
            "steps": self.steps.since,
            "specs": lambda: [[s.name, s.dtype, list(s.shape)] for s in self.expected.values()],
            **self.peers.handlers(self._owned),
        }

    # --- ownership ----------------------------------------------------------------------------
    def claim(self, owner: str, lease_s: float) -> dict[str, Any]:
        """Make `owner` (a weight-sync group) this engine's only controller for `lease_s`, renewed by its calls."""
        self.lease.claim(owner, lease_s)
        return self.health()

    def _owned(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        return self.lease.owned_call(fn)

    def _versioned(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """A version change from a caller that claims no group (a library session, anyone with the token):
        at most MAX_VERSION_STEP past what the engine held, never the last version (none freezes them)."""
        step = lambda version, **params: fn(version=check_step(check_version(version, "version"), self.last_version or 0, "version"), **params)  # noqa: E731
        owned, bounded = self.lease.owned_call(fn), self.lease.owned_call(step)

        def call(owner: str | None = None, **params: Any) -> Any:
            return (owned if owner is not None else bounded)(owner=owner, **params)

        return call

    # --- engine state -------------------------------------------------------------------------
    def pause(self, mode: str) -> None:
        self.paused = mode != "none"
        if self.paused:
            self.steps.pause()

    def receive(self, digest: str, delta: dict[str, Any] | None = None, stage: str | None = None, installed: dict[str, Any] | None = None) -> dict[str, Any]:
        if stage is not None:
            return self._receive_staged(digest, delta, stage)
        check = self.held.begin(InstalledRequest.from_wire(installed)) if installed is not None else None  # answered once every byte landed
        loader, regions = self._folding(check) if check is not None else (self.load_bucket, self.load_regions)
        # Until finalize the engine holds no complete version: a failure mid-stream leaves a mix (with delta, the loader runs
        # only after every patch checked out: a bad patch leaves the old weights, still marked stale because the sync did not
        # complete). A receive the receiver refuses (busy, not joined, manifest not validated) leaves the engine as it was.
        def start() -> None:
            self.stale, self.version, self.received, self.receiving = True, None, None, True

        try:
            report = self.receiver.receive(digest, loader, self.tensors, delta=delta, on_start=start, region_loader=regions).to_dict()
        finally:
            self.receiving = False
        if check is not None:
            report["installed"] = check.report().to_wire()
        self.received = digest
        return report

    def _folding(self, check: HeldFold | HeldLaunch) -> tuple[Callable[..., int], Callable[..., int]]:
        """The loaders of a checked receive: each bucket's tensors are told to the check once loaded
        (`landed`: on the host folded in batches while the next bucket streams; on a GPU every
        tensor in one launch once the last one landed)."""

        def loader(pairs: list[tuple[str, torch.Tensor]]) -> int:
            loaded = self.load_bucket(pairs)
            check.landed([n for n, _ in pairs])
            return loaded

        def regions(items: list[tuple[str, Region | None, torch.Tensor]]) -> int:
            loaded = self.load_regions(items)
            check.landed([n for n, _, _ in items])
            return loaded

        return loader, regions

    def staging_room(self, nbytes: int) -> bool:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"nbytes must be an int >= 0, got {nbytes!r:.40}")
        device = next((t.device for t in self.tensors.values()), torch.device("cpu"))
        return staging_room(nbytes, self.staging_budget_bytes, device)

    def _receive_staged(self, digest: str, delta: dict[str, Any] | None, stage: str) -> dict[str, Any]:
        """Into the staging area while the steps go on: the live weights, the version and the
        stale flag stay as they are until the swap."""
        into = self.receiver.staging_for(self.tensors, digest) if stage == "full" else None
        if into is not None:  # the loaders fill the staging copy as the buckets land
            loader: Callable[..., int] = lambda pairs: self.load_bucket(pairs, into)  # noqa: E731
            regions: Callable[..., int] = lambda items: self.load_regions(items, into)  # noqa: E731
        else:  # the loaders run at the swap, onto the live weights (a tensor onto itself is skipped)
            loader = lambda pairs: self.load_bucket(pairs, delay=False)  # noqa: E731
            regions = lambda items: self.load_regions(items, delay=False)  # noqa: E731

        def start() -> None:
            self.receiving = True

        try:
            destinations = into if into is not None else self.tensors
            report = self.receiver.receive(digest, loader, destinations, delta=delta, on_start=start, region_loader=regions, stage=stage)
        finally:
            self.receiving = False
        return report.to_dict()

    def swap(self, version: int, pause_mode: str) -> dict[str, float]:
        """Between two engine steps: apply the staged version, stamp `version`; the stall is the
        time no step could run. A failed swap leaves the engine paused and stale (as a failed
        finalize does)."""
        check_version(version, "swap version", at_least=self.last_version if self.last_version is not None else 0)
        if not self.receiver.staged:
            raise RuntimeError(f"swap({version}): no staged version (the engine holds version {self.version}); run a complete sync")
        with self.steps.lock:  # pause_mode: the reference engine has no requests to keep or abort
            t0 = time.monotonic()
            try:
                apply_s = self.receiver.swap()
            except BaseException:
                self.stale, self.version, self.paused = True, None, True
                self.steps.pause_locked()
                raise
            self.version, self.last_version, self.stale, self.received, self.paused = version, version, False, None, False
            self.peers.synced()
            self.steps.resume_locked()
            stall = time.monotonic() - t0
        return {"stall_s": stall, "apply_s": apply_s}

    def finalize(self, version: int) -> None:
        check_version(version, "finalize version", at_least=self.last_version if self.last_version is not None else 0)
        if self.received is None:
            held = "a partially loaded state" if self.stale else f"version {self.version}"
            raise RuntimeError(f"finalize({version}): no transfer completed since the last finalize (the engine holds {held}); run a complete sync")
        self.version, self.last_version, self.stale, self.received = version, version, False, None
        self.peers.synced()

    def resume(self) -> None:
        if self.stale:
            raise RuntimeError("resume: the engine holds a partially loaded state (a sync failed part-way); only a complete sync resumes it")
        self.paused = False
        self.steps.resume()

    def health(self, owner: str | None = None) -> dict[str, Any]:
        self.lease.renew(owner)
        return {
            "pid": os.getpid(),
            "version": self.version,
            "last_version": self.last_version,  # what a new version must exceed (held_version)
            "paused": self.paused,
            "stale": self.stale,
            "receiving": self.receiving,
            "buckets_received": self.receiver.buckets_received,
            "held": self.gate.held,  # a load waits on the hold file (load_gate.py)
            "owned": self.lease.owned,
            "staged": self.receiver.staged,
            "staging_copy_bytes": self.receiver.staging.nbytes,  # what the staging copy holds (the last staged dense sync's tensors)
            "delta_warmed": sorted(warmed()),  # the devices whose delta kernels this process loaded (delta.warm)
            "steps": self.steps.count,
            "group": self.receiver.group,  # the weight-sync group joined (None after a restart)
            "version_from": self.peers.version_from(self.version),  # "trainer sync" or "peer pull from <peer>"
        }

    def get_tensor(self, name: str) -> dict[str, Any]:
        t = self.tensors[name].contiguous()
        return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "data": t.reshape(-1).view(torch.uint8).numpy().tobytes()}
