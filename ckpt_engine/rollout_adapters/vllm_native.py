"""A vLLM engine started with ckpt-engine as its own weight-transfer backend, as a `RolloutAdapter`.

The engine runs `--weight-transfer-config '{"backend": "ckpt_engine"}'` (no worker extension);
this adapter drives it only through vLLM's weight-update calls (`VLLMWeightSyncClient`: its HTTP
routes or `LLM` methods, `vllm_clients.py`) plus pause, resume, prefix-cache reset and the weight
version when the client also offers them (`EngineControl`). A `WeightSyncSession` over it syncs
the engine like any other: versions, delta, dtype casts and the report work the same. The trainer
side of vLLM's own API (`sync/vllm_trainer_engine.py`) holds such a session.

One sync, as vLLM's calls see it:
  validate  start_weight_update + update_weights({"phase": "validate", ...})
  receive   update_weights({"phase": "receive", "digest", "version", "delta"})  (blocks while streaming)
  finalize  finish_weight_update(version) + reset_prefix_cache
"""

from __future__ import annotations

import base64
import logging
import time
from collections.abc import Hashable
from typing import Any, ClassVar

from ckpt_engine.delta.request import DeltaRequest
from ckpt_engine.manifest import BucketManifest
from ckpt_engine.rollout_adapters.base import JoinOptions, ManifestRejectedError, ReceiveReport, RolloutAdapter, version_of
from ckpt_engine.rollout_adapters.vllm_clients import EngineControl, HTTPWeightSyncClient, LLMWeightSyncClient
from ckpt_engine.rollout_adapters.vllm_transfer_engine import NEED_MANIFEST, REJECTED
from ckpt_engine.transports.base import Rendezvous

__all__ = ["VllmNativeRollout"]

logger = logging.getLogger(__name__)

_NOT_CONFIGURED = "Weight transfer not configured"
"""What vLLM answers when the engine was started without a weight-transfer config."""


class VllmNativeRollout(RolloutAdapter):
    """One vLLM engine (all `num_workers` of its worker ranks) through vLLM's weight-transfer API.

    Without `EngineControl` on the client the caller pauses and resets caches itself, and the
    engine cannot report its version (a session then counts from its own)."""

    supports_delta = True  # the workers keep base copies (VllmReceiverCore), as the worker extension does
    stages: ClassVar[bool] = False
    """No staged syncs here: vLLM's weight-transfer calls return nothing from the workers, so a
    background receive cannot be polled (the worker extension's adapters stage)."""

    def __init__(self, client: Any, *, name: str = "vllm", num_workers: int = 1) -> None:
        self.client = client
        self.name = name
        self.world_size = num_workers
        self.control: EngineControl | None = client if isinstance(client, EngineControl) else None
        self._worker_digest: str | None = None
        self._paused = False
        self._recompute = False  # pause_mode recompute: running requests re-prefill after the load

    def engine_key(self) -> Hashable:
        """The engine behind the client: its URL, or the `LLM` object (else this handle)."""
        if isinstance(self.client, HTTPWeightSyncClient):
            return ("vllm-http", self.client.base_url)
        if isinstance(self.client, LLMWeightSyncClient):
            return ("vllm", id(self.client.llm))
        return super().engine_key()

    def take_over(self, previous: RolloutAdapter) -> None:
        if isinstance(previous, VllmNativeRollout):
            self._worker_digest = previous._worker_digest

    def held_version(self) -> int | None:
        return version_of(self.control.weight_version()) if self.control is not None else None

    def join(self, rendezvous: Rendezvous, rank_offset: int, options: JoinOptions) -> None:
        """`init_weight_transfer_engine` on every worker; an engine started without the
        weight-transfer config fails here at once, with the fix."""
        self._worker_digest = None
        init = {"rendezvous": rendezvous.to_dict(), "rank_offset": rank_offset, "options": options.to_dict(), **self._init_extra()}
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
        for attempt in range(2):
            self.client.start_weight_update()
            try:
                self.client.update_weights({"phase": "validate", "digest": manifest.digest, "manifest": send})
            except Exception as exc:  # vLLM closes the update when update_weights raises
                text = str(exc)
                if attempt == 0 and send is None and NEED_MANIFEST in text:
                    send = full
                    continue
                self._worker_digest = None
                if REJECTED in text:
                    raise ManifestRejectedError(self.name, _problems(text)) from exc
                raise
            self._worker_digest = manifest.digest
            return

    def pause(self, mode: str) -> None:
        if mode == "none" or self.control is None:
            return
        self.control.pause(mode)
        self._paused = True
        self._recompute = mode == "recompute"

    def receive(self, manifest: BucketManifest, delta: DeltaRequest | None = None) -> ReceiveReport:
        t0 = time.perf_counter()
        update: dict[str, Any] = {"phase": "receive", "digest": manifest.digest}
        if delta is not None:
            update["delta"] = delta.to_dict()
        self.client.update_weights(update)
        seconds = time.perf_counter() - t0
        return ReceiveReport(manifest.num_tensors, manifest.total_bytes, seconds, seconds, manifest.num_tensors)

    def finalize(self, version: int) -> None:
        """Layerwise post-processing and the version (vLLM stamps it), then the prefix cache."""
        self.client.finish_weight_update(str(version))
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
        self._worker_digest = None
        self.client.shutdown_weight_transfer_engine()


def _problems(text: str) -> list[str]:
    """The worker's problem list out of an error that crossed vLLM's RPC (and maybe HTTP)."""
    start = text.index(REJECTED)
    tail = text[start + len(REJECTED) :]
    for end in ("\n", "\\n"):
        tail = tail.split(end, 1)[0]
    # The message ends at the last quote of the kind that opened it (repr(), vLLM's "error '...'",
    # or an escaped one inside JSON): a problem may hold quotes of its own ("the engine's").
    opener = text[start - 1] if start > 0 else ""
    if opener in ("'", '"'):
        closer = "\\" + opener if start > 1 and text[start - 2] == "\\" else opener
        tail = tail.rsplit(closer, 1)[0] if closer in tail else tail
    return [p.strip() for p in tail.split("; ") if p.strip()]
