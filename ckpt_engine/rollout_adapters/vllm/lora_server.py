"""`VllmServerLoraRollout`: adapter-only syncs into vLLM's OpenAI `api_server` started with LoRA.

Start the server as for `VllmServerRollout` (`VLLM_SERVER_DEV_MODE=1`, `--worker-extension-cls`)
plus `--enable-lora --max-lora-rank R --max-loras N` and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1` (the
`/v1/load_lora_adapter` route). Each sync installs the adapter as a new version in every worker's
memory (`vllm/lora_worker.py`, no disk), then registers it with the server under the name
`<engine>-v<version>` (`vllm/lora_names.py`; the server's `add_lora` reaches every worker at once:
the switch is atomic across ranks). Clients ask for it with `model=<that name>` (`model_name()`);
a request keeps the LoRA id the server gave its name on arrival, so it finishes under its version.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from ckpt_engine.rollout_adapters.base import JoinOptions
from ckpt_engine.rollout_adapters.vllm.rollout import VllmServerRollout
from ckpt_engine.rollout_adapters.vllm.lora import LORA_METHODS, VllmLoraRollout
from ckpt_engine.rollout_adapters.vllm.lora_names import ServerLoraNames
from ckpt_engine.engine import Rendezvous

if TYPE_CHECKING:
    from ckpt_engine.planning.regions import ReceivePlan

__all__ = ["VllmServerLoraRollout"]


class VllmServerLoraRollout(VllmServerRollout):
    """Handle on a LoRA-enabled dev-mode `api_server` for adapter syncs; versions are served by name."""

    capabilities = VllmLoraRollout.capabilities
    """As `VllmLoraRollout`'s: an adapter installs only at finalize (no staging), and every worker
    receives the whole adapter (vLLM's LoRA layers cut each TP rank's slice)."""

    def receive_plans(self) -> list[ReceivePlan | None]:
        return [None] * self.world_size  # whole tensors; nothing recorded from the base model's loaders

    def __init__(
        self,
        name: str,
        base_url: str,
        *,
        max_adapter_versions: int = 2,
        timeout_s: float = 300.0,
        world_size: int | None = None,
        session: Any = None,
    ) -> None:
        if isinstance(max_adapter_versions, bool) or not isinstance(max_adapter_versions, int) or max_adapter_versions < 1:
            raise ValueError(f"max_adapter_versions must be an int >= 1, got {max_adapter_versions!r}")
        super().__init__(name, base_url, timeout_s=timeout_s, world_size=world_size, session=session)
        self.max_adapter_versions = max_adapter_versions
        self.names = ServerLoraNames(name, self.base_url, self.http, timeout_s, max_adapter_versions)

    def _rpc(self, method: str, timeout_s: float | None = None, **kwargs: Any) -> list[Any]:
        return super()._rpc(LORA_METHODS.get(method, method), timeout_s, **kwargs)

    def model_name(self) -> str:
        """The OpenAI `model` of the newest adapter version (new requests name it)."""
        return self.names.newest()

    def join(self, rendezvous: Rendezvous, rank_offset: int, options: JoinOptions) -> None:
        """Check the server can register adapters, then join every worker (no preload: the server
        loads each version under its own LoRA id)."""
        self.names.check_routes()
        self._sent_digest = None
        results = self._rpc(
            "ckpt_lora_join", rendezvous=rendezvous.to_dict(), rank_offset=rank_offset, options=options.to_dict(),
            max_versions=self.max_adapter_versions, preload=False,
        )
        self.pids = [int(r["pid"]) for r in results]

    def pause(self, mode: str) -> None:
        """Nothing to pause: a sync never touches an adapter version a request uses."""

    def resume(self) -> None:
        """Nothing was paused."""

    def finalize(self, version: int) -> None:
        """Install the received adapter as `version` on every worker, then register its name with
        the server (new requests may name it from then on)."""
        t0 = time.perf_counter()
        replies = self._rpc("ckpt_finalize", version=version)
        t1 = time.perf_counter()
        self.names.register(version)
        self.version = version
        self.last_finalize = {
            "install_s": max(float(r["install_s"]) for r in replies), "finalize_rpc_s": t1 - t0, "register_s": time.perf_counter() - t1,
        }

    def take_over(self, previous: Any) -> None:
        super().take_over(previous)
        if isinstance(previous, VllmServerLoraRollout):
            self.names.registered = dict(previous.names.registered)
