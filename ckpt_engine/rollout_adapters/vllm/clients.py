"""Control clients for vLLM's weight-transfer API: a dev-mode `api_server` over HTTP, or an
in-process `vllm.LLM`.

Both satisfy vLLM's `VLLMWeightSyncClient` (the four weight-update calls) and add `EngineControl`
(pause, resume, prefix-cache reset, weight version, weight checksums), all through vLLM's own
routes or `LLM` methods, so `CkptEngineTrainerWeightTransferEngine` can keep an engine from serving
a mix of two versions. Any other `VLLMWeightSyncClient` works too; then the caller pauses and
resets caches itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import vllm

__all__ = ["EngineControl", "HTTPWeightSyncClient", "LLMWeightSyncClient", "PAUSE_MODES", "SwapControl"]

# ckpt-engine pause modes -> vLLM's (`keep` freezes requests in place, `abort` drops them;
# `recompute` freezes them, and `reset_prefix_cache(running=True)` after the load preempts them:
# they re-prefill their prompt and tokens so far under the new weights).
PAUSE_MODES = {"keep": "keep", "abort": "abort", "recompute": "keep"}


@runtime_checkable
class EngineControl(Protocol):
    """What the trainer side needs beyond the four weight-update calls."""

    def pause(self, mode: str) -> None: ...

    def resume(self) -> None: ...

    def reset_prefix_cache(self, running: bool = False) -> None:
        """Drop the prefix cache; `running`: also preempt running requests (they re-prefill)."""
        ...

    def weight_version(self) -> str: ...


@runtime_checkable
class SwapControl(Protocol):
    """Optional beside `EngineControl`: the pause and resume around a staged swap, by the quickest
    route the client has (the scheduler pause alone; the swap needs nothing else paused)."""

    def pause_for_swap(self, mode: str) -> None: ...

    def resume_after_swap(self) -> None: ...


def _vllm_pause_mode(mode: str) -> str:
    if mode not in PAUSE_MODES:
        raise ValueError(f"pause mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
    return PAUSE_MODES[mode]


class HTTPWeightSyncClient:
    """vLLM's weight-update routes and `VLLM_SERVER_DEV_MODE=1` routes over HTTP (the calls of vLLM's
    `HTTPVLLMWeightSyncClient`, without importing vLLM); errors carry the server's answer."""

    def __init__(self, base_url: str, timeout: float = 300.0) -> None:
        import requests

        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.http = requests.Session()

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._request("POST", "init_weight_transfer_engine", json={"init_info": init_info})

    def shutdown_weight_transfer_engine(self) -> None:
        self._request("POST", "shutdown_weight_transfer_engine")

    def start_weight_update(self) -> None:
        self._request("POST", "start_weight_update")

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self._request("POST", "update_weights", json={"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._request("POST", "finish_weight_update", json={"weight_version": weight_version} if weight_version is not None else None)

    def _request(self, verb: str, path: str, json: Any = None, params: dict[str, Any] | None = None) -> Any:
        resp = self.http.request(verb, f"{self.base_url}/{path.lstrip('/')}", json=json, params=params, timeout=self.timeout)
        if resp.status_code != 200:
            # vLLM's server may drop the connection after a route raised; a pooled one would then
            # fail the next request with a reset.
            self.http.close()
            raise RuntimeError(f"vLLM at {self.base_url}: {verb} /{path.lstrip('/')} answered {resp.status_code}: {resp.text[:2000]}")
        return resp.json() if resp.content else None

    def pause(self, mode: str) -> None:
        self._request("POST", "pause", params={"mode": _vllm_pause_mode(mode), "clear_cache": "false"})

    def resume(self) -> None:
        self._request("POST", "resume")

    def pause_for_swap(self, mode: str) -> None:
        """`/sleep?level=0` is `/pause`'s scheduler pause (same engine-core call and modes) without
        the 20 ms `asyncio.sleep` `/pause` adds so earlier outputs reach their callers first; tokens
        are labelled in the engine core when their step ends, so a swap needs no such wait."""
        self._request("POST", "sleep", params={"level": "0", "mode": _vllm_pause_mode(mode)})

    def resume_after_swap(self) -> None:
        reply = self._request("POST", "wake_up", params={"tags": "scheduling"})
        if isinstance(reply, dict) and reply.get("status") != "awake":
            raise RuntimeError(f"vLLM at {self.base_url}: /wake_up?tags=scheduling after the swap left it {reply.get('status')!r}")

    def reset_prefix_cache(self, running: bool = False) -> None:
        self._request("POST", "reset_prefix_cache", params={"reset_running_requests": "true"} if running else None)

    def weight_version(self) -> str:
        return str(self._request("GET", "weight_info")["weight_version"])

    def weight_checksums(self) -> dict[str, str]:
        """vLLM's `/weight_checker` digests of every parameter, keyed by worker and name."""
        return dict(self._request("POST", "weight_checker", json={"action": "checksum"})["checksums"])

    def weights_match(self, baseline: dict[str, str]) -> tuple[bool, list[str]]:
        """`/weight_checker` compare: whether the engine's weights equal `baseline` digests."""
        reply = self._request("POST", "weight_checker", json={"action": "compare", "baseline": baseline})
        return bool(reply["match"]), list(reply["mismatches"])

    def close(self) -> None:
        self.http.close()


class LLMWeightSyncClient:
    """The same calls on an in-process `vllm.LLM` (its RL methods and engine-core utilities).

    Call the trainer side from a thread other than one generating with the same `LLM`: control
    calls queue behind a running `generate`.
    """

    def __init__(self, llm: vllm.LLM) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def shutdown_weight_transfer_engine(self) -> None:
        self.llm.shutdown_weight_transfer_engine()

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)

    def _utility(self, method: str, *args: Any) -> Any:
        core = self.llm.llm_engine.engine_core
        if hasattr(core, "call_utility"):
            return core.call_utility(method, *args)
        return getattr(core.engine_core, method)(*args)  # in-process engine core

    def pause(self, mode: str) -> None:
        self._utility("pause_scheduler", _vllm_pause_mode(mode), False)

    def resume(self) -> None:
        self._utility("resume_scheduler")

    def pause_for_swap(self, mode: str) -> None:
        self.pause(mode)  # already the engine-core call alone

    def resume_after_swap(self) -> None:
        self.resume()

    def reset_prefix_cache(self, running: bool = False) -> None:
        self.llm.reset_prefix_cache(running)

    def weight_version(self) -> str:
        return str(self.llm.get_weight_version())

    def weight_checksums(self) -> dict[str, str]:
        checksums: dict[str, str] = {}
        for worker in self.llm.collective_rpc("compute_weight_checksums"):
            checksums.update(worker)
        return checksums
