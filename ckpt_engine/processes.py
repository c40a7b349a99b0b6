"""Running a set of child processes to completion within one deadline.

Benchmarks and tests start one process per rank; a rank that hangs (a peer died inside a
collective) must not hang the caller, so every wait shares one deadline and stragglers are killed.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Sequence
from multiprocessing.process import BaseProcess

from ckpt_engine.readable import readable

__all__ = ["read_ready_line", "run_processes"]


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


def read_ready_line(proc: subprocess.Popen[str], prefix: str, what: str, timeout_s: float) -> str:
    """What follows `prefix` on the first line of `proc`'s stdout that starts with it (a child
    announcing it is ready); kills the child and raises naming `what` if none comes within
    `timeout_s` or the child exits first."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if readable(proc.stdout, 0.5):
            line = proc.stdout.readline()
            if line.startswith(prefix):
                return line[len(prefix) :].strip()
            if not line and proc.poll() is not None:
                break
        elif proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError(f"{what} did not start within {timeout_s}s (exit code {proc.poll()})")
