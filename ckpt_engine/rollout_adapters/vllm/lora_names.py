"""`ServerLoraNames`: the names under which vLLM's OpenAI server serves ckpt-engine adapter versions.

vLLM's OpenAI front resolves `model=<name>` through its own registry, filled only by
`/v1/load_lora_adapter` (mounted with `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`). After every worker
holds a version in memory, the controller registers it as `<engine>-v<version>` with the
`ckpt-engine://` path that names it; the server's `add_lora` reaches every worker at once, each
builds the model from the tensors it holds (`vllm/lora_worker.py`). A worker keeps at most
`max_adapter_versions`, so names older than the newest `max_adapter_versions` are unregistered.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["ServerLoraNames"]

logger = logging.getLogger(__name__)

_ROUTE_MISSING = '"detail":"Not Found"'
"""FastAPI's answer for a route the server did not mount (vLLM's own 404s carry an `error` object)."""


class ServerLoraNames:
    """Register / unregister adapter versions by name on one vLLM server (its HTTP session)."""

    def __init__(self, engine: str, base_url: str, http: Any, timeout_s: float, keep: int) -> None:
        self.engine = engine
        self.base_url = base_url.rstrip("/")
        self.http = http
        self.timeout_s = timeout_s
        self.keep = keep
        self.registered: dict[int, str] = {}
        """Version -> the name the server serves it under (this controller's registrations)."""

    def name(self, version: int) -> str:
        return f"{self.engine}-v{version}"

    def newest(self) -> str:
        if not self.registered:
            raise RuntimeError(f"engine {self.engine!r} serves no adapter version yet: sync one first")
        return self.registered[max(self.registered)]

    def check_routes(self) -> None:
        """Fail with the fix when the server cannot register adapters (before anything moves)."""
        resp = self.http.post(f"{self.base_url}/v1/unload_lora_adapter", json={"lora_name": f"{self.engine}-probe"}, timeout=min(self.timeout_s, 10.0))
        if resp.status_code == 404 and _ROUTE_MISSING in resp.text.replace(" ", ""):
            raise RuntimeError(
                f"engine {self.engine!r}: the vLLM server has no /v1/load_lora_adapter route; start it with --enable-lora "
                "and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 for adapter syncs"
            )

    def register(self, version: int) -> str:
        """Serve `version` (every worker holds it) as `<engine>-v<version>`; drop names past `keep`."""
        from ckpt_engine.rollout_adapters.vllm.lora_worker import lora_path

        name = self.name(version)
        body = {"lora_name": name, "lora_path": lora_path(self.engine, version), "load_inplace": False}
        resp = self.http.post(f"{self.base_url}/v1/load_lora_adapter", json=body, timeout=self.timeout_s)
        if resp.status_code == 400 and "has already been loaded" in resp.text:
            # A name left by an earlier controller: reload it in place from this sync's tensors.
            resp = self.http.post(f"{self.base_url}/v1/load_lora_adapter", json={**body, "load_inplace": True}, timeout=self.timeout_s)
        if resp.status_code != 200:
            raise RuntimeError(f"engine {self.engine!r}: POST /v1/load_lora_adapter {name} answered {resp.status_code}: {resp.text[:500]}")
        self.registered[version] = name
        for old in sorted(self.registered)[: -self.keep]:
            self._unregister(old)
        return name

    def _unregister(self, version: int) -> None:
        name = self.registered.pop(version)
        resp = self.http.post(f"{self.base_url}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=self.timeout_s)
        if resp.status_code not in (200, 404):
            logger.warning("engine %s: unregistering %s answered %s: %s", self.engine, name, resp.status_code, resp.text[:200])
