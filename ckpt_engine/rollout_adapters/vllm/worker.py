"""vLLM worker extension: the engine-side half of the `collective_rpc` vLLM rollout adapter.

Start vLLM with
`worker_extension_cls="ckpt_engine.rollout_adapters.vllm.worker.CkptEngineWorkerExtension"`; vLLM
mixes this class into every worker, and the controller reaches its `ckpt_*` methods through
`collective_rpc` (in-process `LLM`) or the dev-mode `/collective_rpc` route (`api_server`). Control
arguments are plain msgpack/JSON values (the manifest travels as bytes, or base64 over HTTP); the
weights travel only through the weight-sync group.

This path works on any vLLM with `worker_extension_cls`. vLLM versions with the weight-transfer API
can use the native backend instead (`vllm/transfer_engine.py`); both drive the same
`VllmReceiverCore`.
"""

from __future__ import annotations

import base64
import functools
import gc
import hashlib
import inspect
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from ckpt_engine.engine import Rendezvous
from ckpt_engine.installed import InstalledReport, InstalledRequest, agreeing
from ckpt_engine.rollout_adapters.vllm.answers import FAILED
from ckpt_engine.rollout_adapters.vllm.receiver import VllmReceiverCore, unbase64
from ckpt_engine.rollout_adapters.vllm.specs import vllm_checkpoint_specs
from ckpt_engine.rollout_adapters.vllm.stage_outcome import check_ticket, report_outcome

__all__ = ["CkptEngineWorkerExtension", "vllm_checkpoint_specs"]

logger = logging.getLogger(__name__)


