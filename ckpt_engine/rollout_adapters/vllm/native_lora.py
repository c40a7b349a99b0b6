"""`VllmNativeLoraRollout`: adapter-only syncs through vLLM's weight-transfer API (the native backend).

The engine runs `--weight-transfer-config '{"backend": "ckpt_engine"}'` and `--enable-lora` (no
worker extension). The workers join with `weights: adapters` (`CkptEngineInitInfo`), so one sync is:
  validate  start_weight_update + update_weights({"phase": "validate", ...})   nothing moves
  receive   update_weights({"phase": "receive", ...})                          into staging
  finalize  update_weights({"phase": "install", "version"}) + finish_weight_update(version)
Nothing is paused: a request keeps the version it started with. vLLM drops every loaded LoRA
model when a weight update finishes; the workers rebuild a version from the tensors they hold
when a request names it (`vllm/lora_worker.py`). Requests name the newest version as with the
worker extension's handle (`LoraVersions`, `vllm/lora_names.py`): `lora_request()` in process,
`model=model_name()` behind vLLM's OpenAI server (each version registered by name there).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ckpt_engine.engine import Rendezvous
from ckpt_engine.rollout_adapters.base import JoinOptions
from ckpt_engine.rollout_adapters.capabilities import EngineCapabilities
from ckpt_engine.rollout_adapters.vllm.lora_names import LoraVersions
from ckpt_engine.rollout_adapters.vllm.native import VllmNativeRollout

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest

__all__ = ["VllmNativeLoraRollout"]


class VllmNativeLoraRollout(VllmNativeRollout):
    """One LoRA-enabled vLLM engine through vLLM's weight-transfer API, for adapter syncs."""

    capabilities = EngineCapabilities(delta=True, weights="adapters")
    """No staging: an adapter sync already lands beside the serving version (phase `install` makes
    it newest)."""

    def __init__(self, client: Any, *, name: str = "vllm", num_workers: int = 1, max_adapter_versions: int = 2) -> None:
        self.versions = LoraVersions(name, max_adapter_versions, client)
        super().__init__(client, name=name, num_workers=num_workers)
        self.max_adapter_versions = max_adapter_versions
        self.version: int | None = None

    def _init_extra(self) -> dict[str, Any]:
        return {"weights": "adapters", "max_adapter_versions": self.max_adapter_versions}

    def join(self, rendezvous: Rendezvous, rank_offset: int, options: JoinOptions) -> None:
        self.versions.check_routes()
        super().join(rendezvous, rank_offset, options)

    def pause(self, mode: str) -> None:
        """Nothing to pause: a sync never touches an adapter version a request uses."""

    def resume(self) -> None:
        """Nothing was paused."""

    def finalize(self, version: int) -> None:
        """Every worker installs the staged adapter as `version`; then the update closes and (behind
        the OpenAI server) the version is registered by name. New requests get it from then on."""
        self._phase({"phase": "install", "digest": self._worker_digest, "version": str(version)})
        self._finish(str(version))
        self.versions.installed(version)
        self.version = version

    def lora_request(self) -> LoRARequest:
        """The `LoRARequest` of the newest version (an in-process `LLM`: `generate(..., lora_request=...)`)."""
        return self.versions.lora_request()

    def model_name(self) -> str:
        """The OpenAI `model` of the newest version (vLLM's OpenAI server)."""
        return self.versions.model_name()
