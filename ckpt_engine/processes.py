"""Running a set of child processes to completion within one deadline.

Benchmarks and tests start one process per rank; a rank that hangs (a peer died inside a
collective) must not hang the caller, so every wait shares one deadline and stragglers are killed.
"""

from __future__ import annotations

import random
import socket
import subprocess
import time
from collections.abc import Sequence
from multiprocessing.process import BaseProcess
from pathlib import Path

from ckpt_engine.readable import readable

__all__ = ["free_port", "read_ready_line", "run_processes"]


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


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now on `host` for a child server that takes its port by number (`vllm serve
    --port`), drawn at random from below the kernel's ephemeral range. A port `bind(0)` hands out
    comes from that range, where any other process's next `bind(0)` or outgoing connection may take
    it before the child binds it (a Ray trainer group's store failed with EADDRINUSE that way); a port
    below it is taken only by whoever asks for it by number."""
    low = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(max(1024, low // 2), low)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # that band is full: the OS's pick
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default, 32768, where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
