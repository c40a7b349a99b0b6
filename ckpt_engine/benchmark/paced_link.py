"""An emulated network link per rank for CPU benchmarks: `ckpt-engine bench --link-mb-s RATE`.

On one host gloo's TCP sockets run at memory speed and every rank shares the same few cores, so a
CPU run measures cores, not links. Here every message a rank posts (a sender's broadcast, a
receiver's receive of it) takes its turn on that rank's own emulated link of RATE MB/s: one link
per process, shared by every group and thread of the process, each message holding it for
bytes / RATE. A message is posted when the link is free for it and counts as done no sooner than
its link time has passed, so the real socket work overlaps the emulated time instead of adding to
it. A receiver then takes in at most RATE and a sender sends at most RATE, as ranks on their own
NICs would. Benchmarks only: the library
never imports it.
"""

from __future__ import annotations

import threading
import time
from typing import Any, ClassVar

import torch

from ckpt_engine.registry import CheckpointEngineRegistry
from ckpt_engine.transports.gloo import GlooTransport

__all__ = ["NAME", "LinkPacer", "PacedGlooTransport", "install"]

NAME = "gloo_paced"


class LinkPacer:
    """One rank's link: messages take it in turn, each for nbytes / rate seconds."""

    def __init__(self, rate_bytes_s: float) -> None:
        if rate_bytes_s <= 0:
            raise ValueError(f"link rate must be > 0 bytes/s, got {rate_bytes_s!r}")
        self.rate = rate_bytes_s
        self._free_at = 0.0
        self._lock = threading.Lock()
        self.bytes = 0

    def take(self, nbytes: int) -> float:
        """Wait until the link is free for this message; returns when it will have crossed."""
        with self._lock:
            start = max(time.perf_counter(), self._free_at)
            self._free_at = start + nbytes / self.rate
            until = self._free_at
            self.bytes += nbytes
        _sleep_until(start)
        return until


def _sleep_until(t: float) -> None:
    delay = t - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


class _PacedWork:
    """A posted message's work: done when gloo is done and its link time has passed."""

    def __init__(self, work: Any, until: float) -> None:
        self.work = work
        self.until = until

    def wait(self, *args: Any) -> Any:
        out = self.work.wait(*args)
        _sleep_until(self.until)
        return out

    def is_completed(self) -> bool:
        return bool(self.work.is_completed()) and time.perf_counter() >= self.until


class PacedGlooTransport(GlooTransport):
    """gloo whose every posted message first crosses this process's `LinkPacer`."""

    name = NAME
    pacer: ClassVar[LinkPacer | None] = None

    def _pace(self, nbytes: int) -> float:
        if self.pacer is None:
            raise RuntimeError("call paced_link.install(rate) in this process before using the gloo_paced backend")
        return self.pacer.take(nbytes)

    def broadcast(self, gid: int, msg: torch.Tensor) -> Any:
        until = self._pace(msg.numel() * msg.element_size())
        return _PacedWork(super().broadcast(gid, msg), until)

    def post_group(self, gid: int, slot: int, msgs: list[torch.Tensor]) -> Any:
        until = self._pace(sum(m.numel() * m.element_size() for m in msgs))
        return _PacedWork(super().post_group(gid, slot, msgs), until)


def install(rate_mb_s: float) -> LinkPacer:
    """Give this process a link of `rate_mb_s` MB/s (10^6 bytes) and register `gloo_paced`."""
    pacer = PacedGlooTransport.pacer = LinkPacer(rate_mb_s * 1e6)
    if NAME not in CheckpointEngineRegistry.names():
        CheckpointEngineRegistry.add(NAME, PacedGlooTransport)
    return pacer
