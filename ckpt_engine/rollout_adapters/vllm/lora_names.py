"""How requests name the adapter versions a vLLM engine holds: `LoraVersions`, which the LoRA
handle (`vllm/lora.py`) holds, whatever its channel (the worker extension, vLLM's weight-transfer
API); behind vLLM's OpenAI server it registers each version by name
(`ServerLoraNames`), in process it names it with a `LoRARequest`.

vLLM's OpenAI front resolves `model=<name>` through its own registry, filled only by
`/v1/load_lora_adapter` (mounted with `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`). After every worker
holds a version in memory, the controller registers it as `<engine>-v<version>` with the
`ckpt-engine://` path that names it; the server's `add_lora` reaches every worker at once, each
builds the model from the tensors it holds (`vllm/lora_worker.py`). A worker keeps at most
`max_adapter_versions`, so names older than the newest `max_adapter_versions` are unregistered.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ckpt_engine.rollout_adapters.vllm.clients import HTTPWeightSyncClient

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest

__all__ = ["LoraVersions", "ServerLoraNames", "SlotCheck"]

logger = logging.getLogger(__name__)

SlotCheck = Callable[[int, Callable[[], None]], list[str]]
"""(version, activate) -> the workers' LoRA slot problems of `version` (`served_slot_problems` in `vllm/lora.py`)."""

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

    def activate(self, version: int) -> None:
        """One `max_tokens=1` completion naming `version`: vLLM activates it into its LoRA slots."""
        body = {"model": self.name(version), "prompt": [0], "max_tokens": 1, "temperature": 0.0}
        resp = self.http.post(f"{self.base_url}/v1/completions", json=body, timeout=self.timeout_s)
        if resp.status_code != 200:
            raise RuntimeError(f"engine {self.engine!r}: a completion naming {self.name(version)} answered {resp.status_code}: {resp.text[:500]}")

    def unregister(self, version: int) -> None:
        """Stop serving `version`'s name (a version whose check failed)."""
        if version in self.registered:
            self._unregister(version)

    def _unregister(self, version: int) -> None:
        name = self.registered.pop(version)
        resp = self.http.post(f"{self.base_url}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=self.timeout_s)
        if resp.status_code not in (200, 404):
            logger.warning("engine %s: unregistering %s answered %s: %s", self.engine, name, resp.status_code, resp.text[:200])


class LoraVersions:
    """The newest adapter version of one engine and how a request names it: `lora_request()` (an
    in-process `LLM`) or `model_name()` (vLLM's OpenAI server, where `installed` registers each
    version by name; `client` is the server's channel). Keeps at most `max_adapter_versions` names."""

    def __init__(self, engine: str, max_adapter_versions: int, client: Any) -> None:
        if isinstance(max_adapter_versions, bool) or not isinstance(max_adapter_versions, int) or max_adapter_versions < 1:
            raise ValueError(f"max_adapter_versions must be an int >= 1, got {max_adapter_versions!r}")
        self.engine = engine
        self.max_adapter_versions = max_adapter_versions
        self.version: int | None = None
        self.names: ServerLoraNames | None = None
        if isinstance(client, HTTPWeightSyncClient):
            self.names = ServerLoraNames(engine, client.base_url, client.http, client.timeout, max_adapter_versions)

    def check_routes(self) -> None:
        """Behind the OpenAI server: fail with the fix when it cannot register adapters."""
        if self.names is not None:
            self.names.check_routes()

    def installed(self, version: int, slot_problems: SlotCheck | None = None) -> None:
        """Every worker holds `version`: it is the newest (registered by name behind the server).
        Behind the server `slot_problems(version, activate)` is asked once the name is registered
        (vLLM activates the version into its LoRA slots there; `activate` makes it if not): any
        problem unregisters the name again and fails, naming them; the newest stays as it was."""
        if self.names is not None:
            self.names.register(version)
            names = self.names
            problems = [] if slot_problems is None else slot_problems(version, lambda: names.activate(version))
            if problems:
                names.unregister(version)
                raise RuntimeError(f"adapter version {version} not served (its name unregistered): {'; '.join(problems[:10])}")
        self.version = version

    def lora_request(self) -> LoRARequest:
        """The `LoRARequest` of the newest version (an in-process `LLM`: `generate(..., lora_request=...)`)."""
        from vllm.lora.request import LoRARequest

        from ckpt_engine.rollout_adapters.vllm.lora_worker import lora_int_id, lora_path

        if self.version is None:
            raise RuntimeError(f"engine {self.engine!r} holds no adapter version yet: sync one first")
        return LoRARequest(f"{self.engine}-v{self.version}", lora_int_id(self.version), lora_path(self.engine, self.version))

    def model_name(self) -> str:
        """The OpenAI `model` of the newest version (vLLM's OpenAI server)."""
        if self.names is None:
            raise RuntimeError(f"engine {self.engine!r} is an in-process LLM: name versions with lora_request()")
        return self.names.newest()

    def take_over(self, previous: LoraVersions) -> None:
        self.version = previous.version
        if self.names is not None and previous.names is not None:
            self.names.registered = dict(previous.names.registered)
