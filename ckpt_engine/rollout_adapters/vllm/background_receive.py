"""An unstaged receive on a thread of the vLLM worker, so the engine core is free while it streams.

vLLM's engine core runs one call at a time: while `ckpt_receive` runs inside its `collective_rpc`
the core can do nothing else, so the prefix-cache reset of a sync (2.3 ms on a 7B engine at 30 %
of an H200: vLLM 0.26 walks every KV block) had to wait for the transfer's end. Begun here, the
receive runs on this thread while `collective_rpc` returns at once; the handle then resets the
cache beside the transfer (the engine is paused: nothing is cached meanwhile) and a second call
collects the receive's answer. The staged receive (`vllm/staging.py`) keeps its own thread: it
streams while the engine steps, into a copy.

The thread is started once per worker and parked between syncs (issue 39). A thread started per
sync made `ckpt_receive_begin` answer late: `Thread.start()` waits until the new thread runs, and
the new thread then holds the GIL through the receive's setup while the worker's RPC thread waits
to send the answer (4.8 ms against a 1.0 ms round trip on the CPU box). Woken, the parked thread
needs no handshake: the begin answers as soon as it handed the receive over.

Where the receive copies straight out of a colocated sender's memory, its host work is one burst
(every copy launched in ~3 ms of a 7B sync, then ~8 ms of device copies): the cache reset's Python
walk beside that burst held the interpreter lock against it (in one process: the trainer's walk,
the receive's launches and the reset; a 7B sync's copies began 2.6 ms later). There the receive says
when its copies are queued (`copies_queued`): the begin answers then (`VllmReceiverCore.receive_begin`),
and the handle resets the cache while the device copies.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["ReceiveThread"]

PARK_S = 60.0
"""How long the parked thread sleeps between looks for work (it is woken at once by `start`)."""


class ReceiveThread:
    """One parked thread that runs each begun receive on `device`, without autograd; `start` hands
    it a receive and returns at once, `result` waits for that receive's answer."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._cond = threading.Condition()
        self._job: Callable[[], dict[str, Any]] | None = None
        self._done = threading.Event()
        self._done.set()
        self._quiet = threading.Event()  # the receive's host work is done (its copies queued), or it ended
        self._quiet.set()
        self._begun = False  # a receive handed over and not yet collected by `result`
        self._answer: dict[str, Any] | None = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        """Whether a receive handed over has not ended yet."""
        return not self._done.is_set()

    @property
    def begun(self) -> bool:
        """Whether a receive was handed over and its answer not yet taken."""
        return self._begun

    def start(self, receive: Callable[[], dict[str, Any]], quiet: bool = True) -> None:
        """Hand `receive` to the thread (started the first time); refused while one still runs.
        `quiet`: the worker's host is free for other work at once; else once `receive` calls
        `copies_queued` (or ends)."""
        with self._cond:
            if self.running:
                raise RuntimeError("a receive is already running on this worker")
            self._answer, self._error, self._job, self._begun = None, None, receive, True
            self._done.clear()
            if not quiet:
                self._quiet.clear()
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._park, name="ckpt-receive", daemon=True)
                self._thread.start()
            self._cond.notify()

    def _park(self) -> None:
        if self._device.type == "cuda":  # a new thread starts on the process's first device
            torch.cuda.set_device(self._device)
        while True:
            with self._cond:
                while self._job is None:
                    self._cond.wait(PARK_S)
                job, self._job = self._job, None
            try:
                with torch.no_grad():  # grad mode is per thread
                    self._answer = job()
            except BaseException as exc:  # handed to the caller of result()
                self._error = exc
            finally:
                self._quiet.set()
                self._done.set()

    def copies_queued(self) -> None:
        """The running receive has queued its last copy: the host is free (`quiet_within` answers True)."""
        self._quiet.set()

    def quiet_within(self, timeout_s: float) -> bool:
        """Whether the begun receive queued its copies or ended within `timeout_s` (waited for)."""
        return self._quiet.wait(timeout_s)

    def result(self, timeout_s: float) -> dict[str, Any]:
        """The begun receive's answer; raises its error, or TimeoutError if it runs past `timeout_s`
        (it stays begun: a later `result` may still collect it, a `start` is refused while it runs)."""
        if not self._begun:
            raise RuntimeError("no receive was begun on this worker")
        if not self._done.wait(timeout_s):
            raise TimeoutError(f"the receive on this worker did not end within {timeout_s:.0f}s")
        answer, error = self._answer, self._error
        self._answer, self._error, self._begun = None, None, False
        if error is not None:
            raise error
        assert answer is not None
        return answer
