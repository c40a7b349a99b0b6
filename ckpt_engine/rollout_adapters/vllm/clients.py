"""The channels to one vLLM engine: a dev-mode `api_server` over HTTP, or an in-process `vllm.LLM`.

Each carries `EngineControl` (pause, resume, prefix-cache reset, weight version, weight checksums),
what `VllmRollout` needs beside it (the engine's version stamp, its world size, health and vLLM
release) and `collective_rpc` to every worker, its route to the worker extension
(`ExtensionRoute`, `vllm/routes.py`). Each also carries vLLM's weight-update calls
(`VLLMWeightSyncClient`), which `WeightTransferChannel` (`vllm/native.py`) wraps for the route
through vLLM's weight-transfer API. All go through vLLM's own routes or `LLM` methods.
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import functools
import logging
import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable
from urllib.parse import urlsplit

from ckpt_engine.rollout_adapters.vllm.compat import VllmFeatures, features_of
from ckpt_engine.rollout_adapters.vllm.engine_core import EngineCore, Unanswered
from ckpt_engine.rollout_adapters.vllm.routes import WORKER_EXTENSION, ExtensionRoute, Route

if TYPE_CHECKING:
    import vllm

__all__ = ["Channel", "EngineControl", "HTTPWeightSyncClient", "LLMWeightSyncClient", "PAUSE_MODES", "http_channel"]

logger = logging.getLogger(__name__)

# ckpt-engine pause modes -> vLLM's (`keep` freezes requests in place, `abort` drops them;
# `recompute` freezes them, and `reset_prefix_cache(running=True)` after the load preempts them:
# they re-prefill their prompt and tokens so far under the new weights).
PAUSE_MODES = {"keep": "keep", "abort": "abort", "recompute": "keep"}


@runtime_checkable
class EngineControl(Protocol):
    """What the trainer side needs beyond the four weight-update calls."""

    def pause(self, mode: str) -> None: ...

    def resume(self) -> None: ...

    def reset_prefix_cache(self, running: bool = False) -> bool:
        """Drop the prefix cache; `running`: also preempt running requests (they re-prefill).
        False when vLLM refused (blocks still held by in-flight requests)."""
        ...

    def weight_version(self) -> str: ...


class Channel(EngineControl, Protocol):
    """What `VllmRollout` drives its engine through (both clients below, `WeightTransferChannel`);
    `route` reaches the workers."""

    side_calls: bool
    """Whether the cache reset and the version stamp may run beside a long `collective_rpc` (they
    go over a connection of their own)."""
    local: bool
    """Whether the engine's worker processes run on this host (their pids can be checked)."""

    @property
    def features(self) -> VllmFeatures: ...

    def route(self, name: str, timeout_s: float, adapters: bool) -> Route:
        """How a handle on engine `name` reaches its workers (`adapters`: for LoRA adapter syncs)."""
        ...

    def pause_for_swap(self, mode: str) -> None:
        """The pause around a staged swap by the quickest route the channel has (the scheduler pause
        alone: the swap needs nothing else paused)."""
        ...

    def resume_after_swap(self) -> None: ...

    def set_weight_version(self, version: str) -> None: ...

    def engine_key(self) -> Hashable: ...

    def world_size(self) -> int: ...

    def health(self) -> None: ...

    def close(self) -> None: ...


