"""`VllmLoraRollout`: adapter-only syncs into an in-process `vllm.LLM` started with LoRA enabled.

Start vLLM with `enable_lora=True`, `max_lora_rank` >= the adapter's rank, `max_loras` >=
`max_adapter_versions` (so old and new versions batch together) and the worker extension. Each
sync installs the adapter as a new version in every worker's LoRA manager (from memory:
`vllm/lora_worker.py`); only once every worker holds it does `lora_request()` name it, so the
switch is atomic across the engine's ranks. Nothing is paused: running requests keep the version
they started with (their `LoRARequest` names it) and finish under it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from ckpt_engine.rollout_adapters.base import JoinOptions
from ckpt_engine.rollout_adapters.capabilities import EngineCapabilities
from ckpt_engine.rollout_adapters.vllm.rollout import VllmRollout
from ckpt_engine.engine import Rendezvous

if TYPE_CHECKING:
    import vllm
    from vllm.lora.request import LoRARequest

    from ckpt_engine.planning.regions import ReceivePlan

__all__ = ["LORA_METHODS", "VllmLoraRollout"]

LORA_METHODS = {
    "ckpt_validate": "ckpt_lora_validate",
    "ckpt_receive": "ckpt_lora_receive",
    "ckpt_finalize": "ckpt_lora_finalize",
    "ckpt_health": "ckpt_lora_health",
    "ckpt_leave": "ckpt_lora_leave",
}


class VllmLoraRollout(VllmRollout):
    """Handle on an `LLM(..., enable_lora=True, worker_extension_cls=WORKER_EXTENSION)` for adapter syncs."""

    capabilities = EngineCapabilities(delta=True, many_senders=True, weights="adapters")
    """No staging: an adapter sync already installs only at finalize (the received tensors wait in
    the workers' LoRA stage). No regions: every worker receives the whole adapter (a few MB); vLLM's
    LoRA layers cut each TP rank's slice themselves when the version is installed."""

    def receive_plans(self) -> list[ReceivePlan | None]:
        """None for every worker (whole tensors); no plan is recorded from the base model's loaders."""
        return [None] * self.world_size

    def __init__(self, name: str, llm: vllm.LLM, *, max_adapter_versions: int = 2, timeout_s: float = 300.0) -> None:
        super().__init__(name, llm, timeout_s=timeout_s)
        lora = llm.llm_engine.vllm_config.lora_config
        if lora is None:
            raise ValueError(f"engine {name!r}: vLLM was started without LoRA; start it with enable_lora=True for adapter syncs")
        if isinstance(max_adapter_versions, bool) or not isinstance(max_adapter_versions, int) or max_adapter_versions < 1:
            raise ValueError(f"max_adapter_versions must be an int >= 1, got {max_adapter_versions!r}")
        self.max_adapter_versions = max_adapter_versions
        self._request: LoRARequest | None = None

    def _rpc(self, method: str, timeout_s: float | None = None, **kwargs: Any) -> list[Any]:
        return super()._rpc(LORA_METHODS.get(method, method), timeout_s, **kwargs)

    def join(self, rendezvous: Rendezvous, rank_offset: int, options: JoinOptions) -> None:
        self._sent_digest = None
        results = self._rpc(
            "ckpt_lora_join", rendezvous=rendezvous.to_dict(), rank_offset=rank_offset, options=options.to_dict(),
            max_versions=self.max_adapter_versions,
        )
        self.pids = [int(r["pid"]) for r in results]

    def pause(self, mode: str) -> None:
        """Nothing to pause: a sync never touches an adapter version a request uses."""

    def resume(self) -> None:
        """Nothing was paused."""

    def finalize(self, version: int) -> None:
        """Install + activate the received adapter as `version` on every worker, then name it in
        `lora_request()` (new requests get it from then on)."""
        from vllm.lora.request import LoRARequest

        from ckpt_engine.rollout_adapters.vllm.lora_worker import lora_int_id, lora_path

        t0 = time.perf_counter()
        replies = self._rpc("ckpt_finalize", version=version)
        self._request = LoRARequest(f"{self.name}-v{version}", lora_int_id(version), lora_path(self.name, version))
        self.version = version
        self.last_finalize = {"install_s": max(float(r["install_s"]) for r in replies), "finalize_rpc_s": time.perf_counter() - t0}

    def lora_request(self) -> LoRARequest:
        """The `LoRARequest` of the newest adapter version (pass it to `LLM.generate(..., lora_request=...)`)."""
        if self._request is None:
            raise RuntimeError(f"engine {self.name!r} holds no adapter version yet: sync one first")
        return self._request

    def take_over(self, previous: Any) -> None:
        super().take_over(previous)
        if isinstance(previous, VllmLoraRollout):
            self._request = previous._request
