"""ckpt-engine as a vLLM weight-transfer backend: `--weight-transfer-config '{"backend": "ckpt_engine"}'`.

vLLM (0.26, 0.32) creates one `WeightTransferEngine` per worker from `WeightTransferConfig.backend`
and drives it from its own routes (`/init_weight_transfer_engine`, `/start_weight_update`,
`/update_weights`, `/finish_weight_update`) or `LLM` methods. The plugin in `vllm/plugin.py`
registers this class under the name `ckpt_engine` in every vLLM process. What differs between the
two releases is in `vllm/compat.py`.

One weight update, as the trainer side drives it (`VllmRollout` over a `WeightTransferChannel`,
`rollout_adapters/vllm/native.py`, under a `WeightSyncSession`; `sync/vllm_trainer_engine.py` for
vLLM's trainer API):
  start_weight_update
  update_weights({"phase": "validate", "digest", "manifest"})  raises ValueError naming every bad
      tensor; nothing has moved and the model is untouched (vLLM then closes the update)
  update_weights({"phase": "receive", "digest", "delta"})      blocks while the trainer streams
      the buckets (or patches against the workers' base copies) through the weight-sync group;
      loads them through layerwise reload
  finish_weight_update                                          layerwise post-processing
  update_weights({"phase": "install", "digest", "version"})    before every unstaged finish (after a
      checked receive in an update of its own: see `installed` below), and for adapters:
      post-process and stamp `version` on the worker (vLLM's finish reaches the workers without one)
A staged update (issue 28) keeps the engine stepping while it streams:
  update_weights({"phase": "receive", ..., "stage": "patches"|"full", "ticket"})  starts the receive
      on a background thread of each worker (`VllmReceiverCore.stage`, `vllm/staging.py`); returns at
      once. When it ends, each worker sets its outcome (`ok` or `failed: why`) under the ticket and
      its rank in the weight-sync group's rendezvous store (`vllm/stage_outcome.py`): no call has to ask,
      so no "not yet" error fills vLLM's logs
  update_weights({"phase": "swap", "digest", "version"})  between two steps: the staged version into
      the live weights plus vLLM's post-load step; finish_weight_update then loads nothing
  update_weights({"phase": "discard"})  drops what was staged; the live weights are untouched
  update_weights({"phase": "room", "nbytes", "limit_bytes"})  raises `NO_ROOM` + why unless a
      dense staging copy of `nbytes` fits
Installed-weight checks (`vllm/installed.py`) take two more phases:
  update_weights({"phase": "arm", "installed"})  before the stream: the worker learns the check
      (`InstalledRequest`'s wire form) and digests each layer of the coming load before vLLM
      post-processes it
  update_weights({"phase": "installed", "installed"})  after the receive (staged: after the swap, in
      an update of its own): the worker leaves its `InstalledReport` (JSON) in the group's rendezvous
      store under `answers.installed_key`, where the trainer side reads it. After an unstaged receive
      the worker then holds the load (layerwise reload open, stale, unstamped) through the update's
      finish: the trainer side closes vLLM's update before it compares, so a failed check leaves none
      open (vLLM would refuse every other client's update); a passed one installs the version in
      one more update (phase `install`), a failed one never does: the next validate post-processes
      the held load (the worker stays stale until a sync completes)
vLLM's calls return nothing from the workers, so an answer other than "yes" is an error: vLLM closes
its weight update after one, and the trainer side opens the next (`start_weight_update`).
With `weights: "adapters"` in the init info the workers take LoRA adapter versions instead
(`vllm/lora_worker.py`): validate and receive stage the adapter, phase `install` (version) makes it
the newest version, and finish_weight_update loads nothing (vLLM then drops every loaded LoRA model;
the workers rebuild each version from memory when a request names it); phases `arm` and `installed`
check the received adapter as vLLM's `LoRAModel` holds it (`vllm/lora_installed.py`).
On a vLLM without `shutdown_weight_transfer_engine` (0.26) the workers leave the weight-sync group in
an update of their own:
  update_weights({"phase": "leave"})  as `shutdown` (the next join joins afresh)
The weights never travel in these calls; only the manifest (msgpack, base64) and small scalars do.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from ckpt_engine.delta.request import DeltaRequest
from ckpt_engine.engine import Rendezvous
from ckpt_engine.installed import InstalledRequest
from ckpt_engine.rollout_adapters.base import STAGES, JoinOptions
from ckpt_engine.rollout_adapters.vllm.stage_outcome import check_ticket, report_outcome
from ckpt_engine.rollout_adapters.vllm.answers import NEED_MANIFEST, NO_ROOM, PHASES, REJECTED, installed_key, plan_key
from ckpt_engine.rollout_adapters.vllm.compat import features_of
from ckpt_engine.rollout_adapters.vllm.receiver import VllmReceiverCore, unbase64

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from ckpt_engine.rollout_adapters.vllm.lora_worker import VllmLoraCore
    from vllm.config.weight_transfer import WeightTransferConfig

__all__ = ["CkptEngineInitInfo", "CkptEngineUpdateInfo", "CkptEngineWeightTransferEngine"]

logger = logging.getLogger(__name__)

LEAVE = "leave"
"""The phase in which the workers leave the weight-sync group, for a vLLM without
`shutdown_weight_transfer_engine` (0.26)."""
_PHASES = (*PHASES, LEAVE)
_NO_DIGEST = ("discard", "room", "arm", "installed", LEAVE)
"""Phases that name no manifest."""


@dataclass
class CkptEngineInitInfo(WeightTransferInitInfo):
    """Where the workers join the weight-sync group; sent once by the trainer side.

    `rendezvous` and `options` are `Rendezvous.to_dict()` and `JoinOptions.to_dict()`; worker
    `i` (global across data-parallel replicas) joins as rank `rank_offset + i`.
    """

    rendezvous: dict[str, Any]
    rank_offset: int
    options: dict[str, Any]
    weights: str = "full"
    """`adapters`: the workers take LoRA adapter versions (the engine started with LoRA enabled)."""
    max_adapter_versions: int = 2
    num_workers: int | None = None
    """How many workers the trainer's handle counts for this engine (None: not said); a worker of
    an engine with another count refuses the join at once instead of leaving the group to time out."""

    def __post_init__(self) -> None:
        if self.weights not in ("full", "adapters"):
            raise ValueError(f"weights must be 'full' or 'adapters', got {self.weights!r}")
        Rendezvous.from_dict(self.rendezvous)  # raises ValueError naming the bad field
        JoinOptions.from_dict(self.options)
        if not isinstance(self.rank_offset, int) or isinstance(self.rank_offset, bool) or self.rank_offset < 1:
            raise ValueError(f"rank_offset must be an int >= 1 (rank 0 is the sender), got {self.rank_offset!r}")
        if self.num_workers is not None and (not isinstance(self.num_workers, int) or isinstance(self.num_workers, bool) or self.num_workers < 1):
            raise ValueError(f"num_workers must be an int >= 1 or None, got {self.num_workers!r}")


@dataclass
class CkptEngineUpdateInfo(WeightTransferUpdateInfo):
    """One step of a weight update: `validate` a manifest, `receive` the one validated (or stage it),
    the staged phases `swap`, `discard`, `room`, and an installed-weight check's `arm` and `installed`
    (module docstring)."""

    phase: str
    digest: str = ""
    """The manifest's digest; every phase but discard and room names one."""
    manifest: str | None = None
    """Validate only: base64 of the msgpack manifest; None when the worker already holds `digest`."""
    regions: list[str] | None = None
    """Validate only (region delivery): every worker's region assignment, base64, in worker order."""
    version: str | None = None
    """Receive and swap: the version the trainer stamps on this update (reported by the worker)."""
    delta: dict[str, Any] | None = None
    """Receive only: the controller's delta request (`DeltaRequest.to_dict()`); None: dense."""
    stage: str | None = None
    """Receive only: `patches` or `full` stages the receive (returns at once); None: load it now."""
    ticket: str | None = None
    """Staged receive only: names this sync's outcome keys in the rendezvous store (`vllm/stage_outcome.py`)."""
    nbytes: int | None = None
    """Room only: the bytes of the dense staging copy asked for."""
    limit_bytes: int | None = None
    """Room only: the engine's staging limit (None: free memory only)."""
    installed: dict[str, Any] | None = None
    """Arm and installed only: the installed-weight check (`InstalledRequest.to_wire()`)."""

    def __post_init__(self) -> None:
        if self.phase not in _PHASES:
            raise ValueError(f"phase must be one of {', '.join(PHASES)}, got {self.phase!r} (or {LEAVE!r}: the workers leave the group)")
        if not isinstance(self.digest, str) or (not self.digest and self.phase not in _NO_DIGEST):
            raise ValueError(f"digest must be a non-empty string, got {self.digest!r}")
        if self.stage is not None and (self.phase != "receive" or self.stage not in STAGES):
            raise ValueError(f"stage must be one of {', '.join(STAGES)}, sent only with phase 'receive'; got {self.stage!r}")
        if (self.stage is None) != (self.ticket is None):
            raise ValueError(f"a staged receive needs a ticket, and only a staged receive takes one; got stage {self.stage!r}, ticket {self.ticket!r:.80}")
        if self.ticket is not None:
            check_ticket(self.ticket)
        if self.phase == "swap" and (self.version is None or not self.version.isdigit()):
            raise ValueError(f"phase 'swap' needs the version it stamps as a decimal string, got {self.version!r}")
        for key, value in (("nbytes", self.nbytes), ("limit_bytes", self.limit_bytes)):
            if value is not None and (self.phase != "room" or isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"{key} must be a non-negative int, sent only with phase 'room'; got {value!r}")
        if self.phase == "room" and self.nbytes is None:
            raise ValueError("phase 'room' needs nbytes")
        if self.manifest is not None and (self.phase != "validate" or not isinstance(self.manifest, str)):
            raise ValueError("manifest must be a base64 string, sent only with phase 'validate'")
        if self.regions is not None and (self.phase != "validate" or not isinstance(self.regions, list) or not all(isinstance(r, str) for r in self.regions)):
            raise ValueError("regions must be a list of base64 strings, sent only with phase 'validate'")
        if self.version is not None and not isinstance(self.version, str):
            raise ValueError(f"version must be a string, got {self.version!r}")
        if self.phase == "install" and (self.version is None or not self.version.isdigit()):
            raise ValueError(f"phase 'install' needs the adapter's version as a decimal string, got {self.version!r}")
        if (self.installed is not None) != (self.phase in ("arm", "installed")):
            raise ValueError(f"phases 'arm' and 'installed' need the installed-weight check, and only they take one; got phase {self.phase!r}")
        if self.installed is not None:
            InstalledRequest.from_wire(self.installed)  # raises ValueError naming the bad field
        if self.delta is not None:
            if self.phase != "receive":
                raise ValueError("delta is sent only with phase 'receive'")
            DeltaRequest.from_dict(self.delta)  # raises ValueError naming the bad field