def _vllm_pause_mode(mode: str) -> str:
    if mode not in PAUSE_MODES:
        raise ValueError(f"pause mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
    return PAUSE_MODES[mode]


class HTTPWeightSyncClient:
    """vLLM's weight-update routes and `VLLM_SERVER_DEV_MODE=1` routes over HTTP (the calls of vLLM's
    `HTTPVLLMWeightSyncClient`, without importing vLLM); errors carry the server's answer. `session`:
    the connection for the calls (health checks and the calls beside a swap's load have their own)."""

    side_calls = True

    def __init__(self, base_url: str, timeout: float = 300.0, session: Any = None) -> None:
        import requests

        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.http = session if session is not None else requests.Session()
        self._probe = requests.Session()  # health checks must not share a connection with a receive
        self._side = requests.Session()  # the cache reset and version stamp beside a swap's load
        self._features: VllmFeatures | None = None
        self.local = urlsplit(self.base_url).hostname in ("127.0.0.1", "localhost", "::1")

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

    def _request(
        self, verb: str, path: str, json: Any = None, params: dict[str, Any] | None = None, timeout: float | None = None, via: Any = None
    ) -> Any:
        http = via if via is not None else self.http
        resp = http.request(verb, f"{self.base_url}/{path.lstrip('/')}", json=json, params=params, timeout=timeout or self.timeout)
        if resp.status_code != 200:
            # vLLM's server may drop the connection after a route raised; a pooled one would then
            # fail the next request with a reset.
            http.close()
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

    def reset_prefix_cache(self, running: bool = False) -> bool:
        reply = self._request("POST", "reset_prefix_cache", params={"reset_running_requests": "true"} if running else None, via=self._side)
        return not (isinstance(reply, dict) and reply.get("success") is False)

    def weight_version(self) -> str:
        return str(self._request("GET", "weight_info")["weight_version"])

    def weight_checksums(self) -> dict[str, str]:
        """vLLM's `/weight_checker` digests of every parameter, keyed by worker and name."""
        return dict(self._request("POST", "weight_checker", json={"action": "checksum"})["checksums"])

    def weights_match(self, baseline: dict[str, str]) -> tuple[bool, list[str]]:
        """`/weight_checker` compare: whether the engine's weights equal `baseline` digests."""
        reply = self._request("POST", "weight_checker", json={"action": "compare", "baseline": baseline})
        return bool(reply["match"]), list(reply["mismatches"])

    # --- the worker extension's channel (dev-mode routes) --------------------------------------
    def route(self, name: str, timeout_s: float, adapters: bool) -> Route:
        return ExtensionRoute(self, name, timeout_s, adapters)

    @property
    def features(self) -> VllmFeatures:
        """The server's vLLM release's features (asked once, at first use: `/version`)."""
        if self._features is None:
            self._features = features_of(str(self._request("GET", "version", timeout=min(self.timeout, 10.0), via=self._probe)["version"]))
        return self._features

    def collective_rpc(self, method: str, kwargs: dict[str, Any], timeout_s: float) -> list[Any]:
        """Bounded here, not by vLLM: past its `timeout` its engine core leaves the workers' late answer queued, for a
        model step to read and die on; unbounded there, a stuck worker holds the engine core only until it answers."""
        import requests

        try:
            reply = self._request("POST", "collective_rpc", json={"method": method, "kwargs": kwargs}, timeout=timeout_s + 1.0)
        except requests.Timeout:
            raise TimeoutError(f"vLLM at {self.base_url}: /collective_rpc {method} did not answer within {timeout_s:.0f}s (a stuck engine core or worker?)") from None
        results = reply.get("results") if isinstance(reply, dict) else None
        if not isinstance(results, list):
            raise RuntimeError(f"vLLM at {self.base_url}: /collective_rpc {method} returned {reply!r:.200}")
        return results

    def encode(self, data: bytes) -> Any:
        return base64.b64encode(data).decode("ascii")  # the route carries JSON only

    def set_weight_version(self, version: str) -> None:
        if self.features.engine_weight_versions:  # else only the workers hold it (vllm/compat.py)
            self._request("POST", "update_weight_version", json={"new_version": version}, via=self._side)

    def engine_key(self) -> Hashable:
        return ("vllm-http", self.base_url)

    def world_size(self) -> int:
        reply = self._request("GET", "get_world_size", params={"include_dp": "false"}, timeout=min(self.timeout, 10.0), via=self._probe)
        return int(reply["world_size"])

    def health(self) -> None:
        self._request("GET", "health", timeout=min(self.timeout, 5.0), via=self._probe)

    def close(self) -> None:
        self.http.close()
        self._probe.close()
        self._side.close()


SWITCHES = frozenset({"resume_scheduler", "set_weight_version"})
"""Engine-core utilities that, in this process, only set the scheduler's state or the version stamp:
nothing in them waits (and the pause, where it does not reach the workers: `VllmFeatures`). Each
was a pool thread's round trip before the first copy or after the last (bench/RESULTS.md, run 30)."""

BOUNDED_HERE = frozenset({"ckpt_validate", "ckpt_receive_begin", "ckpt_receive_end"})
"""Worker methods that bound their own waits (the validate waits on nothing: a busy receiver refuses
it at once; the receive's begin waits its `quiet_s`, its end its `timeout_s`): where the worker runs
in the calling thread (`EngineCore.workers_here`) they are called there, not through a pool thread's
round trip (two before the first copy, one after the last)."""


class LLMWeightSyncClient:
    """The same calls on an in-process `vllm.LLM` (its RL methods, `collective_rpc` and engine-core
    utilities), each waited on for at most `timeout` seconds: a stuck engine core ends the call in a
    `TimeoutError` naming the engine (`name`, else the `LLM`'s model) and the call.

    With the engine core in its own process (vLLM's `SyncMPClient`), the scheduler pause and resume,
    the version stamp and `collective_rpc` are sent from the calling thread and waited on through
    vLLM's own answer future; the rest runs on a pool thread (`_bounded`). The version stamp and the
    resume right after it (how a completed sync or swap ends) are sent unwaited: the engine core
    handles its input in order, so whatever the caller sends next comes after them; their answers
    are checked at this client's next call (or `close`), which raises naming the call if one failed
    or never answered (docs/vllm.md). Any other resume (a failed sync's, a closing daemon's) is
    waited for.

    Call the trainer side from a thread other than one generating with the same `LLM`. With the
    engine core in its own process, control calls queue behind the step it is running; in this
    process, the engine core steps in the generating thread, and a pause waits for the step in
    flight to end (`EngineCore.between_steps`), so no step's forward sees the copies that follow.
    """

    side_calls = False
    local = True

    def __init__(self, llm: vllm.LLM, timeout: float = 300.0, name: str | None = None) -> None:
        self.llm = llm
        self.timeout = timeout
        self.name = name if name is not None else f"LLM({llm.llm_engine.vllm_config.model_config.model})"
        """How errors name the engine."""
        self.features = features_of()
        self._switches = SWITCHES if self.features.pause_reaches_workers else SWITCHES | {"pause_scheduler"}
        self._prefixes = bool(llm.llm_engine.vllm_config.cache_config.enable_prefix_caching)
        """Whether the engine caches prefixes (vLLM's `enable_prefix_caching`): without, a reset has nothing to drop."""
        self._core = EngineCore.of(llm.llm_engine.engine_core)
        # Every call runs here so that each wait has a deadline (`_bounded`); a few threads, so a call
        # stuck in the engine core or a worker does not hold the next one.
        self._calls = ThreadPoolExecutor(max_workers=4, thread_name_prefix="vllm-rpc")
        self._unanswered: list[Unanswered] = []
        """Calls sent unwaited, oldest first: checked at the next call."""
        self._lock = threading.Lock()
        self._stamped = False
        """The last call was the version stamp: a resume now ends a completed sync or swap."""

    def _late(self, what: str, timeout_s: float) -> str:
        return f"vLLM engine {self.name}: {what} did not answer within {timeout_s:.0f}s (a stuck engine core or worker?)"

    def _bounded(self, what: str, timeout_s: float, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`fn(...)` waited on for at most `timeout_s` (+ a grace second): vLLM waits on an engine-core
        call with no deadline (its engine-core client on a utility's answer, an engine core in this
        process on its workers; 0.26 ignores `collective_rpc`'s timeout), so a stuck engine core or
        worker would hold the trainer forever. The call itself stays stuck in its thread."""
        self._settle()
        future = self._calls.submit(fn, *args, **kwargs)
        try:
            return future.result(timeout=timeout_s + 1.0)
        except cf.TimeoutError:
            raise TimeoutError(self._late(what, timeout_s)) from None

    def _utility(self, what: str, timeout_s: float, method: str, *args: Any) -> Any:
        """The engine-core utility `method(*args)` (`what` names it in errors), waited on for at most
        `timeout_s` (+ a grace second). Through a `SyncMPClient`, sent from this thread and vLLM's
        answer future waited on: no hop to a pool thread and back on the critical path. An engine
        core in this process runs a scheduler switch (`_switches`) on this thread (nothing in it waits
        but a pause, for a step running on a generating thread to end: `EngineCore.between_steps`)."""
        if not self._core.sends:
            call = functools.partial(self._core.between_steps, timeout_s, self._core.call) if method == "pause_scheduler" else self._core.call
            if method in self._switches:
                self._settle()
                try:
                    return call(method, *args)
                except TimeoutError:
                    raise TimeoutError(self._late(what, timeout_s)) from None
            return self._bounded(what, timeout_s, call, method, *args)
        self._settle()
        call_id, future = self._core.send(method, *args)
        try:
            return future.result(timeout=timeout_s + 1.0)
        except cf.TimeoutError:
            self._core.forget(call_id)
            raise TimeoutError(self._late(what, timeout_s)) from None

    def _send_unwaited(self, method: str, *args: Any) -> None:
        """The engine-core utility `method(*args)` sent from this thread (never from a pool thread:
        vLLM sends on one socket with no lock, so a send racing the caller's next call corrupts a
        frame); its answer is checked at the next call. An engine core in this process runs it now."""
        if not self._core.sends:
            self._utility(method, self.timeout, method, *args)
            return
        call_id, future = self._core.send(method, *args)
        future.add_done_callback(functools.partial(self._log_failure, method))
        with self._lock:
            self._unanswered.append(Unanswered(method, call_id, future, time.monotonic() + self.timeout + 1.0))

    def _log_failure(self, method: str, future: cf.Future[Any]) -> None:
        """Logged as the answer arrives (on vLLM's output thread), before the next call raises it."""
        if not future.cancelled() and future.exception() is not None:
            logger.error("vLLM engine %s: %s, sent unwaited, failed: %s (this client's next call raises it)", self.name, method, future.exception())

    def _settle(self) -> None:
        """Raise if a call sent unwaited failed or did not answer within `timeout` of its send,
        naming the first such (each is raised once); every other call starts here."""
        self._stamped = False
        with self._lock:
            unanswered, self._unanswered = self._unanswered, []
        problem: Exception | None = None
        for call in unanswered:
            try:
                call.future.result(timeout=max(0.0, call.deadline - time.monotonic()))
            except cf.TimeoutError:
                self._core.forget(call.call_id)
                problem = problem or TimeoutError(
                    f"vLLM engine {self.name}: {call.method}, sent unwaited at the end of a sync, did not answer within "
                    f"{self.timeout:.0f}s (a stuck engine core?); the engine may still be paused"
                )
            except Exception as exc:
                problem = problem or RuntimeError(
                    f"vLLM engine {self.name}: {call.method}, sent unwaited at the end of a sync, failed: {exc}; the engine may still be paused"
                )
        if problem is not None:
            raise problem

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._bounded("init_weight_transfer_engine", self.timeout, self.llm.init_weight_transfer_engine, {"init_info": init_info})

    def shutdown_weight_transfer_engine(self) -> None:
        self._bounded("shutdown_weight_transfer_engine", self.timeout, self.llm.shutdown_weight_transfer_engine)

    def start_weight_update(self) -> None:
        self._bounded("start_weight_update", self.timeout, self.llm.start_weight_update)

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self._bounded("update_weights", self.timeout, self.llm.update_weights, {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        if weight_version is None:  # vLLM 0.26's takes no version at all (vllm/compat.py)
            self._bounded("finish_weight_update", self.timeout, self.llm.finish_weight_update)
        else:
            self._bounded("finish_weight_update", self.timeout, self.llm.finish_weight_update, weight_version)

    def pause(self, mode: str) -> None:
        self._utility("pause_scheduler", self.timeout, "pause_scheduler", _vllm_pause_mode(mode), False)

    def resume(self) -> None:
        """Unwaited right after the version stamp (a completed sync or swap), else waited for."""
        if self._stamped:
            self._stamped = False
            self._send_unwaited("resume_scheduler")
        else:
            self._utility("resume_scheduler", self.timeout, "resume_scheduler")

    def pause_for_swap(self, mode: str) -> None:
        self.pause(mode)  # already the engine-core call alone

    def resume_after_swap(self) -> None:
        self.resume()

    def reset_prefix_cache(self, running: bool = False) -> bool:
        if not running and not self._prefixes:  # vLLM would refuse while kept requests hold blocks: they would be preempted for nothing
            return True
        if not self._core.sends:  # in this process: between two steps (a reset preempting running requests moves them)
            return bool(self._bounded("reset_prefix_cache", self.timeout, self._core.between_steps, self.timeout, self.llm.reset_prefix_cache, running))
        return bool(self._bounded("reset_prefix_cache", self.timeout, self.llm.reset_prefix_cache, running))

    def weight_version(self) -> str:
        return str(self._bounded("get_weight_version", self.timeout, self.llm.get_weight_version))

    def weight_checksums(self) -> dict[str, str]:
        checksums: dict[str, str] = {}
        for worker in self.collective_rpc("compute_weight_checksums", {}, self.timeout):
            checksums.update(worker)
        return checksums

    # --- the worker extension's channel ---------------------------------------------------------
    def route(self, name: str, timeout_s: float, adapters: bool) -> Route:
        return ExtensionRoute(self, name, timeout_s, adapters)

    def collective_rpc(self, method: str, kwargs: dict[str, Any], timeout_s: float) -> list[Any]:
        """`LLM.collective_rpc`'s engine-core utility (vLLM 0.26 and 0.32), bounded here and not by vLLM's
        `timeout`: past it vLLM's multiprocess executor (TP > 1) leaves the late answer for the next
        model step to read and die on, as on the HTTP route (`HTTPWeightSyncClient.collective_rpc`).
        A method that bounds itself (`BOUNDED_HERE`) runs in this thread where the worker does."""
        if method in BOUNDED_HERE and self._core.workers_here:
            self._settle()
            return list(self._core.call("collective_rpc", method, None, (), kwargs))
        return list(self._utility(method, timeout_s, "collective_rpc", method, None, (), kwargs))

    def encode(self, data: bytes) -> Any:
        return data

    def set_weight_version(self, version: str) -> None:
        """Sent unwaited (it ends a completed sync or swap; the resume follows)."""
        if self.features.engine_weight_versions:  # else only the workers hold it (vllm/compat.py)
            self._send_unwaited("set_weight_version", version)  # `LLM.update_weight_version`'s utility
        self._stamped = True

    def engine_key(self) -> Hashable:
        return ("vllm", id(self.llm))

    def world_size(self) -> int:
        parallel = self.llm.llm_engine.vllm_config.parallel_config
        return int(parallel.tensor_parallel_size * parallel.pipeline_parallel_size)

    def health(self) -> None:
        if self._core.dead():
            raise RuntimeError(f"vLLM engine {self.name}: its engine core is dead")
        self._settle()

    def close(self) -> None:
        """The `LLM` is its caller's; what was sent unwaited is checked (logged, not raised: a close
        must go through)."""
        try:
            self._settle()
        except (RuntimeError, TimeoutError) as exc:
            logger.error("%s", exc)


def http_channel(name: str, base_url: str, timeout_s: float, session: Any, world_size: int | None) -> tuple[HTTPWeightSyncClient, int]:
    """The channel to the dev-mode server at `base_url` for engine `name`, and its world size (asked
    when None): a URL that is not one, or that nobody answers, fails here with the fix."""
    import requests

    parts = urlsplit(base_url) if isinstance(base_url, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"engine {name!r}: base_url must be http(s)://HOST:PORT, got {base_url!r}")
    client = HTTPWeightSyncClient(base_url, timeout_s, session)
    if world_size is not None:
        return client, world_size
    try:
        return client, client.world_size()
    except requests.RequestException as exc:
        client.close()
        raise ConnectionError(
            f"engine {name!r}: no vLLM server answers at {client.base_url} ({type(exc).__name__}); start "
            f"`vllm serve` there with VLLM_SERVER_DEV_MODE=1 and --worker-extension-cls {WORKER_EXTENSION}, "
            "or fix the URL"
        ) from None
