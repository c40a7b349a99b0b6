"""An `LLM`'s engine core as `LLMWeightSyncClient` (`vllm/clients.py`) reaches it: in another process
through vLLM's utility calls and their futures, or in this one (`VLLM_ENABLE_V1_MULTIPROCESSING=0`)
by calling the `EngineCore` itself; and the record of a call sent without waiting for its answer."""

from __future__ import annotations

import concurrent.futures as cf
import threading
import uuid
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

__all__ = ["EngineCore", "Unanswered", "step_lock"]


class Unanswered(NamedTuple):
    """A call sent unwaited (`LLMWeightSyncClient._send_unwaited`)."""

    method: str
    call_id: int
    future: cf.Future[Any]
    deadline: float
    """`time.monotonic()` by which it must have answered."""


_STEPS: weakref.WeakKeyDictionary[Any, threading.RLock] = weakref.WeakKeyDictionary()
"""Per in-process vLLM `EngineCore`: the lock each of its steps holds (`step_lock`)."""
_INSTALL = threading.Lock()


def step_lock(core: Any) -> threading.RLock:
    """The lock every step of the in-process engine core `core` holds from now on: its `step_fn` (what
    vLLM's `InprocClient.get_output` calls for each step of a `generate`) wrapped once per core. The
    vLLM plugin (`vllm/plugin.py`) wraps it as the core is made; a core made without the plugin is
    wrapped at its first handle, and a step already running then does not hold the lock."""
    with _INSTALL:
        lock = _STEPS.get(core)
        if lock is None:
            lock = _STEPS[core] = threading.RLock()
            step = core.step_fn

            def step_fn() -> Any:
                with lock:
                    return step()

            core.step_fn = step_fn
        return lock


class EngineCore:
    """An `LLM`'s engine core as the client reaches it, decided once by the type of vLLM's engine-core
    client: `SyncMPClient` (the engine core in its own process) takes a utility call on its input
    socket and answers through a future, and its monitor flags the process's death; `InprocClient`
    (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) holds the `EngineCore` itself, whose methods run in the
    calling thread (it dies with this process)."""

    def __init__(self, remote: Any, local: Any) -> None:
        from vllm.v1.executor.uniproc_executor import UniProcExecutor

        self.remote = remote
        """The `SyncMPClient`, or None."""
        self.local = local
        """The `InprocClient`'s `EngineCore`, or None."""
        self.sends = remote is not None
        """Utility calls go to another process, answered through a future (`send`)."""
        self.workers_here = local is not None and isinstance(local.model_executor, UniProcExecutor)
        """The engine core's worker runs its `collective_rpc` methods in the calling thread (vLLM's
        one-process executor, the external launcher's included): nothing waits on another process."""
        self._steps = step_lock(local) if local is not None else None
        """Held by each step of an in-process engine core (a `generate` on another thread)."""

    @classmethod
    def of(cls, core: Any) -> EngineCore:
        from vllm.v1.engine.core_client import InprocClient, SyncMPClient

        if isinstance(core, SyncMPClient):
            return cls(core, None)
        if isinstance(core, InprocClient):
            return cls(None, core.engine_core)
        raise TypeError(f"an LLM's engine-core client is a SyncMPClient or an InprocClient, got {type(core).__name__}")

    def call(self, method: str, *args: Any) -> Any:
        """The in-process engine core's `method(*args)`, run in the calling thread (a remote one's
        calls go through `send`)."""
        return getattr(self.local, method)(*args)

    def between_steps(self, timeout_s: float, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)`, made once no step of the in-process engine core is running (waited for at most
        `timeout_s`; TimeoutError past it). Why: its steps run in the thread of whoever generates, and
        vLLM's pause only sets the scheduler's state: a pause made while a step's forward was still
        launching would let the copies that follow land between two of its layers (one step, two
        versions). Made between steps, a pause holds every later step off the model; a prefix-cache
        reset that preempts the running requests does not move them under a step's schedule."""
        assert self._steps is not None, "between_steps is for an engine core in this process"
        if not self._steps.acquire(timeout=timeout_s):
            raise TimeoutError(f"a step of the engine core ran past {timeout_s:.0f}s")
        try:
            return fn(*args)
        finally:
            self._steps.release()

    def send(self, method: str, *args: Any) -> tuple[int, cf.Future[Any]]:
        """`SyncMPClient.call_utility` without its wait: the call id and the future vLLM's output
        thread answers (it pops the future from `utility_results` when the answer arrives)."""
        from vllm.v1.engine import EngineCoreRequestType

        call_id = uuid.uuid1().int >> 64  # as vLLM's call_utility numbers its calls
        future: cf.Future[Any] = cf.Future()
        self.remote.utility_results[call_id] = future
        try:
            self.remote._send_input(EngineCoreRequestType.UTILITY, (0, call_id, method, args))
        except BaseException:
            self.remote.utility_results.pop(call_id, None)
            raise
        return call_id, future

    def forget(self, call_id: int) -> None:
        """Drop the future of a call that timed out once no answer can come (the engine core is dead):
        while it lives, its late answer pops the future itself, and vLLM's output thread dies on an
        answer whose future is gone (`utility_results.pop` raises KeyError)."""
        if self.dead():
            self.remote.utility_results.pop(call_id, None)

    def dead(self) -> bool:
        return self.remote is not None and bool(self.remote.resources.engine_dead)
