"""An unstaged receive on a thread of the vLLM worker, so the engine core is free while it streams.

vLLM's engine core runs one call at a time: while `ckpt_receive` runs inside its `collective_rpc`
the core can do nothing else, so the prefix-cache reset of a sync (2.3 ms on a 7B engine at 30 %
of an H200: vLLM 0.26 walks every KV block) had to wait for the transfer's end. Begun here, the
receive runs on this thread while `collective_rpc` returns at once; the handle then resets the
cache beside the transfer (the engine is paused: nothing is cached meanwhile) and a second call
collects the receive's answer. The staged receive (`vllm/staging.py`) keeps its own thread: it
streams while the engine steps, into a copy.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["BackgroundReceive"]


class BackgroundReceive:
    """`receive()` on a thread of its own, on `device`, without autograd; `result` waits for it."""

    def __init__(self, receive: Callable[[], dict[str, Any]], device: torch.device) -> None:
        self._answer: dict[str, Any] | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(receive, device), name="ckpt-receive", daemon=True)
        self._thread.start()

    def _run(self, receive: Callable[[], dict[str, Any]], device: torch.device) -> None:
        try:
            if device.type == "cuda":  # a new thread starts on the process's first device
                torch.cuda.set_device(device)
            with torch.no_grad():  # grad mode is per thread
                self._answer = receive()
        except BaseException as exc:  # handed to the caller of result()
            self._error = exc

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def result(self, timeout_s: float) -> dict[str, Any]:
        """The receive's answer; raises its error, or TimeoutError if it runs past `timeout_s`."""
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"the receive on this worker did not end within {timeout_s:.0f}s")
        if self._error is not None:
            raise self._error
        assert self._answer is not None
        return self._answer
