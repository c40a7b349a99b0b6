"""The receiving core inside a vLLM worker, shared by both ways vLLM reaches ckpt-engine.

The worker extension (`vllm/worker.py`, for any vLLM with `worker_extension_cls`) and the native
weight-transfer backend (`vllm/transfer_engine.py`, for vLLM's `WeightTransferEngine` API) differ
only in how vLLM calls them; joining the weight-sync group, checking a manifest against vLLM's own
parameters, loading buckets through layerwise reload and finalizing all live here, once.

Its parts: what the model takes (`vllm/specs.py`, one object per model), vLLM's layerwise reload (`vllm/reload.py`),
the staged version (`vllm/staging.py`) and region landing (`vllm/region_landing.py`). A tensor vLLM's loaders
keep past its bucket (its layer still incomplete) is cloned once: the receive buffer is refilled next.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ckpt_engine.installed import InstalledReport, InstalledRequest
from ckpt_engine.manifest import ManifestBudget
from ckpt_engine.planning.fused_experts import fuse_plan
from ckpt_engine.planning.regions import ReceivePlan, Region
from ckpt_engine.rollout_adapters.receiver import WeightReceiver
from ckpt_engine.rollout_adapters.region_assembler import RegionAssembler, held_bytes
from ckpt_engine.rollout_adapters.vllm.background_receive import ReceiveThread
from ckpt_engine.rollout_adapters.vllm.direct_load import DirectLoads, direct_enabled, with_direct
from ckpt_engine.rollout_adapters.vllm.installed import InstalledCapture, LandingMap, layout_names
from ckpt_engine.rollout_adapters.vllm.peer import VllmPeer
from ckpt_engine.rollout_adapters.vllm.region_landing import RegionItem, RegionLanding
from ckpt_engine.rollout_adapters.vllm.plan_cache import PlanSource, kept_receive_plan
from ckpt_engine.rollout_adapters.vllm.regions import PlanRecording
from ckpt_engine.rollout_adapters.vllm.reload import LayerwiseReload, detach_pending
from ckpt_engine.rollout_adapters.vllm.shadow import ShadowPreparer
from ckpt_engine.rollout_adapters.vllm.specs import VllmSpecs, load_weights_of
from ckpt_engine.rollout_adapters.vllm.staging import OnEnd, Prepare, Sink, StagedReceive, Staging

__all__ = ["VllmReceiverCore", "unbase64"]

logger = logging.getLogger(__name__)


class VllmReceiverCore:
    """One vLLM worker's receiving state: group membership, accepted manifest, open reload, version.

    `model` is called each time (the native backend may retarget its model); `runner`, when given,
    is the worker's model runner whose LoRA/encoder/multimodal caches are reset on finalize.
    Every method runs in the worker process, called by vLLM on every worker rank.
    """

    def __init__(self, model: Callable[[], torch.nn.Module], vllm_config: Any, device: str | torch.device | None, runner: Any = None) -> None:
        self._model = model
        self.vllm_config = vllm_config
        self.runner = runner
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.receiver = WeightReceiver(device=self.device)
        self._specs: tuple[int, VllmSpecs] | None = None
        self._plan: tuple[int, ReceivePlan, dict[str, str]] | None = None
        self.version: Any = None
        self.reload = LayerwiseReload(model, vllm_config)
        self.stale = False
        self.last_report: dict[str, Any] | None = None
        self.staging = Staging()
        self._landed: tuple[int, ReceivePlan, PlanRecording] | None = None
        """Where each checkpoint region lands in this model (installed-weight checks, direct loads): the dry run's record."""
        self._direct: tuple[int, DirectLoads | None] | None = None
        self._armed: InstalledCapture | None = None
        self._landings: tuple[PlanRecording, LandingMap] | None = None
        """The landing map of the current model's dry run and the layout read at the first check since the
        last join (kept: its checks' live views are kept with it, `vllm/installed.py`)."""
        self.plan_source: PlanSource | None = None
        """How the current model's dry run was had (`vllm/plan_cache.py`: kept on disk or recorded)."""
        self._regions_used = False
        self.peer = VllmPeer()
        """Peer joins (`vllm/peer.py`): the image of the served version it offers, the pulls it stages."""
        self._alias: tuple[str, int, dict[str, str]] | None = None  # (digest, specs id, {embedding: the tied head it loads as})
        self._background = ReceiveThread(self.device)
        """The parked thread unstaged receives run on (`receive_begin`, collected by `receive_end`), started at the first."""

    # --- group -------------------------------------------------------------------------------
    def join(self, rendezvous: dict[str, Any], rank: int, options: dict[str, Any]) -> None:
        """Join the weight-sync group as `rank` (collective with the sender and every worker)."""
        self.receiver.join(rendezvous, rank, options)
        self._landings = None  # the layout is read again at the first check after a join (a tensor added since is named)

    def leave(self) -> None:
        self._disarm()
        self.reload.close()
        self.receiver.leave()
        self.peer.close()  # before the staging copy it offers is freed
        self.staging.discard(drop_copy=True)

    # --- validate ----------------------------------------------------------------------------
    def specs(self) -> VllmSpecs:
        """What the current model takes, built once per model."""
        model = self._model()
        if self._specs is None or self._specs[0] != id(model):
            self._specs = (id(model), VllmSpecs.of(model))
        return self._specs[1]

    def validate(self, encoded: bytes | str | None, digest: str, regions: bytes | str | None = None) -> dict[str, Any]:
        """Check a manifest against this worker's parameters; nothing moves. `encoded` may be base64.
        `regions`: this worker's region assignment (region delivery; may be base64).

        Returns `{"accepted", "need_manifest", "problems"}` (see WeightReceiver.validate).
        """
        try:
            encoded, regions = unbase64(encoded), unbase64(regions)
        except binascii.Error as exc:
            return {"accepted": False, "need_manifest": False, "problems": [f"corrupt manifest or region assignment: not base64 ({exc})"]}
        specs = self.specs()
        # Both checks read only the manifest and this model's frozen specs: a manifest accepted for
        # them is accepted again without its tensors walked (every sync of a session, same digest).
        return self.receiver.validate(encoded, digest, specs.accepts, extra_check=specs.stacked_whole, regions=regions, remember=True)

    # --- receive plan ------------------------------------------------------------------------
    def manifest_budget(self) -> dict[str, int]:
        """What an honest manifest for this worker's model can hold (`ManifestBudget`, as a map): a
        process that decodes manifests on the engine's behalf (the Ray engine actor) sizes its own
        decode by it."""
        return dataclasses.asdict(ManifestBudget.expecting(self.specs().accepts.values(), senders=self.receiver.senders))

    def receive_plan(self) -> dict[str, Any]:
        """This worker's receive plan, recorded once per model from vLLM's own loaders (a dry run;
        never while a reload is open). Returns {"plan": wire form, "bytes", "model_bytes", "whole"};
        {"plan": None, "error"} when the dry run failed (the worker then receives whole tensors)."""
        self._close_failed_reload()
        model = self._model()
        specs = self.specs()
        # A tied head is the embedding's parameter: it is loaded from the embedding's regions (see
        # `receive`), so a trainer may leave it out.
        needed = specs.needed
        if self._plan is None or self._plan[0] != id(model):
            if holds_whole_model(self.vllm_config):  # no dry run: it would find every name read whole
                self._plan = (id(model), ReceivePlan({n: None for n in needed}), {})
            else:
                try:
                    plan, rec, self.plan_source = kept_receive_plan(model, needed, self.vllm_config)
                except Exception as exc:  # this worker keeps today's full receive
                    logger.warning("receive plan: recording failed (%s: %s); this worker receives whole tensors", type(exc).__name__, exc)
                    return {"plan": None, "error": f"{type(exc).__name__}: {exc}"[:500]}
                self._plan = (id(model), plan, dict(rec.whole))
                self._landed = (id(model), plan, rec)
        _, plan, whole = self._plan
        model_bytes = held_bytes(ReceivePlan({n: None for n in needed}), needed)
        out = {"plan": plan.to_wire(), "bytes": held_bytes(plan, specs.specs), "model_bytes": model_bytes, "whole": whole}
        stated: ReceivePlan | None = plan
        if len(plan.holds) == len(needed) and all(rs is None for rs in plan.holds.values()):
            out["plan"] = None  # holds everything whole (no TP / EP): receive as without a plan
            stated = None
        self.receiver.set_plan(stated)
        return out

    def land(self, items: Iterable[tuple[str, Region | None, torch.Tensor]], *, poison: bool = False) -> int:
        """Load region items (no transport) through layerwise reload and finalize; the recorded plan
        says which regions make each name. Returns the names loaded."""
        if self._plan is None:
            raise RuntimeError("call receive_plan() first")
        model, specs = self._model(), self.specs()
        plan = self._plan[1]
        self.peer.clear()
        assembler = RegionAssembler(plan, specs.specs, self.device, poison=poison)
        alias = {emb: head for head, emb in specs.tied.items() if emb in plan.holds}
        self.reload.open()
        loaded = 0
        try:
            with self.reload.loading():
                for name, region, tensor in items:
                    ready = assembler.add(name, region, tensor)
                    if ready:
                        load_weights_of(model)(ready + [(alias[n], t) for n, t in ready if n in alias])
                        loaded += len(ready)
            if assembler.incomplete():
                raise RuntimeError(f"regions missing for {assembler.incomplete()[:5]}")
        finally:
            self.reload.close()
        return loaded

    # --- receive and load ---------------------------------------------------------------------
    def receive(
        self, digest: str, delta: dict[str, Any] | None = None, begun: float | None = None, queued: Callable[[], None] | None = None,
    ) -> dict[str, Any]:
        """Receive every bucket of an accepted manifest and load it; layerwise reload stays open
        until `finalize` (or is closed here if the receive fails, never leaving meta layers).

        `delta` (a controller's delta request): patches land in this worker's base copy, are
        checked, and the full tensors then load through the same layerwise reload. `begun`: when
        `receive_begin` handed it over (`perf_counter`); the report's `start_s` counts from there."""
        begun = begun if begun is not None else time.perf_counter()
        self._check_not_staging("receive")
        self.peer.clear()
        self.staging.discard()
        self.reload.close()
        direct = self._direct_loads()
        load_weights = with_direct(load_weights_of(self._model()), direct, self.reload.loading)
        copied = direct.copied if direct is not None else 0
        detached = [0]
        scanned: dict[int, Any] = {}  # detach_pending's walk of the layers' held loads, across this reload's buckets
        held = not self.reload.in_place()  # in place, no layerwise reload holds loads between buckets: no walk (~10 us a tensor)

        def load(loadable: list[tuple[str, torch.Tensor]]) -> None:
            if not self.reload.is_open:  # opened at the first bucket, while the next one is in flight (issue 39: 0.9 of
                self.reload.open()  # the 1.1 ms a tiny Qwen2's receive took on the CPU box before its first bucket)
            load_weights(loadable)
            if held:
                detached[0] += detach_pending(loadable, scanned)

        if self._armed is not None and queued is not None and self.reload.in_place():  # the check's fold right behind the last copies
            queued = self._armed.launching(queued)
        self.stale = True
        try:
            out = self._stream(digest, delta, load, begun=begun, queued=queued if delta is None else None)
        except BaseException:
            self.reload.close()
            raise
        out["detached_bytes"] = detached[0]
        out["loads_in_place"] = float(self.reload.in_place())  # 1: no layerwise reload (the worker logs why not, once)
        out["direct_tensors"] = direct.copied - copied if direct is not None else 0
        if self._armed is not None and self.reload.in_place():  # installed as it will serve: the report rides back now
            out["installed"] = self.installed(self._armed.request).to_wire()
        self.last_report = out
        return out

    def receive_begin(self, digest: str, delta: dict[str, Any] | None = None, quiet_s: float | None = None) -> dict[str, Any]:
        """`receive` on this worker's parked receive thread (`vllm/background_receive.py`): answers at
        once, or, with `quiet_s`, once a burst of copy launches out of a colocated sender's tensors
        is queued (or the receive ended), so the handle's reset beside the copies does not hold the
        interpreter lock against them. `quiet` False: the wait ran past `quiet_s`."""
        if self._background.running:
            raise RuntimeError("a receive is already running on this worker")
        self._check_not_staging("receive")
        if self.receiver.accepted_manifest(digest) is None:
            raise RuntimeError(f"manifest {digest[:12]} was not validated on this worker; call validate() first")
        begun, background = time.perf_counter(), self._background
        burst = self.receiver.engine is not None and self.receiver.engine.maps_sender_memory
        background.start(lambda: self.receive(digest, delta, begun, background.copies_queued if burst else None), quiet=not burst)
        quiet = not burst or quiet_s is None or background.quiet_within(quiet_s)  # past it: the receive's end says what held it
        return {"started": True, "burst": burst, "quiet": quiet}

    def receive_end(self, timeout_s: float) -> dict[str, Any]:
        """The answer of the receive `receive_begin` started (its error raised here); a receive
        still running past the bound stays begun, to be refused by the next begin."""
        return self._background.result(timeout_s)

    def _stream(
        self, digest: str, delta: dict[str, Any] | None, sink: Sink, staged: StagedReceive | None = None, begun: float | None = None,
        queued: Callable[[], None] | None = None,
    ) -> dict[str, Any]:
        """Take every bucket of an accepted manifest and hand `sink` its loadable pairs (a tied
        head the trainer did not send rides along as its embedding's tensor). Returns the report.
        `staged`: a staged receive, which keeps region items as they are (the swap lands them).
        `queued`: called once `sink` has taken the manifest's last tensor (a region delivery: never)."""
        specs = self.specs()
        tied = specs.tied
        accepted = self.receiver.accepted_manifest(digest)
        # A tied head the trainer did not send is loaded from its embedding, or layerwise reload
        # would put the old head back. Worked out once per manifest and model (a 30B-A3B manifest's
        # 18,867 names walked every sync: 0.6 ms before the first bucket is taken).
        if self._alias is None or self._alias[:2] != (digest, id(specs)):
            sent = {e.name for b in accepted.buckets for e in b.entries} if accepted is not None else set()  # not `.specs`: no spec built per tensor
            self._alias = (digest, id(specs), {emb: head for head, emb in tied.items() if head not in sent and emb in sent})
        alias = self._alias[2]

        total = accepted.num_tensors if queued is not None and accepted is not None else 0
        left = [total]  # tensors still to hand over; a provisional offer's buckets that come again count on below zero

        def load(pairs: list[tuple[str, torch.Tensor]]) -> int:
            left[0] -= len(pairs)
            pairs = specs.unstack(pairs)
            sink(pairs + [(alias[n], t) for n, t in pairs if n in alias] if alias else pairs)
            if total and left[0] <= 0 and left[0] % total == 0 and queued is not None:  # each whole pass (a check's fold behind the last)
                queued()
            return len(pairs)

        # Regions only for a sync whose assignment this worker accepted: with a plan recorded, a session
        # may still send whole tensors (an engine beside it takes no regions, or the handle opts out),
        # and a staged receive that kept regions would then swap in nothing.
        plan = self.receiver.regions.plan if self.receiver.regions.has(digest) else None
        self._regions_used = plan is not None
        landing: RegionLanding | None = None
        region_loader: Callable[[list[RegionItem]], int] | None = None
        if plan is not None and accepted is not None:
            # Region delivery: a tied head comes only as its embedding.
            fused = fuse_plan(plan, accepted.specs)
            region_alias = {emb: head for head, emb in tied.items() if emb in plan.holds}

            def make(device: torch.device, into: Sink) -> RegionLanding:
                return RegionLanding(plan, fused, specs.accepts, device, specs.unstack, region_alias, into)

            if staged is None:
                landing = make(self.device, sink)
                region_loader = landing.load
            else:
                landing, region_loader = staged.keep_regions(make)

        with torch.no_grad():
            start_s = time.perf_counter() - begun if begun is not None else None  # the worker's setup before the first bucket
            # a bucket may come twice (a provisional colocated offer) into the live parameters, not into a reload
            repeatable = staged is None and delta is None and self.reload.in_place()
            report = self.receiver.receive(digest, load, delta=delta, region_loader=region_loader, repeatable=repeatable)
        if landing is not None and landing.incomplete():
            raise RuntimeError(f"region delivery ended with regions missing for {landing.incomplete()[:5]}")
        return {**report.to_dict(), **({"start_s": start_s} if start_s is not None else {})}

    # --- staged receive and swap (see vllm/staging.py) ------------------------------------------
    def stage(self, digest: str, delta: dict[str, Any] | None = None, on_end: OnEnd | None = None) -> dict[str, Any]:
        """Start receiving an accepted manifest on a background thread, into staging; the live
        weights, the version and the engine's steps are untouched. Returns at once; `on_end` is told
        when the receive ended (None: whole and checked, else why it failed)."""
        self._check_not_staging("staged receive")
        if self.receiver.accepted_manifest(digest) is None:
            raise RuntimeError(f"manifest {digest[:12]} was not validated on this worker; call validate() first")
        self.peer.clear()  # the staging copy is about to change
        self.staging.discard()
        # With a delta request the base images (whole tensors or regions) hold the checked version
        # until the next receive: keep their views. Else each tensor or region is copied as it lands.
        keep_views = delta is not None
        self._direct_loads()  # recorded now (once per model), not in the swap between two steps
        self.staging.start(digest, lambda staged: self._stream(digest, delta, staged.sink, staged), keep_views, self._preparer(), on_end)
        return {"started": True}

    def _preparer(self) -> Prepare | None:
        """A model that loads in place has no post-processing to take off the step path: no shadow."""
        return None if self.reload.in_place() else ShadowPreparer(self._model, self.vllm_config, self.device, self.staging.shadow_room)

    def prepare_loads(self) -> float:
        """Record now, not inside a pull, the copies this model's loaders make (`_direct_loads`: a
        dry run of vLLM's loaders over every checkpoint tensor, once per model, kept): a joiner's
        prepare runs it while the peer makes its offer. Returns its seconds (~0 once recorded)."""
        t0 = time.perf_counter()
        self._direct_loads()
        return time.perf_counter() - t0

    def peer_pull(self, offer: bytes, version: int, peer: str, read_timeout_s: float) -> dict[str, Any]:
        """Stage a pull of `version` from `peer`'s offer (`vllm/peer.py`): checked against this
        model first (a bad offer is refused before anything is allocated), read on a background
        thread into the staging copy while the engine steps; the controller polls and swaps."""
        self._check_not_staging("a peer pull")
        if self.reload.is_open:
            raise RuntimeError("a peer pull refused: a sync is loading into this worker")
        self._direct_loads()
        self.peer.start_pull(offer, version, peer, read_timeout_s, specs=self.specs(), staging=self.staging,
                             device=self.device, held=self.version, prepare=self._preparer())
        return {"started": True}

    def stage_status(self) -> dict[str, Any]:
        """Whether the staged receive ended: {"done", "error", "report"} (report once done)."""
        return self.staging.status()

    def swap(self, version: Any) -> dict[str, Any]:
        """Load the staged version into the live weights through layerwise reload and stamp
        `version`. Runs between two engine steps (a `collective_rpc` call), on every rank at once."""
        staged = self.staging.take()  # raises unless a whole checked version is staged
        model = self._model()
        self.reload.close()
        t0 = time.perf_counter()
        self.stale = True  # until the last layer is loaded: a failure here leaves a mix
        if staged.shadow is not None:  # prepared off the step path: a copy (vllm/shadow.py); swap_in runs before finalize
            shadow = {"shadow": True, "shadow_layers": staged.shadow.num_layers, "shadow_bytes": staged.shadow.nbytes,
                      "shadow_build_s": staged.shadow.build_s}
            out = {"load_s": staged.shadow.swap_in(), **shadow, **self.finalize(version), "swap_s": time.perf_counter() - t0}
            self.peer.installed(version, staged, self.specs())
            return out
        load_weights = with_direct(load_weights_of(model), self._direct_loads(), self.reload.loading)
        self.reload.open()
        try:
            with self.reload.loading():
                staged.load(load_weights, self.device)
        except BaseException:
            self.reload.close()
            raise
        load_s = time.perf_counter() - t0
        out = self.finalize(version)
        out.update(swap_s=time.perf_counter() - t0, load_s=load_s)
        self.peer.installed(version, staged, self.specs())
        return out

    def discard(self) -> dict[str, Any]:
        """Drop a staged version (after a failed stream elsewhere); the live weights are untouched."""
        return {"discarded": self.staging.discard()}

    def staging_room(self, nbytes: int, limit_bytes: int | None = None) -> dict[str, Any]:
        fits, why = self.staging.room(int(nbytes), self.device, limit_bytes)
        return {"room": fits, "why": why}

    def _check_not_staging(self, what: str) -> None:
        if self.staging.running:
            raise RuntimeError(f"{what} refused: a staged receive is still streaming on this worker")

    # --- installed-weight checks (vllm/installed.py) -------------------------------------------
    def installed_arm(self, request: InstalledRequest) -> None:
        """Before a checked sync streams: record where regions land if not yet (a dry run of the loaders, once
        per model; never while a reload is open), and digest each layer of the load before vLLM post-processes it."""
        self._disarm()
        self._armed = InstalledCapture(self._model(), self._landing_map(), request)
        if not self.reload.in_place():  # a model that loads in place never post-processes: nothing to hook
            self._armed.install()

    def expect_installed(self, source: Any) -> None:
        """The armed check's source digests (wire form), told while it receives (`InstalledCapture.expect`)."""
        if self._armed is not None:
            self._armed.expect(source)

    def installed(self, request: InstalledRequest) -> InstalledReport:
        """This worker's digests of what it installed for `request` (armed: as its layers loaded;
        else read now from the live tensors, where post-processing left them readable)."""
        armed = self._armed
        self._disarm()
        if armed is not None and armed.request == request:
            return armed.report(whole_only=not self._regions_used)
        if self._landed is None or self._landed[0] != id(self._model()):  # never armed: no dry run in the middle of a sync
            return InstalledReport(unchecked=[f"{n} (this worker was not armed for the check)" for n in request.names])
        return InstalledCapture(self._model(), self._landing_map(), request).report(whole_only=not self._regions_used)

    def _close_failed_reload(self) -> None:
        """A sync that failed after its stream (an installed-weight check) leaves layerwise reload open
        and the worker stale, unstamped; the dry run needs it closed. Closing post-processes what that
        sync loaded: the worker stays stale (out of service) until a sync completes."""
        if self.reload.is_open:
            if self.staging.running:
                raise RuntimeError("cannot record a receive plan while a staged receive streams on this worker")
            logger.warning("closing the weight reload a failed sync left open (this worker stays stale until a sync completes)")
            self.reload.close()

    def _disarm(self) -> None:
        if self._armed is not None:
            self._armed.remove()
            self._armed = None

    def _landing_map(self) -> LandingMap:
        model = self._model()
        if self._landed is None or self._landed[0] != id(model):
            self._close_failed_reload()
            plan, rec, self.plan_source = kept_receive_plan(model, self.specs().needed, self.vllm_config)
            self._landed = (id(model), plan, rec)
        _, plan, rec = self._landed
        if self.reload.is_open:  # the layout is not read mid-load: no tensor named unwritten, nothing kept
            return LandingMap(rec.landings, [], rec.unfollowed, rec.touched, plan)
        if self._landings is None or self._landings[0] is not rec:
            self._landings = (rec, LandingMap(rec.landings, layout_names(model), rec.unfollowed, rec.touched, plan))
        return self._landings[1]

    def _direct_loads(self) -> DirectLoads | None:
        """The copies vLLM's loaders would make, made directly (`vllm/direct_load.py`): for a model
        that loads in place, built once per model from the dry run's record (None: vLLM loads all)."""
        if not direct_enabled():
            return None
        model = self._model()
        if self._direct is None or self._direct[0] != id(model):
            direct = None
            if self.reload.in_place():
                self._landing_map()
                assert self._landed is not None
                direct = DirectLoads(model, self._landed[2]) or None
            self._direct = (id(model), direct)
        return self._direct[1]

    def finalize(self, version: Any) -> dict[str, Any]:
        """Post-process what was loaded, reset the runner's weight-derived caches, stamp `version`."""
        seconds = self.reload.close()
        if self.runner is not None:
            for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
                fn = getattr(self.runner, reset, None)
                if fn is not None:
                    fn()
        self.version, self.stale = version, False
        return {"finalize_s": seconds, "version": version}

    def health(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "stale": self.stale,
            "group": self.receiver.group,
            "buckets_received": self.receiver.buckets_received,
            "last_report": self.last_report,
            "staged": self.staging.describe(),
            "staging_copy_bytes": self.staging.copy.nbytes,
            "version_from": self.peer.version_from(self.version),  # "trainer sync" or "peer pull from <peer>"
            "peer_image": self.peer.image.version,  # the version it can offer a joining peer (None: none)
        }


def holds_whole_model(vllm_config: Any) -> bool:
    """Whether this worker holds every tensor of the model whole: no tensor, pipeline, context or
    expert parallelism splits it. Its loaders then read each checkpoint tensor whole, so its receive
    plan is every name whole, and the dry run that would record it (every loader over every tensor,
    about as long as a load, in the first sync: bench/RESULTS.md) is skipped."""
    par = getattr(vllm_config, "parallel_config", None)
    sizes = ("world_size", "tensor_parallel_size", "pipeline_parallel_size", "prefill_context_parallel_size", "decode_context_parallel_size")
    return par is not None and all(getattr(par, k, 1) == 1 for k in sizes) and not getattr(par, "enable_expert_parallel", True)


def unbase64(value: bytes | str | None) -> bytes | None:
    """Bytes as sent in process, or base64 text as sent over HTTP (JSON carries no bytes)."""
    return base64.b64decode(value, validate=True) if isinstance(value, str) else value
