"""Engine kinds: how the daemon turns a registration's engine descriptor into a RolloutAdapter.

An engine registers by describing how to reach it, e.g. `{"kind": "torch_ref", "host": "10.0.0.5",
"port": 41234}`. The kind names a factory `factory(name, params, timeout_s) -> RolloutAdapter`
that validates its own params (they came over the wire) and connects lazily. Built-ins are
registered by module path so importing the daemon never imports vLLM or SGLang; third parties
register with `register_engine_kind` or the `ckpt_engine.engine_kinds` entry-point group.
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from ckpt_engine.daemon.ownership import release_engine
from ckpt_engine.registry import LazyRegistry
from ckpt_engine.rollout_adapters.base import RolloutAdapter

__all__ = [
    "EngineKindRegistry", "close_in_background", "close_quietly", "make_adapter", "register_engine_kind", "torch_ref_factory", "vllm_factory",
    "vllm_lora_factory",
]

logger = logging.getLogger(__name__)

AdapterFactory = Callable[..., RolloutAdapter]
"""factory(name, params, timeout_s[, token=job token]) -> adapter; `token` is passed when accepted."""


class EngineKindRegistry(LazyRegistry):
    """kind name -> adapter factory, imported on first use."""

    what = "engine kind"
    group = "ckpt_engine.engine_kinds"
    _lazy: ClassVar[dict[str, str]] = {
        "torch_ref": "ckpt_engine.daemon.adapters:torch_ref_factory",
        "vllm": "ckpt_engine.daemon.adapters:vllm_factory",
        "vllm_lora": "ckpt_engine.daemon.adapters:vllm_lora_factory",
    }
    _classes: ClassVar[dict[str, AdapterFactory]] = {}
    _failed: ClassVar[dict[str, str]] = {}


def register_engine_kind(kind: str, factory: AdapterFactory | str) -> None:
    """Make `{"kind": kind, ...}` descriptors resolvable; `factory` may be "module:attr"."""
    EngineKindRegistry.add(kind, factory)


def make_adapter(name: str, descriptor: Mapping[str, Any], timeout_s: float, *, token: str | None = None) -> RolloutAdapter:
    """Build the adapter for a validated descriptor (`kind` plus that kind's params).

    `token` is the job token: engines whose control port demands it (torch_ref) get it; it never
    travels in the descriptor, which status shows."""
    params = {k: v for k, v in descriptor.items() if k != "kind"}
    factory = EngineKindRegistry.get(descriptor["kind"])
    try:
        takes_token = "token" in inspect.signature(factory).parameters
    except (TypeError, ValueError):
        takes_token = False
    adapter = factory(name, params, timeout_s, token=token) if takes_token else factory(name, params, timeout_s)
    if not isinstance(adapter, RolloutAdapter):
        raise TypeError(f"engine kind {descriptor['kind']!r} produced {type(adapter).__name__}, not a RolloutAdapter")
    return adapter


def _check_keys(kind: str, params: Mapping[str, Any], allowed: tuple[str, ...]) -> None:
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise ValueError(f"{kind} engine descriptor: unknown key(s) {', '.join(unknown)}; allowed: kind, {', '.join(allowed)}")


def torch_ref_factory(name: str, params: Mapping[str, Any], timeout_s: float, token: str | None = None) -> RolloutAdapter:
    """A reference receiver reachable at `host`:`port`, started with this job's token (the daemon does not own its process)."""
    from ckpt_engine.rollout_adapters.torch_ref import TorchRefRollout

    _check_keys("torch_ref", params, ("host", "port"))
    host, port = params.get("host"), params.get("port")
    if not isinstance(host, str) or not 0 < len(host) <= 255:
        raise ValueError(f"torch_ref engine descriptor: host must be a non-empty string, got {host!r:.80}")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"torch_ref engine descriptor: port must be an int in [1, 65535], got {port!r:.80}")
    return TorchRefRollout(name, host, port, None, timeout_s, token=token)


def vllm_factory(name: str, params: Mapping[str, Any], timeout_s: float) -> RolloutAdapter:
    """A vLLM `api_server` in dev mode with our worker extension, at `url` (http://host:port).

    `world_size` (optional) spares the adapter a round trip to ask the server for it.
    """

    from ckpt_engine.rollout_adapters.vllm.server_rollout import VllmServerRollout

    _check_keys("vllm", params, ("url", "world_size"))
    url, world_size = _vllm_params("vllm", params)
    return VllmServerRollout(name, url, timeout_s=timeout_s, world_size=world_size)


def vllm_lora_factory(name: str, params: Mapping[str, Any], timeout_s: float) -> RolloutAdapter:
    """A LoRA-enabled vLLM `api_server` (dev mode, worker extension) for adapter syncs, at `url`;
    `max_adapter_versions` (optional, default 2) as in `VllmServerLoraRollout`."""
    from ckpt_engine.rollout_adapters.vllm.lora import VllmServerLoraRollout

    _check_keys("vllm_lora", params, ("url", "world_size", "max_adapter_versions"))
    url, world_size = _vllm_params("vllm_lora", params)
    versions = params.get("max_adapter_versions", 2)
    if isinstance(versions, bool) or not isinstance(versions, int) or not 0 < versions <= 64:
        raise ValueError(f"vllm_lora engine descriptor: max_adapter_versions must be an int in [1, 64], got {versions!r:.80}")
    return VllmServerLoraRollout(name, url, timeout_s=timeout_s, world_size=world_size, max_adapter_versions=versions)


def _vllm_params(kind: str, params: Mapping[str, Any]) -> tuple[str, int | None]:
    from urllib.parse import urlsplit

    url, world_size = params.get("url"), params.get("world_size")
    if not isinstance(url, str) or not 0 < len(url) <= 2048:
        raise ValueError(f"{kind} engine descriptor: url must be a non-empty string, got {url!r:.80}")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/") or parts.query:
        raise ValueError(f"{kind} engine descriptor: url must look like http://host:port, got {url!r:.80}")
    if world_size is not None and (isinstance(world_size, bool) or not isinstance(world_size, int) or not 0 < world_size <= 4096):
        raise ValueError(f"{kind} engine descriptor: world_size must be an int in [1, 4096], got {world_size!r:.80}")
    return url, world_size


def close_quietly(adapter: RolloutAdapter) -> None:
    try:
        adapter.close()
    except Exception as exc:
        logger.debug("closing adapter %s: %s", adapter.name, exc)


def close_in_background(adapter: RolloutAdapter, *, close: bool, release: bool) -> None:
    """Release the engine (ownership) and/or close the adapter without waiting: the adapter may
    still be inside a call on a failed engine."""

    def run() -> None:
        if release:
            release_engine(adapter)
        if close:
            close_quietly(adapter)

    threading.Thread(target=run, name="ckpt-adapter-close", daemon=True).start()
