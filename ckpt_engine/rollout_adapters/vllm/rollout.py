"""vLLM rollout adapters: an in-process `vllm.LLM` and an OpenAI `api_server` in dev mode.

Both drive the worker extension in `ckpt_engine.rollout_adapters.vllm.worker` (start vLLM with
`worker_extension_cls=WORKER_EXTENSION`) through `VllmHandle` (`vllm/handle.py`: one sync, the
staged swap). Control goes through `collective_rpc` (in-process) or the dev-mode HTTP routes
(`VLLM_SERVER_DEV_MODE=1`: `/collective_rpc`, `/pause`, `/resume`, `/sleep`, `/wake_up`,
`/reset_prefix_cache`, `/update_weight_version`, `/weight_info`); weights go only through the
weight-sync group, into ranks `rank_offset + worker rank`.
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import logging
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, ClassVar
from urllib.parse import urlsplit

from ckpt_engine.rollout_adapters.vllm.compat import VllmFeatures, features_of
from ckpt_engine.rollout_adapters.vllm.handle import PAUSE_MODES, WORKER_EXTENSION, VllmHandle

if TYPE_CHECKING:
    import vllm

__all__ = ["WORKER_EXTENSION", "VllmRollout", "VllmServerRollout"]

logger = logging.getLogger(__name__)


class VllmRollout(VllmHandle):
    """Handle on an in-process `vllm.LLM` started with `worker_extension_cls=WORKER_EXTENSION`.

    Call `sync` from a thread other than one generating with the same `LLM`: control calls go
    through `llm.collective_rpc`, which queues behind a running `generate`.
    """

    def __init__(self, name: str, llm: vllm.LLM, *, timeout_s: float = 300.0, staging_limit_bytes: int | None = None) -> None:
        super().__init__(name, timeout_s, staging_limit_bytes)
        self.llm = llm
        self.features = features_of()
        # Control calls run here so that each wait has a deadline (`_bounded`); a few threads, so
        # a call stuck in a worker does not hold the next one.
        self._calls = ThreadPoolExecutor(max_workers=4, thread_name_prefix=f"vllm-rpc-{name}")
        parallel = llm.llm_engine.vllm_config.parallel_config
        self.world_size = int(parallel.tensor_parallel_size * parallel.pipeline_parallel_size)

    def engine_key(self) -> Hashable:
        return ("vllm", id(self.llm))

    def _bounded(self, what: str, timeout_s: float, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`fn(...)` waited on for at most `timeout_s` (+ a grace second): vLLM's engine-core client
        waits on a utility call's answer with no deadline (0.26 ignores `collective_rpc`'s
        timeout), so a worker stuck in a method would hold the trainer forever."""
        future = self._calls.submit(fn, *args, **kwargs)
        try:
            return future.result(timeout=timeout_s + 1.0)
        except cf.TimeoutError:
            raise TimeoutError(f"engine {self.name!r}: {what} did not answer within {timeout_s:.0f}s") from None

    def _rpc(self, method: str, timeout_s: float | None = None, **kwargs: Any) -> list[Any]:
        timeout = timeout_s if timeout_s is not None else self.timeout_s
        try:
            return list(self._bounded(method, timeout, self.llm.collective_rpc, method, timeout=timeout, kwargs=kwargs))
        except TimeoutError:
            raise
        except Exception as exc:
            clear = self._missing_extension(method, exc)
            if clear is exc:
                raise
            raise clear from exc

    def _utility(self, method: str, *args: Any) -> Any:
        core = self.llm.llm_engine.engine_core
        if hasattr(core, "call_utility"):
            return self._bounded(method, self.timeout_s, core.call_utility, method, *args)
        return getattr(core.engine_core, method)(*args)  # in-process engine core

    def pause(self, mode: str) -> None:
        self._pause_mode = mode
        if mode == "none":
            return
        self._utility("pause_scheduler", PAUSE_MODES[mode], False)

    def resume(self) -> None:
        self._utility("resume_scheduler")

    def _reset_prefix_cache(self, running: bool = False) -> None:
        if not self.llm.reset_prefix_cache(running):
            logger.warning("engine %s: prefix cache reset refused (blocks still held by in-flight requests)", self.name)

    def _set_engine_version(self, version: str) -> None:
        if self.features.engine_weight_versions:  # else only the workers hold it (vllm/compat.py)
            self.llm.update_weight_version(version)

    def weight_version(self) -> str:
        if not self.features.engine_weight_versions:
            return str(self.held_version())
        return str(self.llm.get_weight_version())

    def health(self) -> dict[str, Any]:
        self._check_pids()
        resources = getattr(self.llm.llm_engine.engine_core, "resources", None)
        if resources is not None and getattr(resources, "engine_dead", False):
            raise RuntimeError(f"engine {self.name!r}: vLLM engine core is dead")
        return {"pids": self.pids, "version": self.version}


