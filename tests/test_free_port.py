"""`trainer.ports.free_port`: a port for a child server that takes its port by number is drawn from
below the kernel's ephemeral range, so no other process's `bind(0)` or outgoing connection can take
it before the child binds it (the race that failed a Ray trainer group with EADDRINUSE in CI)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from ckpt_engine.trainer.ports import free_port

pytestmark = pytest.mark.fast

RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


@pytest.mark.skipif(not RANGE.exists(), reason="no Linux ephemeral port range to read")
def test_a_free_port_lies_below_the_ephemeral_range_and_binds() -> None:
    low = int(RANGE.read_text().split()[0])
    ports = [free_port() for _ in range(20)]
    assert all(1024 <= p < low for p in ports), (low, ports)
    with socket.socket() as other:  # what another process's bind(0) gets: never one of ours
        other.bind(("127.0.0.1", 0))
        assert other.getsockname()[1] >= low
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
