"""`VllmServerLoraRollout`: adapter-only syncs into vLLM's OpenAI `api_server` started with LoRA.

Start the server as for `VllmServerRollout` (`VLLM_SERVER_DEV_MODE=1`, `--worker-extension-cls`)
plus `--enable-lora --max-lora-rank R --max-loras N` and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1` (the
`/v1/load_lora_adapter` route). Each sync installs the adapter as a new version in every worker's
memory (`vllm_lora_worker.py`, no disk), then registers it with the server under the name
`<engine>-v<version>` (`/v1/load_lora_adapter`, whose `add_lora` reaches every worker at once: the
switch is atomic across ranks). Clients ask for it with `model=<that name>` (`model_name()`); a
request keeps the LoRA id the server gave its name on arrival, so it finishes under its version.
Names of versions the workers dropped (after their last request) are unregistered at the next sync.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ckpt_engine.rollout_adapters.base import JoinOptions
from ckpt_engine.rollout_adapters.vllm import VllmServerRollout
from ckpt_engine.rollout_adapters.vllm_lora import LORA_METHODS
from ckpt_engine.transports.base import Rendezvous

__all__ = ["VllmServerLoraRollout"]

logger = logging.getLogger(__name__)

_ROUTE_MISSING = '"detail":"Not Found"'
"""FastAPI's answer for a route the server did not mount (vLLM's own 404s carry an `error` object)."""


class VllmServerLoraRollout(VllmServerRollout):
    """Handle on a LoRA-enabled dev-mode `api_server` for adapter syncs; versions are served by name."""

    weights = "adapters"

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
        self.registered: dict[int, str] = {}
        """Version -> the name the server serves it under (this handle's registrations)."""

    def _rpc(self, method: str, timeout_s: float | None = None, **kwargs: Any) -> list[Any]:
        return super()._rpc(LORA_METHODS.get(method, method), timeout_s, **kwargs)

    def lora_name(self, version: int) -> str:
        return f"{self.name}-v{version}"

    def model_name(self) -> str:
        """The OpenAI `model` of the newest adapter version (new requests name it)."""
        if self.version is None or self.version not in self.registered:
            raise RuntimeError(f"engine {self.name!r} serves no adapter version yet: sync one first")
        return self.registered[self.version]

    def join(self, rendezvous: Rendezvous, rank_offset: int, options: JoinOptions) -> None:
        """Check the server can register adapters, then join every worker (no preload: the server
        loads each version under its own LoRA id)."""
        self._check_lora_routes()
        self._sent_digest = None
        results = self._rpc(
            "ckpt_lora_join", rendezvous=rendezvous.to_dict(), rank_offset=rank_offset, options=options.to_dict(),
            max_versions=self.max_adapter_versions, preload=False,
        )
        self.pids = [int(r["pid"]) for r in results]

    def _check_lora_routes(self) -> None:
        resp = self.http.post(f"{self.base_url}/v1/unload_lora_adapter", json={"lora_name": f"{self.name}-probe"}, timeout=min(self.timeout_s, 10.0))
        if resp.status_code == 404 and _ROUTE_MISSING in resp.text.replace(" ", ""):
            raise RuntimeError(
                f"engine {self.name!r}: the vLLM server has no /v1/load_lora_adapter route; start it with --enable-lora "
                "and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 for adapter syncs"
            )

    def pause(self, mode: str) -> None:
        """Nothing to pause: a sync never touches an adapter version a request uses."""

    def resume(self) -> None:
        """Nothing was paused."""

    def finalize(self, version: int) -> None:
        """Install the received adapter as `version` on every worker, register its name with the
        server (new requests may name it from then on), then unregister names of dropped versions."""
        from ckpt_engine.rollout_adapters.vllm_lora_worker import lora_path

        t0 = time.perf_counter()
        replies = self._rpc("ckpt_finalize", version=version)
        t1 = time.perf_counter()
        name = self.lora_name(version)
        body = {"lora_name": name, "lora_path": lora_path(self.name, version), "load_inplace": False}
        resp = self.http.post(f"{self.base_url}/v1/load_lora_adapter", json=body, timeout=self.timeout_s)
        if resp.status_code == 400 and "has already been loaded" in resp.text:
            # A name left by an earlier controller: reload it in place from this sync's tensors.
            resp = self.http.post(f"{self.base_url}/v1/load_lora_adapter", json={**body, "load_inplace": True}, timeout=self.timeout_s)
        if resp.status_code != 200:
            raise RuntimeError(f"engine {self.name!r}: POST /v1/load_lora_adapter {name} answered {resp.status_code}: {resp.text[:500]}")
        self.registered[version] = name
        self.version = version
        t2 = time.perf_counter()
        live = set.intersection(*(set(int(v) for v in r["live"]) for r in replies))
        for old in [v for v in self.registered if v not in live and v != version]:
            self._unregister(old)
        self.last_finalize = {
            "install_s": max(float(r["install_s"]) for r in replies), "finalize_rpc_s": t1 - t0, "register_s": t2 - t1,
        }

    def _unregister(self, version: int) -> None:
        name = self.registered.pop(version)
        resp = self.http.post(f"{self.base_url}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=self.timeout_s)
        if resp.status_code not in (200, 404):
            logger.warning("engine %s: unregistering %s answered %s: %s", self.name, name, resp.status_code, resp.text[:200])

    def take_over(self, previous: Any) -> None:
        super().take_over(previous)
        if isinstance(previous, VllmServerLoraRollout):
            self.registered = dict(previous.registered)
