"""A port for a child server that takes its port by number (`vllm serve --port`, a Ray trainer
group's store), which the demo trainer starts."""

from __future__ import annotations

import random
import socket
from pathlib import Path

__all__ = ["free_port"]


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