class CkptEngineWeightTransferEngine(WeightTransferEngine[CkptEngineInitInfo, CkptEngineUpdateInfo]):
    """Worker side: joins ckpt-engine's weight-sync group and loads its pipelined buckets.

    Every method runs on every worker rank (vLLM calls it through `collective_rpc`).
    """

    init_info_cls = CkptEngineInitInfo
    update_info_cls = CkptEngineUpdateInfo
    # The specs a manifest is checked against describe the main model only.
    supports_draft_weight_update = False

    def __init__(
        self,
        config: WeightTransferConfig,
        vllm_config: VllmConfig,
        device: torch.device,
        model: torch.nn.Module,
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        self.core = VllmReceiverCore(lambda: self.model, vllm_config, device)
        self._validated: str | None = None
        self._version: str | None = None
        self._loaded = False  # this update loaded weights (phase receive unstaged): finish post-processes
        self._pending: str | None = None
        """The manifest of an unstaged receive that awaits phase `install` (kept across the update an
        installed-weight check closed, `_installed_phase`)."""
        self.lora: VllmLoraCore | None = None
        """Adapter syncs (init info `weights: adapters`): the LoRA versions this worker holds."""
        self._rank: int | None = None  # this worker's rank in the weight-sync group
        self._store: torch.distributed.Store | None = None
        """A client of the group's rendezvous store: staged receives report their end there."""

    if features_of().transfer_engine_sends:  # vLLM 0.26's base declares it abstract (vllm/compat.py)

        @staticmethod
        def trainer_send_weights(iterator: Iterator[Any], trainer_args: dict[str, Any] | Any) -> None:
            """Never the way in: ckpt-engine's trainer side streams through its own weight-sync group."""
            raise NotImplementedError(
                "ckpt_engine sends from the trainer through VllmRollout(name, WeightTransferChannel(client)) "
                "under a WeightSyncSession (ckpt_engine.rollout_adapters.vllm.native), not trainer_send_weights"
            )

    def _worker_rank(self) -> int:
        """This worker's index across every data-parallel replica (as vLLM's NCCL backend counts)."""
        pc = self.parallel_config
        return int(pc.data_parallel_index) * int(pc.world_size) + int(pc.rank)

    def init_transfer_engine(self, init_info: CkptEngineInitInfo) -> None:
        """Join the weight-sync group; blocks until the sender and every worker have joined."""
        pc = self.parallel_config
        workers = int(pc.world_size) * int(pc.data_parallel_size)
        if init_info.num_workers is not None and init_info.num_workers != workers:
            raise ValueError(
                f"the trainer's handle counts {init_info.num_workers} workers but this engine has {workers} "
                f"(tensor x pipeline x data parallel): make it with num_workers={workers}"
            )
        rank = init_info.rank_offset + self._worker_rank()
        if init_info.weights == "adapters":
            from ckpt_engine.rollout_adapters.vllm.lora_worker import VllmLoraCore

            if self.lora is None:
                self.lora = VllmLoraCore(lambda: self._default_model, self.vllm_config, init_info.max_adapter_versions)
                self.lora.preload = False  # vLLM drops every LoRA model when an update finishes
            self.lora.core.set_max_versions(init_info.max_adapter_versions)
            self.lora.core.join(init_info.rendezvous, rank, init_info.options)
            self._rank, self._store = rank, Rendezvous.from_dict(init_info.rendezvous).connect_store(is_master=False)  # installed-weight reports
            return
        self.lora = None
        self.core.join(init_info.rendezvous, rank, init_info.options)
        self._rank, self._store = rank, Rendezvous.from_dict(init_info.rendezvous).connect_store(is_master=False)
        self._store.set(plan_key(rank), json.dumps(self.core.receive_plan()))  # the trainer side reads it there
        logger.info("ckpt_engine: worker joined the weight-sync group as rank %s", rank)

    def start_weight_update(self) -> None:
        """Open an update; the model is untouched until a validated manifest is received (a load held
        for phase `install` stays held)."""
        self._validated, self._version, self._loaded = None, None, False

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # No device-wide synchronize (the base class does one): the receiver orders its own copies,
        # and on CPU there is no accelerator to synchronize.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: CkptEngineUpdateInfo) -> None:
        """One phase; an adapter sync (`self.lora`) validates, receives into its LoRA stage and installs."""
        phase, digest = update_info.phase, update_info.digest
        allowed = ("validate", "receive", "install", "arm", "installed", LEAVE) if self.lora is not None else _PHASES
        if phase not in allowed or (self.lora is not None and update_info.stage is not None):
            raise RuntimeError(
                f"ckpt_engine: phase {phase!r} (stage {update_info.stage!r}) does not belong to a join with weights="
                f"{'adapters' if self.lora is not None else 'full'}, which takes {', '.join(allowed)} (adapter syncs are not staged)"
            )
        core = self.lora.core if self.lora is not None else self.core
        if phase == LEAVE:
            self.shutdown()
            self._validated, self._loaded = None, False  # nothing left for this update's finish
        elif phase == "validate":
            self._drop_pending()
            regions = update_info.regions
            if regions is not None and not 0 <= self._worker_rank() < len(regions):
                raise ValueError(REJECTED + f"region assignments for {len(regions)} workers, none for worker {self._worker_rank()}")
            mine = regions[self._worker_rank()] if regions is not None else None
            if self.lora is not None:  # its core takes bytes and no regions
                verdict = core.validate(unbase64(update_info.manifest), digest)
            else:
                verdict = self.core.validate(update_info.manifest, digest, mine)
            if verdict.get("need_manifest"):
                raise ValueError(f"ckpt_engine: {NEED_MANIFEST}: no manifest cached under digest {digest[:12]}; send it")
            if not verdict["accepted"]:
                raise ValueError(REJECTED + "; ".join(verdict["problems"]))
            self._validated = digest
        elif phase in ("swap", "discard", "room"):
            self._staged_phase(update_info)
        elif phase in ("arm", "installed"):
            self._installed_phase(phase, InstalledRequest.from_wire(update_info.installed))
        elif phase == "install":
            self._install(digest, update_info.version)  # type: ignore[arg-type]  # checked in CkptEngineUpdateInfo
        elif self._validated != digest:
            raise RuntimeError(f"ckpt_engine: manifest {digest[:12]} was not validated in this weight update; call update_weights with phase 'validate' first")
        elif update_info.stage is not None:  # the engine keeps stepping while the thread streams
            store, ticket, rank = self._store, update_info.ticket, self._rank
            if store is None or rank is None or ticket is None:
                raise RuntimeError("ckpt_engine: a staged receive before init_transfer_engine; join the weight-sync group first")
            self.core.stage(digest, delta=update_info.delta, on_end=lambda error: report_outcome(store, ticket, rank, error))
        else:
            self._loaded = self.lora is None  # layerwise reload is open from here: finish post-processes
            core.receive(digest, delta=update_info.delta)
            self._pending, self._version = digest, update_info.version

    def _install(self, digest: str, version: str) -> None:
        """Phase `install`: the received manifest `digest` becomes `version` (full weights: layerwise
        post-processing and the worker's stamp; adapters: the newest version), in the update that
        received it or in a later one when an installed-weight check closed that update."""
        if digest != self._pending:
            raise RuntimeError(f"ckpt_engine: install of manifest {digest[:12]} refused: this worker holds no received load of it")
        self._pending, self._loaded = None, False
        if self.lora is not None:
            self.lora.core.finalize(int(version))
        else:
            self.core.finalize(version)

    def _drop_pending(self) -> None:
        """A new sync (or a discard) gives up a load held for phase `install` (its installed-weight
        check failed): layerwise post-processing puts vLLM's layers back in their kernels, unstamped;
        the worker stays stale until a sync completes."""
        if self._pending is not None and self.lora is None and self.core.reload.is_open:
            logger.warning("ckpt_engine: closing a load whose installed-weight check failed (this worker stays stale until a sync completes)")
            self.core.reload.close()
        self._pending = None

    def _staged_phase(self, update_info: CkptEngineUpdateInfo) -> None:
        """swap, discard or room: each a short call between two engine steps. vLLM returns nothing
        from a worker, so every answer but "yes" is an error (see the module docstring)."""
        if update_info.phase == "swap":
            staged = self.core.staging.describe()
            if staged is not None and staged["digest"] != update_info.digest:
                raise RuntimeError(f"ckpt_engine: swap of manifest {update_info.digest[:12]} refused: this worker staged {staged['digest'][:12]}")
            self.core.swap(update_info.version)
            self._version = update_info.version
        elif update_info.phase == "discard":
            self._drop_pending()
            self.core.discard()
        else:  # room
            assert update_info.nbytes is not None  # checked in CkptEngineUpdateInfo
            room = self.core.staging_room(update_info.nbytes, update_info.limit_bytes)
            if not room["room"]:
                raise ValueError(NO_ROOM + str(room["why"]))

    def _installed_phase(self, phase: str, request: InstalledRequest) -> None:
        """Arm the check before the stream, or leave this worker's report in the group's store (an
        adapter join: the received adapter read back out of vLLM's `LoRAModel`, `vllm/lora_installed.py`)."""
        if phase == "arm":
            (self.lora if self.lora is not None else self.core).installed_arm(request)
            return
        if self._store is None or self._rank is None:
            raise RuntimeError("ckpt_engine: an installed-weight report before init_transfer_engine; join the weight-sync group first")
        report = (self.lora if self.lora is not None else self.core).installed(request)
        self._loaded = False  # a load checked here waits for phase `install`: this update's finish leaves it held
        self._store.set(installed_key(self._rank, request.seed), json.dumps(report.to_wire()))

    def finish_weight_update(self) -> None:
        """Layerwise post-processing; vLLM stamps the engine's weight version after this returns.
        An adapter sync and a checked one installed their version in phase `install`, and a staged
        one swapped in phase `swap`: nothing to load here."""
        if self.lora is None and self._loaded:  # a staged update loaded in its swap, or nothing
            self.core.finalize(self._version if self._version is not None else self.core.version)
            self._pending = None  # installed: nothing left for phase `install`
        self._validated, self._loaded = None, False

    def health(self) -> dict[str, Any]:
        return self.lora.core.health() if self.lora is not None else self.core.health()

    def shutdown(self) -> None:
        self._store, self._rank, self._pending = None, None, None
        if self.lora is not None:
            self.lora.core.leave()
        else:
            self.core.leave()
