"""The reference receiver's "engine steps": a loop that reads every weight, step after step.

A stand-in for an inference engine's forward passes, so tests can prove a staged sync never lets a
step see a mix of two versions: each step holds the step lock while it reads, records the version
it served and a digest of every weight it read; a swap takes the same lock between two steps. A
pause (today's order) stops the loop until resume. The stall of a sync is the time the loop could
not step because of it: the swap's hold of the lock, or pause to resume.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

__all__ = ["EngineSteps", "StepRecord", "staging_room", "weights_digest"]

logger = logging.getLogger(__name__)

_KEEP = 4096
"""Step records kept (the oldest are dropped)."""


def weights_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """A digest of every tensor's bytes, in name order: equal digests = bit-identical weights."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(name.encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().data)  # read in place, no copy
    return h.hexdigest()


def staging_room(nbytes: int, budget_bytes: int | None, device: torch.device) -> bool:
    """Whether a staging copy of `nbytes` fits: within `budget_bytes` (None: no cap) and within the
    device's free memory (CUDA: `torch.cuda.mem_get_info`; host: the available physical pages)."""
    if budget_bytes is not None and nbytes > budget_bytes:
        return False
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return nbytes <= free
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return budget_bytes is not None
    return nbytes <= free


@dataclass(frozen=True)
class StepRecord:
    """One engine step: when it ran, the version the engine claimed, what it read."""

    index: int
    start: float
    end: float
    version: int | None
    digest: str

    def to_wire(self) -> list[object]:
        return [self.index, self.start, self.end, self.version, self.digest]


class EngineSteps:
    """The step loop (a daemon thread, for the life of the engine process) over `tensors`, started by `start()`.

    `interval_s` is the idle time between two steps (the box's CPUs are shared)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], version: Callable[[], int | None], interval_s: float) -> None:
        if interval_s < 0:
            raise ValueError(f"step interval must be >= 0 seconds, got {interval_s}")
        self._tensors = tensors
        self._version = version
        self.interval_s = interval_s
        self.lock = threading.Lock()
        """Held by a step while it reads, and by a swap while it writes."""
        self._running = threading.Event()
        self._running.set()
        self.records: list[StepRecord] = []
        self.count = 0

    def start(self) -> None:
        threading.Thread(target=self._loop, name="ref-engine-steps", daemon=True).start()

    def _loop(self) -> None:
        while True:
            self._running.wait()
            with self.lock:
                if not self._running.is_set():
                    continue  # paused while this step waited for the lock
                t0 = time.monotonic()
                digest = weights_digest(self._tensors)
                record = StepRecord(self.count, t0, time.monotonic(), self._version(), digest)
                self.count += 1
                self.records.append(record)
                if len(self.records) > _KEEP:
                    del self.records[: len(self.records) - _KEEP]
            time.sleep(self.interval_s)

    def pause(self) -> None:
        """Stop stepping (today's order: the whole sync); returns once no step is running."""
        with self.lock:
            self.pause_locked()

    def pause_locked(self) -> None:
        """`pause` by a caller that holds `lock` (a failed swap)."""
        self._running.clear()

    def resume(self) -> None:
        """Step again."""
        with self.lock:
            self.resume_locked()

    def resume_locked(self) -> None:
        """`resume` by a caller that holds `lock` (a swap ends with the engine serving)."""
        self._running.set()

    def since(self, index: int) -> list[list[object]]:
        """The kept records from step `index` on, as plain lists (for the control wire)."""
        return [r.to_wire() for r in self.records if r.index >= index]
