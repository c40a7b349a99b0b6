"""`VllmNativeLoraRollout`: adapter-only syncs through vLLM's weight-transfer API (the native backend).

The engine runs `--weight-transfer-config '{"backend": "ckpt_engine"}'` and `--enable-lora` (no
worker extension). The workers join with `weights: adapters` (`CkptEngineInitInfo`), so one sync is:
  validate  start_weight_update + update_weights({"phase": "validate", ...})   nothing moves
  receive   update_weights({"phase": "receive", ...})                          into staging
  finalize  update_weights({"phase": "install", "version"}) + finish_weight_update(version)
Nothing is paused: a request keeps the version it started with. vLLM drops every loaded LoRA
model when a weight update finishes; the workers rebuild a version from the tensors they hold
when a request names it (`vllm/lora_worker.py`). Requests name the newest version with
`lora_request()` (an in-process `LLM`) or `model=model_name()` (vLLM's OpenAI server; the
controller registers each version by name there, `vllm/lora_names.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ckpt_engine.rollout_adapters.vllm.clients import HTTPWeightSyncClient
from ckpt_engine.rollout_adapters.vllm.lora_names import ServerLoraNames
from ckpt_engine.rollout_adapters.vllm.native import VllmNativeRollout
from ckpt_engine.engine import Rendezvous
from ckpt_engine.rollout_adapters.base import JoinOptions
from ckpt_engine.rollout_adapters.capabilities import EngineCapabilities

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest

__all__ = ["VllmNativeLoraRollout"]


class VllmNativeLoraRollout(VllmNativeRollout):
    """One LoRA-enabled vLLM engine through vLLM's weight-transfer API, for adapter syncs."""

    capabilities = EngineCapabilities(delta=True, weights="adapters")
    """No staging: an adapter sync already lands beside the serving version (phase `install` makes
    it newest)."""

    def __init__(self, client: Any, *, name: str = "vllm", num_workers: int = 1, max_adapter_versions: int = 2) -> None:
        if isinstance(max_adapter_versions, bool) or not isinstance(max_adapter_versions, int) or max_adapter_versions < 1:
            raise ValueError(f"max_adapter_versions must be an int >= 1, got {max_adapter_versions!r}")
        super().__init__(client, name=name, num_workers=num_workers)
        self.max_adapter_versions = max_adapter_versions
        self.version: int | None = None
        self.names: ServerLoraNames | None = None
        if isinstance(client, HTTPWeightSyncClient):
            self.names = ServerLoraNames(name, client.base_url, client.http, client.timeout, max_adapter_versions)

    def _init_extra(self) -> dict[str, Any]:
        return {"weights": "adapters", "max_adapter_versions": self.max_adapter_versions}

    def join(self, rendezvous: Rendezvous, rank_offset: int, options: JoinOptions) -> None:
        if self.names is not None:
            self.names.check_routes()
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
        if self.names is not None:
            self.names.register(version)
        self.version = version

    def lora_request(self) -> LoRARequest:
        """The `LoRARequest` of the newest version (an in-process `LLM`: `generate(..., lora_request=...)`)."""
        from vllm.lora.request import LoRARequest

        from ckpt_engine.rollout_adapters.vllm.lora_worker import lora_int_id, lora_path

        if self.version is None:
            raise RuntimeError(f"engine {self.name!r} holds no adapter version yet: sync one first")
        return LoRARequest(f"{self.name}-v{self.version}", lora_int_id(self.version), lora_path(self.name, self.version))

    def model_name(self) -> str:
        """The OpenAI `model` of the newest version (vLLM's OpenAI server)."""
        if self.names is None:
            raise RuntimeError(f"engine {self.name!r} is an in-process LLM: name versions with lora_request()")
        return self.names.newest()