class CkptEngineWorkerExtension:
    """Mixed into vLLM's worker class; every method runs in each worker via collective_rpc. A `ckpt_*`
    method (here or in a subclass) that fails answers `{answers.FAILED: "Type: message"}` instead of
    raising: vLLM's multiprocess executor stops reading the workers' answers at the first one that
    raised, and the others' would then answer the engine's next call (`vllm/answers.py`)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _answer_failures(cls)

    # Lives on the worker instance; vLLM constructs the worker, not this class.
    _ckpt: VllmReceiverCore

    def _ckpt_core(self) -> VllmReceiverCore:
        core = getattr(self, "_ckpt", None)
        if core is None:
            device = getattr(self, "device", None)
            runner = self.model_runner  # type: ignore[attr-defined]
            core = self._ckpt = VllmReceiverCore(
                runner.get_model, self.vllm_config, torch.device(device) if device is not None else None, runner  # type: ignore[attr-defined]
            )
        return core

    def _ckpt_arm(self, request: dict[str, Any]) -> None:
        """Arm the installed-weight check `request` (its wire form): apart, or with a receive."""
        self._ckpt_core().installed_arm(InstalledRequest.from_wire(request))

    def _ckpt_rank(self) -> int:
        return int(getattr(self, "rank", 0))

    def ckpt_join(self, rendezvous: dict[str, Any], rank_offset: int, options: dict[str, Any]) -> dict[str, Any]:
        """Join the weight-sync group as rank `rank_offset + this worker's rank` (collective)."""
        rank = int(rank_offset) + self._ckpt_rank()
        core = self._ckpt_core()
        if core.peer.prep.release():  # a join's prepare made ahead: this engine is synced instead (its slab freed)
            logger.info("a peer join's prepare made ahead was released: this worker joins a weight-sync group instead")
        core.join(rendezvous, rank, options)
        self._ckpt_outcomes = (Rendezvous.from_dict(rendezvous).connect_store(is_master=False), rank)  # staged receives report here
        return {"pid": os.getpid(), "rank": rank}

    def ckpt_leave(self) -> None:
        self._ckpt_core().leave()

    def ckpt_manifest_budget(self) -> dict[str, int]:
        """What an honest manifest for this worker can hold (see VllmReceiverCore.manifest_budget)."""
        return self._ckpt_core().manifest_budget()

    def ckpt_receive_plan(self) -> dict[str, Any]:
        """This worker's receive plan recorded from vLLM's own loaders (see VllmReceiverCore.receive_plan)."""
        return self._ckpt_core().receive_plan()

    def ckpt_validate(
        self, encoded: bytes | str | None, digest: str, regions: list[Any] | None = None, claim: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Check a manifest against this worker's parameters; nothing moves. `encoded` may be base64.
        `regions`: every worker's region assignment in rank order (region delivery); this one takes its own.
        `claim`: the sync's peer-lease claim (`ckpt_peer_claim`'s arguments), taken first: one call, not two.
        The answer carries `member` (what `ckpt_health` says of this worker's pid, version and group):
        the session reads its membership query from it, with no round trip of its own."""
        if claim is not None:
            self.ckpt_peer_claim(str(claim["owner"]), float(claim["lease_s"]))
        rank = self._ckpt_rank()
        core = self._ckpt_core()
        if regions is not None and not 0 <= rank < len(regions):
            out = {"accepted": False, "need_manifest": False, "problems": [f"region assignments for {len(regions)} workers, none for worker {rank}"]}
        else:
            out = core.validate(encoded, digest, regions[rank] if regions is not None else None)
        return {**out, "member": {"pid": os.getpid(), "version": core.version, "group": core.receiver.group}}

    def ckpt_receive(self, digest: str, delta: dict[str, Any] | None = None, installed: dict[str, Any] | None = None) -> dict[str, Any]:
        """Receive every bucket of an accepted manifest and load it (layerwise reload stays open);
        `delta`: the controller's delta request (patches against this worker's base copy);
        `installed`: the sync's installed-weight check, armed first (`ckpt_installed_arm`)."""
        if installed is not None:
            self._ckpt_arm(installed)
        return self._ckpt_core().receive(digest, delta)

    def ckpt_receive_begin(
        self, digest: str, delta: dict[str, Any] | None = None, installed: dict[str, Any] | None = None, quiet_s: float | None = None,
    ) -> dict[str, Any]:
        """`ckpt_receive` on a thread of this worker, so the engine core is free while the version
        streams in (`ckpt_receive_end` answers what `ckpt_receive` would). Answers at once, or, for a
        receive that copies out of a colocated sender's memory, once its copies are queued (waited
        for up to `quiet_s`)."""
        if installed is not None:
            self._ckpt_arm(installed)
        return self._ckpt_core().receive_begin(digest, delta, float(quiet_s) if quiet_s is not None else None)

    def ckpt_receive_end(
        self, timeout_s: float, finalize: int | None = None, release: str | None = None, installed: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The begun receive's answer; with `finalize`, once it ended whole, `ckpt_finalize(finalize,
        release)` too, in this call (its answer under `finalized`): one round trip fewer a sync. With
        `installed` (an armed check's source digests, an `InstalledReport`'s wire form) only where the
        report riding on the answer agrees; else (or `release` alone) the claim is let go and the
        controller compares."""
        core = self._ckpt_core()
        if installed is not None:  # while the device may still copy: the report compares them as it is read back
            core.expect_installed(installed)
        answer = core.receive_end(float(timeout_s))
        if finalize is not None and (installed is None or agrees(answer.get("installed"), installed)):
            answer["finalized"] = self.ckpt_finalize(int(finalize), release)
        elif release is not None:
            self.ckpt_peer_release(release)
        return answer

    def ckpt_finalize(self, version: int, release: str | None = None) -> dict[str, Any]:
        """Post-process what was loaded (layerwise finalize), then stamp `version`; `release`: the
        sync's peer-lease claim let go of last (`ckpt_peer_release`), in the same call."""
        out = self._ckpt_core().finalize(int(version))
        if release is not None:
            self.ckpt_peer_release(release)
        return out

    def ckpt_installed_arm(self, request: dict[str, Any]) -> dict[str, Any]:
        """Before a checked sync streams (installed-weight checks, `vllm/installed.py`): record where
        checkpoint regions land in this model if not yet, and digest the coming load's layers."""
        self._ckpt_arm(request)
        return {"armed": True}

    def ckpt_installed(self, request: dict[str, Any]) -> dict[str, Any]:
        """This worker's digests of what it installed, in vLLM's layout (an `InstalledReport`'s wire form)."""
        return self._ckpt_core().installed(InstalledRequest.from_wire(request)).to_wire()

    def ckpt_param_digests(self) -> dict[str, str]:
        """sha256 of the bytes of every parameter and buffer this worker's model holds, by vLLM's
        own names and in its own layout (fused, sliced, quantized as installed): what two engines
        that should hold the same weights compare, whatever loaded them."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        out = {}
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            data = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
            out[name] = hashlib.sha256(data.tobytes()).hexdigest()
        return out

    def ckpt_health(self) -> dict[str, Any]:
        """This worker's state. Under `CKPT_ENGINE_PEER_AHEAD`, the first probe of a fresh worker
        (no version, no group, nothing staged or loading: an engine just started, as registering
        asks it) makes a peer join's prepare first (`ckpt_peer_prepare`, kept `AHEAD_KEEP_S`), said
        under `join_ahead`, so that the join finds it made (docs/elastic.md, "A joiner made ahead")."""
        core = self._ckpt_core()
        ahead = _join_ahead(core)
        return {"pid": os.getpid(), "rank": self._ckpt_rank(), **core.health(), **({"join_ahead": ahead} if ahead is not None else {})}

    # --- staged syncs: receive while the engine steps, swap between two steps (vllm/staging.py) ---
    def ckpt_stage(self, digest: str, ticket: str, delta: dict[str, Any] | None = None, installed: dict[str, Any] | None = None) -> dict[str, Any]:
        """Start receiving an accepted manifest on a background thread of this worker (`installed`:
        armed first, as for `ckpt_receive`); returns at once.
        Its end is reported under `ticket` in the group's rendezvous store (`vllm/stage_outcome.py`)."""
        store, rank = self._ckpt_outcomes
        check_ticket(ticket)
        if installed is not None:
            self._ckpt_arm(installed)
        return self._ckpt_core().stage(digest, delta, on_end=lambda error: report_outcome(store, ticket, rank, error))

    def ckpt_stage_status(self) -> dict[str, Any]:
        """This worker's staged receive: {"done", "error", "report"} (the trainer reads the report once it ended)."""
        return self._ckpt_core().stage_status()

    def ckpt_swap(self, version: int) -> dict[str, Any]:
        """Load the staged version into the live weights (between two engine steps) and stamp `version`."""
        return self._ckpt_core().swap(int(version))

    def ckpt_discard(self) -> dict[str, Any]:
        return self._ckpt_core().discard()

    def ckpt_staging_room(self, nbytes: int, limit_bytes: int | None = None) -> dict[str, Any]:
        """Whether a staging copy of `nbytes` fits on this worker: {"room", "why"}."""
        return self._ckpt_core().staging_room(int(nbytes), limit_bytes)

    # --- peer joins: offer the served version's image, or stage a pull of a peer's (vllm/peer.py) ---
    # Each peer call names its caller's weight-sync group (`owner`, None: none); while another group
    # claimed this worker it is refused by name and changes nothing (`VllmPeer.caller`).
    def ckpt_peer_claim(self, owner: str, lease_s: float) -> dict[str, Any]:
        """Make weight-sync group `owner` the only caller of this worker's peer calls for `lease_s`,
        renewed by its calls; refused while another group holds the claim (`engine_lease.py`)."""
        self._ckpt_core().peer.lease.claim(owner, lease_s)
        return {"owner": owner}

    def ckpt_peer_release(self, owner: str) -> bool:
        return self._ckpt_core().peer.lease.release(owner)

    def ckpt_peer_offer(self, version: int, open_s: float, owner: str | None = None) -> str:
        """An offer of `version` (base64: the HTTP route carries JSON); refused unless this worker keeps its image."""
        return base64.b64encode(self._ckpt_core().peer.caller(owner).offer(int(version), float(open_s))).decode("ascii")

    def ckpt_peer_check(self, offer: bytes | str, owner: str | None = None) -> None:
        self._ckpt_core().peer.caller(owner).source.check(_offer_bytes(offer))

    def ckpt_peer_done(self, offer_id: int, owner: str | None = None) -> None:
        self._ckpt_core().peer.caller(owner).source.done(int(offer_id))

    def ckpt_peer_prepare(self, keep_s: float, owner: str | None = None) -> dict[str, Any]:
        """Before the peer's offer comes: the pull's NIXL agent started on a thread while the
        loaders' copies are recorded here (`prepare_loads`: a failure there allocates nothing and
        closes the agent), then the staging copy allocated in this model's checkpoint shapes and
        registered with it (`VllmPeer.prepare`); kept `keep_s` unless the pull takes it or
        `ckpt_peer_unprepare` comes first. A prepare made ahead (`ckpt_health` under
        `CKPT_ENGINE_PEER_AHEAD`) is found held: its agent and slab are kept, nothing is made again."""
        core = self._ckpt_core()
        core.peer.caller(owner)
        return _prepare_join(core, float(keep_s))

    def ckpt_peer_unprepare(self, owner: str | None = None) -> bool:
        """Release a prepare no pull took (deregistered, what it allocated freed); whether one was held."""
        return self._ckpt_core().peer.caller(owner).prep.release()

    def ckpt_peer_pull(self, offer: bytes | str, version: int, peer: str, read_timeout_s: float, owner: str | None = None) -> dict[str, Any]:
        """Start staging a pull of `peer`'s offer; its end shows in `ckpt_stage_status`, then `ckpt_swap`."""
        core = self._ckpt_core()
        core.peer.caller(owner)
        return core.peer_pull(_offer_bytes(offer), int(version), str(peer), float(read_timeout_s))

    # --- adapter-only syncs (LoRA versions in vLLM's own LoRA manager: vllm/lora_worker.py) ---
    def _ckpt_lora_core(self, max_versions: int | None = None) -> Any:
        from ckpt_engine.rollout_adapters.vllm.lora_worker import VllmLoraCore

        core = getattr(self, "_ckpt_lora", None)
        if core is None:
            runner = self.model_runner  # type: ignore[attr-defined]
            core = self._ckpt_lora = VllmLoraCore(runner.get_model, self.vllm_config, max_versions if max_versions is not None else 2)  # type: ignore[attr-defined]
        elif max_versions is not None:
            core.core.set_max_versions(max_versions)
        return core.core

    def ckpt_lora_join(
        self, rendezvous: dict[str, Any], rank_offset: int, options: dict[str, Any], max_versions: int, preload: bool = True
    ) -> dict[str, Any]:
        """`preload`: install each version under its own LoRA id at finalize (False behind the OpenAI
        server, whose `/v1/load_lora_adapter` loads it under the server's id)."""
        rank = int(rank_offset) + self._ckpt_rank()
        core = self._ckpt_lora_core(int(max_versions))
        self._ckpt_lora.preload = bool(preload)
        core.join(rendezvous, rank, options)
        return {"pid": os.getpid(), "rank": rank}

    def ckpt_lora_leave(self) -> None:
        self._ckpt_lora_core().leave()

    def ckpt_lora_validate(self, encoded: bytes | str | None, digest: str) -> dict[str, Any]:
        return self._ckpt_lora_core().validate(unbase64(encoded), digest)

    def ckpt_lora_receive(self, digest: str, delta: dict[str, Any] | None = None) -> dict[str, Any]:
        return self._ckpt_lora_core().receive(digest, delta)

    def ckpt_lora_finalize(self, version: int) -> dict[str, Any]:
        return self._ckpt_lora_core().finalize(int(version))

    def ckpt_lora_installed_arm(self, request: dict[str, Any]) -> dict[str, Any]:
        """Before a checked adapter sync streams: its LoRA slots are compared at the install (`vllm/lora_installed.py`)."""
        self._ckpt_lora_core()
        self._ckpt_lora.installed_arm(InstalledRequest.from_wire(request))
        return {"armed": True}

    def ckpt_lora_installed(self, request: dict[str, Any]) -> dict[str, Any]:
        """The received adapter as vLLM's `LoRAModel` holds it, digested (an `InstalledReport`'s wire form)."""
        self._ckpt_lora_core()
        return self._ckpt_lora.installed(InstalledRequest.from_wire(request)).to_wire()

    def ckpt_lora_health(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "rank": self._ckpt_rank(), **self._ckpt_lora_core().health()}


AHEAD_KEEP_S = 3600.0
"""How long a join's prepare made ahead (`ckpt_health` under `CKPT_ENGINE_PEER_AHEAD`) is kept
unless a pull takes it or a group join, a leave or a join's end releases it: its staging slab is a
model-sized copy on the worker's device."""


def _prepare_join(core: VllmReceiverCore, keep_s: float) -> dict[str, Any]:
    """A peer join's prepare in this worker (see `ckpt_peer_prepare`): the agent beside the loaders'
    dry run, then the staging slab allocated and registered."""
    if core.reload.is_open:
        raise RuntimeError("a peer join's prepare refused: a sync is loading into this worker")
    peer = core.peer
    peer.prep.start_agent()
    try:
        loads_s = core.prepare_loads()
    except BaseException:
        peer.prep.release()
        raise
    made = peer.prepare(keep_s, specs=core.specs(), staging=core.staging, device=core.device)
    return {**made, "loads_s": loads_s}


def _join_ahead(core: VllmReceiverCore) -> dict[str, Any] | None:
    """Under `CKPT_ENGINE_PEER_AHEAD`, once per worker: a fresh worker's join prepared now (None:
    not asked, or not fresh). A failure is said, not raised: the join then prepares as without it."""
    peer = core.peer
    if not peer.source.ahead or peer.ahead_tried:
        return None
    peer.ahead_tried = True
    if core.version is not None or core.receiver.group is not None or core.staging.running or core.staging.version is not None or core.reload.is_open:
        return None
    t0 = time.perf_counter()
    try:
        made = _prepare_join(core, AHEAD_KEEP_S)
    except Exception as exc:
        logger.warning("a peer join's prepare made ahead failed (a join prepares itself): %s", exc)
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.perf_counter() - t0}
    t_made = time.perf_counter()
    # What it made lives until the join (the slab's 9,435 views for a 30B-A3B, the loaders' record):
    # frozen out of the collector's scans as vLLM freezes its worker's heap after its warm-up, so a
    # full collection mid-join does not walk them (one of 0.1 s was seen in a 2xH200 join).
    gc.collect()
    gc.freeze()
    seconds = time.perf_counter() - t0
    logger.info("a peer join prepared ahead of any join in %.3f s (%s)", seconds, made)
    return {**made, "seconds": seconds, "gc_freeze_s": seconds - (t_made - t0)}


_ANSWERING: set[Callable[..., Any]] = set()


def _answering(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn`, answering its failure (logged here with its stack) instead of raising it."""
    if fn in _ANSWERING:
        return fn

    @functools.wraps(fn)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(self, *args, **kwargs)
        except Exception as exc:
            logger.exception("ckpt-engine worker call %s failed", fn.__name__)
            return {FAILED: f"{type(exc).__name__}: {exc}"}

    _ANSWERING.add(method)
    return method


def _answer_failures(cls: type) -> None:
    for name, value in list(vars(cls).items()):
        if name.startswith("ckpt_") and inspect.isfunction(value):
            setattr(cls, name, _answering(value))


_answer_failures(CkptEngineWorkerExtension)


def _offer_bytes(offer: bytes | str) -> bytes:
    decoded = unbase64(offer)
    if decoded is None:
        raise ValueError("no offer given")
    return decoded


def agrees(report: dict[str, Any] | None, source: dict[str, Any]) -> bool:
    """Whether a worker's installed report (wire form; None: none rode on the receive) agrees with the source's digests."""
    if report is None:
        return False
    fast = agreeing(report, source)
    return fast if fast is not None else InstalledReport.from_wire(report).agrees(InstalledReport.from_wire(source))
