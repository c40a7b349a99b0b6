"""`LoraReceiverCore`: one engine rank's side of an adapter-only sync, whatever the engine.

validate: the manifest is checked against the engine's LoRA config (`LoraTarget`: max rank,
target modules, each module's base shape) and against the room for one more version, before a
byte moves. receive: the adapter's tensors land in a staging dict, never in anything served; a
receive that fails drops it, so no version is ever half-installed. finalize: the staged tensors
become the engine's adapter object (`build`) and the newest version (`AdapterVersions`); older
versions no request uses are unloaded (`unload`). The engine-specific parts (vLLM's LoRA manager,
the reference receiver's dicts) are the three callables.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

from ckpt_engine.lora_format import ADAPTER_CONFIG, LoraSpec, adapter_layout, check_adapter, check_finite, largest_adapter
from ckpt_engine.manifest import BucketManifest
from ckpt_engine.rollout_adapters.adapter_versions import AdapterVersions
from ckpt_engine.rollout_adapters.receiver import WeightReceiver
from ckpt_engine.sources.base import spec_of

__all__ = ["LoraReceiverCore", "LoraTarget"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class LoraTarget:
    """An engine's LoRA config, as validation needs it."""

    max_rank: int
    base_shapes: Mapping[str, tuple[int, int]]
    """Module path (HF names) -> the base weight's (out_features, in_features), for every module the
    engine can adapt."""
    targets: frozenset[str] | None = None
    """Leaf module names the engine adapts (None: every module in `base_shapes`)."""


class LoraReceiverCore(Generic[T]):
    """Join, validate, receive (into staging) and finalize (install + activate) adapter versions."""

    def __init__(
        self,
        target: Callable[[], LoraTarget],
        build: Callable[[int, dict[str, torch.Tensor], LoraSpec], T],
        unload: Callable[[int], object],
        max_versions: int,
        device: torch.device | None = None,
    ) -> None:
        self._target = target
        self._build = build
        self._unload = unload
        self.receiver = WeightReceiver(device=device)  # a vLLM worker's: its model's device (NCCL and CUDA IPC land only there)
        self.versions: AdapterVersions[T] = AdapterVersions(max_versions)
        self._staged: dict[str, torch.Tensor] | None = None
        self.stale = False
        self.last_report: dict[str, Any] | None = None

    def set_max_versions(self, max_versions: int) -> None:
        """The controller's `max_adapter_versions` (sent at join; the live versions stay)."""
        fresh: AdapterVersions[T] = AdapterVersions(max_versions)
        fresh.live, fresh.in_use = self.versions.live, self.versions.in_use
        self.versions = fresh

    def join(self, rendezvous: dict[str, Any], rank: int, options: dict[str, Any]) -> None:
        self.receiver.join(rendezvous, rank, options)

    def leave(self) -> None:
        self.receiver.leave()

    def check(self, manifest: BucketManifest) -> list[str]:
        t = self._target()
        problems = check_adapter(manifest.specs, max_rank=t.max_rank, base_shapes=t.base_shapes, targets=t.targets)
        room = self.versions.room_problem()
        return problems + ([room] if room is not None else [])

    def validate(self, encoded: bytes | None, digest: str) -> dict[str, Any]:
        """Check a manifest against the engine's LoRA config; nothing moves."""
        t = self._target()  # the decode's budget: the largest adapter this config admits, never what the manifest claims
        return self.receiver.validate(encoded, digest, None, extra_check=self.check, budget_specs=largest_adapter(t.max_rank, t.base_shapes, t.targets))

    def receive(self, digest: str, delta: dict[str, Any] | None = None) -> dict[str, Any]:
        """Receive every tensor of an accepted manifest into staging (copies: the buffers rotate)."""
        staged: dict[str, torch.Tensor] = {}
        self._staged = None

        def load(pairs: list[tuple[str, torch.Tensor]]) -> int:
            for name, t in pairs:
                staged[name] = t.clone()
            return len(pairs)

        self.stale = True  # the newest version still serves; a failed receive leaves it so
        report = self.receiver.receive(digest, load, delta=delta).to_dict()
        self._staged = staged
        self.last_report = report
        return report

    @property
    def staged(self) -> Mapping[str, torch.Tensor] | None:
        """The adapter received since the last finalize, as it will be built (None: none complete);
        an installed-weight check reads it before finalize."""
        return self._staged

    def finalize(self, version: int) -> dict[str, Any]:
        """Build the staged adapter and make it the newest version (install + activate)."""
        staged, self._staged = self._staged, None
        if staged is None:
            raise RuntimeError(f"adapter version {version}: no complete adapter transfer since the last finalize")
        t0 = time.perf_counter()
        config = staged.pop(ADAPTER_CONFIG, None)
        if config is None:
            raise ValueError(f"adapter version {version}: the transfer carried no {ADAPTER_CONFIG}")
        spec = LoraSpec.decode(config)
        ranks = adapter_layout([spec_of(n, t) for n, t in staged.items()]).ranks
        if ranks != {spec.rank}:
            raise ValueError(f"adapter version {version}: lora_A ranks {sorted(ranks)} differ from {ADAPTER_CONFIG}'s r={spec.rank}")
        bad = check_finite(staged)
        if bad:  # never installed: the engine keeps serving its newest adapter
            raise ValueError(f"adapter version {version}: {', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''} hold NaN or infinite values; not installed")
        adapter = self._build(version, staged, spec)
        for old in self.versions.install(version, adapter):
            self._unload(old)
        self.stale = False
        return {"version": version, "install_s": time.perf_counter() - t0, "live": list(self.versions.live)}

    def observe(self, active: set[int]) -> list[int]:
        """The versions the engine's current requests use; unloads the older ones none uses."""
        gone = self.versions.observe(active)
        for old in gone:
            self._unload(old)
        return gone

    def health(self) -> dict[str, Any]:
        return {
            "version": self.versions.newest,
            "live": list(self.versions.live),
            "stale": self.stale,
            "group": self.receiver.group,
            "buckets_received": self.receiver.buckets_received,
            "last_report": self.last_report,
        }

