"""Adapter-only syncs: `VllmLoraRollout`, `VllmRollout` over any channel (an in-process `vllm.LLM`,
a dev-mode `api_server`: `VllmServerLoraRollout` builds it from a URL, or `WeightTransferChannel`:
vLLM's weight-transfer API) with its workers joined for LoRA adapter versions.

Start vLLM with LoRA (`enable_lora=True` / `--enable-lora`), `max_lora_rank` >= the adapter's
rank, `max_loras` >= `max_adapter_versions` (so old and new versions batch together) and the worker
extension or the weight-transfer config; a server also with `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`
(the `/v1/load_lora_adapter` route; the extension needs `VLLM_SERVER_DEV_MODE=1`). Each sync
installs the adapter as a new version in every worker's LoRA manager (from memory:
`vllm/lora_worker.py`, no disk); only once every worker holds it do requests name it
(`LoraVersions`, `vllm/lora_names.py`): in process by `lora_request()`, behind the server by
`model=model_name()` once the server registered it (its `add_lora` reaches every worker at once,
and activates it: a checked sync's LoRA slots are compared then, `served_slot_problems`).
The switch is atomic across the engine's ranks. Nothing is paused: a request keeps the version it
started with and finishes under it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ckpt_engine.engine import Rendezvous
from ckpt_engine.rollout_adapters.base import JoinOptions
from ckpt_engine.rollout_adapters.capabilities import EngineCapabilities
from ckpt_engine.rollout_adapters.vllm.clients import Channel, LLMWeightSyncClient
from ckpt_engine.rollout_adapters.vllm.lora_names import LoraVersions
from ckpt_engine.rollout_adapters.vllm.native import WeightTransferChannel
from ckpt_engine.rollout_adapters.vllm.clients import http_channel
from ckpt_engine.rollout_adapters.vllm.rollout import VllmRollout

if TYPE_CHECKING:
    import vllm
    from vllm.lora.request import LoRARequest

__all__ = ["VllmLoraRollout", "VllmServerLoraRollout"]


class VllmLoraRollout(VllmRollout):
    """Handle on a LoRA-enabled vLLM engine, for adapter syncs (over any channel)."""

    capabilities = EngineCapabilities(delta=True, many_senders=True, weights="adapters", installed=True)
    """No staging: an adapter sync already installs only at finalize (the received tensors wait in
    the workers' LoRA stage). No regions: every worker receives the whole adapter (a few MB); vLLM's
    LoRA layers cut each TP rank's slice themselves when the version is installed. Installed: each
    worker reads the adapter back out of vLLM's `LoRAModel` before finalize, and compares the LoRA
    slots vLLM wrote when it activated the version with it (in process at the install, behind the
    server at the registration: `vllm/lora_installed.py`), and again each time vLLM writes them
    again after its LRU evicted the version (named in the worker's health, `slot_rechecks`)."""

    def __init__(
        self, name: str, llm: vllm.LLM | Channel, *, max_adapter_versions: int = 2, timeout_s: float = 300.0, world_size: int | None = None
    ) -> None:
        super().__init__(name, llm, timeout_s=timeout_s, world_size=world_size)
        engine = self.client.client if isinstance(self.client, WeightTransferChannel) else self.client  # the engine's own routes
        if isinstance(engine, LLMWeightSyncClient) and engine.llm.llm_engine.vllm_config.lora_config is None:
            raise ValueError(f"engine {name!r}: vLLM was started without LoRA; start it with enable_lora=True for adapter syncs")
        self.versions = LoraVersions(name, max_adapter_versions, engine)
        self.max_adapter_versions = max_adapter_versions

    def join(self, rendezvous: Rendezvous, rank_offset: int, options: JoinOptions) -> None:
        """Check a server can register adapters, then join every worker (`preload`: in process each
        version is installed under its own LoRA id; a server loads it under the id it gives it)."""
        self.versions.check_routes()
        self._join(rendezvous, rank_offset, options, self.max_adapter_versions, self.versions.names is None)

    def pause(self, mode: str) -> None:
        """Nothing to pause: a sync never touches an adapter version a request uses."""

    def resume(self) -> None:
        """Nothing was paused."""

    def finalize(self, version: int) -> None:
        """Install the received adapter as `version` on every worker, then make it the newest (behind
        a server: register its name; a checked sync's LoRA slots that differ unregister it and fail,
        `served_slot_problems`). New requests get it from then on."""
        t0 = time.perf_counter()
        replies = self.workers.finalize(version)
        t1 = time.perf_counter()
        # behind the server: the LoRA slots of a checked sync, compared as vLLM activates the version
        self.versions.installed(version, lambda v, activate: served_slot_problems(self.workers.health, v, activate))
        self.version = version
        self.last_finalize = {
            "install_s": max((float(r.get("install_s", 0.0)) for r in replies), default=0.0), "finalize_rpc_s": t1 - t0,
            "register_s": time.perf_counter() - t1,
        }

    def lora_request(self) -> LoRARequest:
        """The `LoRARequest` of the newest adapter version (pass it to `LLM.generate(..., lora_request=...)`)."""
        return self.versions.lora_request()

    def model_name(self) -> str:
        """The OpenAI `model` of the newest adapter version (new requests to the server name it)."""
        return self.versions.model_name()

    def take_over(self, previous: Any) -> None:
        super().take_over(previous)
        if isinstance(previous, VllmLoraRollout):
            self.versions.take_over(previous.versions)


class VllmServerLoraRollout(VllmLoraRollout):
    """`VllmLoraRollout` over a LoRA-enabled dev-mode `api_server` at `base_url`; versions are served by name."""

    def __init__(
        self, name: str, base_url: str, *, max_adapter_versions: int = 2, timeout_s: float = 300.0, world_size: int | None = None,
        session: Any = None,
    ) -> None:
        client, workers = http_channel(name, base_url, timeout_s, session, world_size)
        super().__init__(name, client, max_adapter_versions=max_adapter_versions, timeout_s=timeout_s, world_size=workers)
        self.base_url, self.http = client.base_url, client.http


def served_slot_problems(health: Callable[[], list[dict[str, Any]] | None], version: int, activate: Callable[[], None]) -> list[str]:
    """The workers' slot problems of `version` behind vLLM's OpenAI server ("worker r: ..." with more
    than one worker); [] when this sync's check was not armed, or the route cannot ask the workers
    (vLLM's weight-transfer API). There vLLM activates a version inside its own call (the
    registration's `add_adapter`, or else the first request naming it), where nothing may raise: each
    worker compares its slots right after that activation and reports it in its health
    (`slot_check`). A worker that has not compared yet gets one `max_tokens=1` completion naming the
    version (`activate`); one still without a comparison after it is a problem too."""
    replies = health()
    if not replies or not any(_check(r, version) is not None for r in replies):
        return []
    if any(_pending(r, version) for r in replies):
        activate()
        replies = health() or []
    problems: list[str] = []
    for rank, reply in enumerate(replies):
        where = f"worker {rank}: " if len(replies) > 1 else ""
        check = _check(reply, version)
        if check is None or check.get("problems") is None:
            problems.append(f"{where}vLLM did not activate adapter version {version} into its LoRA slots (not even for a request naming it): not checked")
        else:
            problems += [f"{where}{p}" for p in check["problems"]]
    return problems


def _check(reply: dict[str, Any], version: int) -> dict[str, Any] | None:
    check = reply.get("slot_check")
    return check if isinstance(check, dict) and check.get("version") == version else None


def _pending(reply: dict[str, Any], version: int) -> bool:
    check = _check(reply, version)
    return check is None or check.get("problems") is None
