"""A vLLM engine started with ckpt-engine as its own weight-transfer backend, as a `RolloutAdapter`.

The engine runs `--weight-transfer-config '{"backend": "ckpt_engine"}'` (no worker extension);
this adapter drives it only through vLLM's weight-update calls (`VLLMWeightSyncClient`: its HTTP
routes or `LLM` methods, `vllm/clients.py`) plus pause, resume, prefix-cache reset and the weight
version when the client also offers them (`EngineControl`). A `WeightSyncSession` over it syncs
the engine like any other: versions, delta, dtype casts and the report work the same. The trainer
side of vLLM's own API (`sync/vllm_trainer_engine.py`) holds such a session.

One sync, as vLLM's calls see it:
  validate  start_weight_update + update_weights({"phase": "validate", ...})
  receive   update_weights({"phase": "receive", "digest", "version", "delta"})  (blocks while streaming)
  finalize  finish_weight_update(version) + reset_prefix_cache

Staged (issue 28, `checkpoint_engine.stage`; needs `EngineControl`), the engine keeps generating
while the version streams in, and pauses only for the swap:
  validate  as above
  receive   update_weights({"phase": "receive", ..., "stage", "ticket"})  starts a background receive
            on each worker and returns at once; each worker then sets its outcome (`ok`, or `failed:
            why`) under the ticket and its rank in the weight-sync group's rendezvous store, and
            this handle waits for every rank's key there (`vllm/stage_outcome.py`; no call to vLLM)
  swap      pause + update_weights({"phase": "swap", "version"}) (the staged version in, vLLM's
            post-load step) + finish_weight_update(version) + reset_prefix_cache + resume
  discard   update_weights({"phase": "discard"}) + finish_weight_update(): nothing staged, the old
            weights serve on, unpaused and not stale
vLLM returns nothing from its workers: "no room" comes back as an error (`vllm/transfer_engine.py`),
a staged receive's end through the rendezvous store (so no "not yet" errors fill vLLM's logs). vLLM
closes its weight update after an error, so this handle tracks whether
an update is open and opens the next (re-validating by digest where a receive needs it).
"""

from __future__ import annotations

import base64
import logging
import time
from dataclasses import replace
from collections.abc import Hashable
from typing import Any

from ckpt_engine.delta.request import DeltaRequest
from ckpt_engine.manifest import BucketManifest
from ckpt_engine.rollout_adapters.base import STAGES, JoinOptions, ManifestRejectedError, ReceiveReport, RolloutAdapter, version_of
from ckpt_engine.rollout_adapters.capabilities import EngineCapabilities
from ckpt_engine.rollout_adapters.vllm.clients import EngineControl, HTTPWeightSyncClient, LLMWeightSyncClient, SwapControl
from ckpt_engine.rollout_adapters.vllm.stage_outcome import StagedOutcomes
from ckpt_engine.rollout_adapters.vllm.answers import NEED_MANIFEST, NO_ROOM, REJECTED, after, problems
from ckpt_engine.engine import Rendezvous

__all__ = ["VllmNativeRollout"]

logger = logging.getLogger(__name__)

_NOT_CONFIGURED = "Weight transfer not configured"
"""What vLLM answers when the engine was started without a weight-transfer config."""
_PAUSE_MODES = ("keep", "abort", "recompute")
_UPDATE_ACTIVE = "while a weight update is already active"
"""What vLLM answers `start_weight_update` while an update is open: one that a trainer which died
mid-sync (its own handle, maybe its own process) never finished."""