class VllmServerRollout(VllmHandle):
    """Handle on `python -m vllm.entrypoints.openai.api_server --worker-extension-cls ...` in dev mode."""

    def __init__(
        self,
        name: str,
        base_url: str,
        *,
        timeout_s: float = 300.0,
        world_size: int | None = None,
        session: Any = None,
        staging_limit_bytes: int | None = None,
    ) -> None:
        import requests

        super().__init__(name, timeout_s, staging_limit_bytes)
        parts = urlsplit(base_url) if isinstance(base_url, str) else None
        if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"engine {name!r}: base_url must be http(s)://HOST:PORT, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.http = session if session is not None else requests.Session()
        self._probe = requests.Session()  # health checks must not share a connection with receive
        self._side = requests.Session()  # the cache reset and version stamp beside the swap's load
        if world_size is None:
            try:
                reply = self._get("/get_world_size", params={"include_dp": "false"}, timeout_s=min(timeout_s, 10.0), probe=True)
            except requests.RequestException as exc:
                self.close()
                raise ConnectionError(
                    f"engine {name!r}: no vLLM server answers at {self.base_url} ({type(exc).__name__}); start "
                    f"`vllm serve` there with VLLM_SERVER_DEV_MODE=1 and --worker-extension-cls {WORKER_EXTENSION}, "
                    "or fix the URL"
                ) from None
            world_size = int(reply["world_size"])
        self.world_size = world_size
        self._features: VllmFeatures | None = None
        # Worker pids are only meaningful to check on this host.
        self._local = urlsplit(self.base_url).hostname in ("127.0.0.1", "localhost", "::1")

    @property
    def features(self) -> VllmFeatures:
        """The server's vLLM release's features (asked once, at first use: `/version`)."""
        if self._features is None:
            self._features = features_of(str(self._get("/version", timeout_s=min(self.timeout_s, 10.0), probe=True)["version"]))
        return self._features

    # --- HTTP --------------------------------------------------------------------------------
    def _post(
        self, path: str, json: Any = None, params: dict[str, Any] | None = None, timeout_s: float | None = None, side: bool = False
    ) -> Any:
        """POST `path`; `side`: on the second connection (calls that run beside the swap's load)."""
        timeout = timeout_s if timeout_s is not None else self.timeout_s
        resp = (self._side if side else self.http).post(f"{self.base_url}{path}", json=json, params=params, timeout=timeout)
        if resp.status_code != 200:
            raise RuntimeError(f"engine {self.name!r}: POST {path} answered {resp.status_code}: {resp.text[:500]}")
        return resp.json() if resp.content else None

    def _get(self, path: str, params: dict[str, Any] | None = None, timeout_s: float | None = None, probe: bool = False) -> Any:
        timeout = timeout_s if timeout_s is not None else self.timeout_s
        resp = (self._probe if probe else self.http).get(f"{self.base_url}{path}", params=params, timeout=timeout)
        if resp.status_code != 200:
            raise RuntimeError(f"engine {self.name!r}: GET {path} answered {resp.status_code}: {resp.text[:500]}")
        return resp.json() if resp.content else None

    def engine_key(self) -> Hashable:
        return ("vllm-http", self.base_url)

    def _rpc(self, method: str, timeout_s: float | None = None, **kwargs: Any) -> list[Any]:
        timeout = timeout_s if timeout_s is not None else self.timeout_s
        body = {"method": method, "kwargs": kwargs, "timeout": timeout}
        try:
            reply = self._post("/collective_rpc", json=body, timeout_s=timeout + 10.0)
        except RuntimeError as exc:
            clear = self._missing_extension(method, exc)
            if clear is exc:
                raise
            raise clear from exc
        results = reply.get("results") if isinstance(reply, dict) else None
        if not isinstance(results, list):
            raise RuntimeError(f"engine {self.name!r}: /collective_rpc {method} returned {reply!r:.200}")
        return results

    def _encode_manifest(self, encoded: bytes) -> Any:
        return base64.b64encode(encoded).decode("ascii")  # the route carries JSON only

    # --- lifecycle ---------------------------------------------------------------------------
    def pause(self, mode: str) -> None:
        self._pause_mode = mode
        if mode == "none":
            return
        self._post("/pause", params={"mode": PAUSE_MODES[mode], "clear_cache": "false"})

    def resume(self) -> None:
        self._post("/resume")

    _side_calls: ClassVar[bool] = True  # the reset and the stamp go over `_side`, beside the load

    def _pause_for_swap(self, mode: str) -> None:
        """`/sleep?level=0` is the scheduler pause of `/pause` (same engine-core call, same modes,
        no cache clearing) without the 20 ms `asyncio.sleep` that `/pause` adds only so earlier
        outputs reach their callers first; tokens are stamped in the engine core when their step
        ends, so the swap needs no such wait."""
        self._pause_mode = mode
        self._post("/sleep", params={"level": "0", "mode": PAUSE_MODES[mode]})

    def _resume_after_swap(self) -> None:
        reply = self._post("/wake_up", params={"tags": "scheduling"})
        if isinstance(reply, dict) and reply.get("status") != "awake":
            raise RuntimeError(f"engine {self.name!r}: /wake_up?tags=scheduling after the swap left it {reply.get('status')!r}")

    def _reset_prefix_cache(self, running: bool = False) -> None:
        reply = self._post("/reset_prefix_cache", params={"reset_running_requests": "true"} if running else None, side=True)
        if isinstance(reply, dict) and reply.get("success") is False:
            logger.warning("engine %s: prefix cache reset refused (blocks still held)", self.name)

    def _set_engine_version(self, version: str) -> None:
        if self.features.engine_weight_versions:  # else only the workers hold it (vllm/compat.py)
            self._post("/update_weight_version", json={"new_version": version}, side=True)

    def weight_version(self) -> str:
        if not self.features.engine_weight_versions:
            return str(self.held_version())
        return str(self._get("/weight_info")["weight_version"])

    def health(self) -> dict[str, Any]:
        if self._local:
            self._check_pids()
        self._get("/health", timeout_s=min(self.timeout_s, 5.0), probe=True)
        return {"pids": self.pids, "version": self.version}

    def close(self) -> None:
        self.http.close()
        self._probe.close()
        self._side.close()
