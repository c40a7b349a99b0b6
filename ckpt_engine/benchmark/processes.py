"""Running a set of child processes to completion within one deadline.

Benchmarks and tests start one process per rank; a rank that hangs (a peer died inside a
collective) must not hang the caller, so every wait shares one deadline and stragglers are killed.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from multiprocessing.process import BaseProcess

__all__ = ["run_processes"]


def run_processes(procs: Sequence[BaseProcess], timeout_s: float) -> list[int]:
    """Start `procs`, wait for all of them within `timeout_s` in all, kill and reap the ones still
    running then (also when the wait is interrupted). Returns the indices of the killed ones; each
    process's `exitcode` says how the others ended."""
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    hung: list[int] = []
    try:
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
    finally:
        for i, p in enumerate(procs):
            if p.is_alive():
                hung.append(i)
                p.kill()
                p.join(10)
    return hung