class VllmNativeRollout(RolloutAdapter):
    """One vLLM engine (all `num_workers` of its worker ranks) through vLLM's weight-transfer API.

    Without `EngineControl` on the client the caller pauses and resets caches itself, and the
    engine cannot report its version (a session then counts from its own)."""

    capabilities = EngineCapabilities(delta=True, stages=True)
    """Delta: the workers keep base copies (VllmReceiverCore), as the worker extension does. Staged
    syncs through the phases above (the workers' `vllm/staging.py`); a handle whose client offers no
    `EngineControl` does not stage (it cannot pause for the swap nor reset the cache)."""

    def __init__(
        self, client: Any, *, name: str = "vllm", num_workers: int = 1, timeout_s: float = 300.0,
        staging_limit_bytes: int | None = None,
    ) -> None:
        if staging_limit_bytes is not None and (isinstance(staging_limit_bytes, bool) or not isinstance(staging_limit_bytes, int) or staging_limit_bytes < 0):
            raise ValueError(f"engine {name!r}: staging_limit_bytes must be a non-negative int or None, got {staging_limit_bytes!r}")
        self.client = client
        self.name = name
        self.world_size = num_workers
        self.timeout_s = timeout_s
        self.staging_limit_bytes = staging_limit_bytes
        self.control: EngineControl | None = client if isinstance(client, EngineControl) else None
        if self.control is None:  # this handle cannot swap between steps
            self.capabilities = replace(self.capabilities, stages=False)
        self._worker_digest: str | None = None
        self._encoded: bytes | None = None  # the manifest last validated (a re-validation may need it)
        self._open = False  # a vLLM weight update is open (vLLM closes it when update_weights raises)
        self._paused = False
        self._recompute = False  # pause_mode recompute: running requests re-prefill after the load
        self.last_finalize: dict[str, Any] = {}
        self.staged = StagedOutcomes(name, timeout_s)  # staged receives report their end in the group's store

    def engine_key(self) -> Hashable:
        """The engine behind the client: its URL, or the `LLM` object (else this handle)."""
        if isinstance(self.client, (HTTPWeightSyncClient, LLMWeightSyncClient)):
            return self.client.engine_key()
        return super().engine_key()

    def take_over(self, previous: RolloutAdapter) -> None:
        if isinstance(previous, VllmNativeRollout):
            self._worker_digest = previous._worker_digest
            self.staged.take_over(previous.staged)

    def held_version(self) -> int | None:
        return version_of(self.control.weight_version()) if self.control is not None else None

    def join(self, rendezvous: Rendezvous, rank_offset: int, options: JoinOptions) -> None:
        """`init_weight_transfer_engine` on every worker; an engine started without the
        weight-transfer config fails here at once, with the fix."""
        self._worker_digest = None
        self.staged.join(rendezvous, list(range(rank_offset, rank_offset + self.world_size)))
        init = {
            "rendezvous": rendezvous.to_dict(), "rank_offset": rank_offset, "options": options.to_dict(), "num_workers": self.world_size,
            **self._init_extra(),
        }
        try:
            self.client.init_weight_transfer_engine(init)
        except Exception as exc:
            if _NOT_CONFIGURED not in str(exc):
                raise
            raise RuntimeError(
                f"engine {self.name!r} was started without a weight-transfer config ({exc}); start it with "
                "--weight-transfer-config '{\"backend\": \"ckpt_engine\"}' (or LLM(..., weight_transfer_config="
                "{\"backend\": \"ckpt_engine\"}))"
            ) from exc

    def _init_extra(self) -> dict[str, Any]:
        """More `CkptEngineInitInfo` fields (the adapter-sync subclass sets `weights`)."""
        return {}

    def validate(self, manifest: BucketManifest, encoded: bytes) -> None:
        """Open an update and have every worker check the manifest; the manifest travels only when
        the workers may not hold it yet (first sync, new plan, or a worker that asks for it)."""
        full = base64.b64encode(encoded).decode("ascii")
        send = None if self._worker_digest == manifest.digest else full
        self._encoded = encoded
        for attempt in range(2):
            self._start()
            try:
                self.client.update_weights({"phase": "validate", "digest": manifest.digest, "manifest": send})
            except Exception as exc:  # vLLM closes the update when update_weights raises
                self._open = False
                text = str(exc)
                if attempt == 0 and send is None and NEED_MANIFEST in text:
                    send = full
                    continue
                self._worker_digest = None
                if REJECTED in text:
                    raise ManifestRejectedError(self.name, problems(text)) from exc
                raise
            self._worker_digest = manifest.digest
            return

    def pause(self, mode: str) -> None:
        if mode == "none" or self.control is None:
            return
        self.control.pause(mode)
        self._paused = True
        self._recompute = mode == "recompute"

    # --- vLLM's weight update: open at most one, know when vLLM closed it ---------------------------
    def _start(self) -> None:
        """Open a vLLM weight update (closing one left open, e.g. validated for a sync that another
        engine refused: nothing was loaded in it, so finishing it loads nothing)."""
        if self._open:
            self._finish()
        try:
            self.client.start_weight_update()
        except Exception as exc:
            if _UPDATE_ACTIVE not in str(exc):
                raise
            # A trainer died mid-sync and left its update open; vLLM would refuse every update from
            # now on. Nothing staged in it reached the live weights (the next receive drops it), and
            # a half-loaded unstaged one left the engine stale for a dense sync: close it, open ours.
            logger.warning("engine %s: closing a weight update that a trainer left open (it died mid-sync?)", self.name)
            self.client.finish_weight_update(None)
            self.client.start_weight_update()
        self._open = True

    def _phase(self, update: dict[str, Any]) -> None:
        """One `update_weights` call in an open update (opened here if vLLM closed the last one)."""
        if not self._open:
            self._start()
        try:
            self.client.update_weights(update)
        except BaseException:
            self._open = False  # vLLM ends its weight update when update_weights raises
            raise

    def _finish(self, version: str | None = None) -> None:
        self._open = False
        self.client.finish_weight_update(version)

    def _revalidate(self, manifest: BucketManifest) -> None:
        """A receive must follow a validate in the same vLLM update: if vLLM closed that update (an
        answer such as "no room" was an error), validate again (by digest: the workers hold it)."""
        if not self._open:
            if self._encoded is None:
                raise RuntimeError(f"engine {self.name!r}: receive before validate; call validate() first")
            self.validate(manifest, self._encoded)

    # --- receive ------------------------------------------------------------------------------------
    def receive(self, manifest: BucketManifest, delta: DeltaRequest | None = None, *, stage: str | None = None) -> ReceiveReport:
        """Receive and load `manifest` (the engine paused; blocks while it streams), or with `stage`
        receive it into the workers' staging on their background threads while the engine keeps
        generating, waiting until every worker reported it whole and checked (then `swap`)."""
        if stage is not None and (not self.capabilities.stages or stage not in STAGES):
            raise ValueError(f"engine {self.name!r}: stage must be one of {', '.join(STAGES)} or None (and the handle able to stage), got {stage!r}")
        t0 = time.perf_counter()
        self._revalidate(manifest)
        update: dict[str, Any] = {"phase": "receive", "digest": manifest.digest}
        if delta is not None:
            update["delta"] = delta.to_dict()
        if stage is None:
            self._phase(update)
        else:
            with self.staged.receiving() as ticket:  # from here a discard stops the wait (even one not started yet)
                self._phase({**update, "stage": stage, "ticket": ticket})  # may start on some workers only: discard clears
                outcomes = self.staged.wait(ticket)
            self.staged.check(outcomes, self.discard)
        seconds = time.perf_counter() - t0
        return ReceiveReport(manifest.num_tensors, manifest.total_bytes, seconds, seconds, manifest.num_tensors)

    # --- staged: room, swap, discard ----------------------------------------------------------------
    def staging_room(self, nbytes: int) -> bool:
        """Whether every worker can hold a dense staging copy of `nbytes` (within
        `staging_limit_bytes`); a "no" closes vLLM's update (the receive then validates again)."""
        if not self.capabilities.stages:
            return False
        try:
            self._phase({"phase": "room", "nbytes": int(nbytes), "limit_bytes": self.staging_limit_bytes})
        except Exception as exc:
            if NO_ROOM not in str(exc):
                raise
            logger.info("engine %s: no room for a staging copy (%s)", self.name, after(str(exc), NO_ROOM))
            return False
        return True

    def swap(self, version: int, pause_mode: str) -> float:
        """Between two engine steps: pause (`none` pauses as `keep`: vLLM labels a step's tokens
        with the version stamped by a second engine-core call, docs/staged-syncs.md), the swap phase
        (staged version in, post-load step) and the stamp (finish_weight_update), the prefix-cache
        reset, resume. Returns the seconds the engine produced nothing. A swap that fails leaves the
        engine paused (its weights may be a mix: stale)."""
        mode = pause_mode if pause_mode != "none" else "keep"
        if mode not in _PAUSE_MODES:
            raise ValueError(f"engine {self.name!r}: pause_mode must be one of {', '.join(_PAUSE_MODES)} or none, got {pause_mode!r}")
        if self.control is None:
            raise RuntimeError(f"engine {self.name!r}: a staged swap needs a client with EngineControl (pause, resume, cache reset)")
        digest = self._worker_digest if self._worker_digest is not None else ""
        quick = self.client if isinstance(self.client, SwapControl) else None
        t0 = time.perf_counter()
        (quick.pause_for_swap if quick is not None else self.control.pause)(mode)
        t_paused = time.perf_counter()
        self._phase({"phase": "swap", "digest": digest, "version": str(version)})
        t_loaded = time.perf_counter()
        self._finish(str(version))  # vLLM stamps the version; the workers load nothing more
        self.control.reset_prefix_cache(running=mode == "recompute")
        t1 = time.perf_counter()
        (quick.resume_after_swap if quick is not None else self.control.resume)()
        stall = time.perf_counter() - t0
        self.last_finalize = {"swap_pause_s": t_paused - t0, "swap_load_s": t_loaded - t_paused, "swap_rpc_s": t1 - t_paused, "stall_s": stall}
        return stall

    def discard(self) -> None:
        """Drop a staged version on every worker and close vLLM's update; the live weights, the
        version and the engine's steps are untouched (a no-op with nothing staged). A staged receive
        still waiting for the workers' outcomes on another thread stops waiting."""
        idle = self.staged.stop()
        try:
            self._phase({"phase": "discard"})
            self._finish()
        finally:
            self.staged.clear(idle)

    def finalize(self, version: int) -> None:
        """Layerwise post-processing and the version (vLLM stamps it), then the prefix cache."""
        self._finish(str(version))
        if self.control is not None:
            self.control.reset_prefix_cache(running=self._recompute)

    def resume(self) -> None:
        if self._paused and self.control is not None:
            self.control.resume()
        self._paused = False

    def health(self) -> dict[str, Any]:
        """Raises when the engine does not answer (asked for its version, when the client can)."""
        return {"version": self.control.weight_version()} if self.control is not None else {}

    def leave(self) -> None:
        self.staged.leave()  # a wait in flight lets go of the store before the group's store goes away
        self._worker_digest = None
        if self._open:  # vLLM refuses to shut the transfer engine down inside an update
            self._finish()
        self.client.shutdown_weight_transfer_engine()

