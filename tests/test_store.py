"""The rendezvous store's server (`ckpt_engine/store.py`): for an IPv4 host it listens on an IPv4
socket, so torch's per-connection name lookup gets an IPv4 peer address (which `/etc/hosts`
answers) instead of a v4-mapped one (which only DNS answers); for any other host it keeps torch's
own listener. Members connect and share keys either way, and the server's socket closes with it.
"""

from __future__ import annotations

import gc
import socket
from pathlib import Path

import pytest
import torch

from ckpt_engine.store import serve_store

pytestmark = pytest.mark.fast


def listening(port: int) -> set[str]:
    """Which of /proc/net/tcp (IPv4) and /proc/net/tcp6 hold a listening socket on `port`."""
    found = set()
    for table in ("tcp", "tcp6"):
        path = Path("/proc/net") / table
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                found.add(table)
    return found


def clients_share_keys(store: torch.distributed.TCPStore, host: str) -> None:
    a = torch.distributed.TCPStore(host, store.port, is_master=False, timeout=store.timeout)
    b = torch.distributed.TCPStore(host, store.port, is_master=False, timeout=store.timeout)
    a.set("k", "from a")
    assert b.get("k") == b"from a" and store.get("k") == b"from a"


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads the listening sockets from /proc/net")
def test_an_ipv4_host_gets_an_ipv4_listener_that_members_reach_and_that_closes_with_the_store() -> None:
    store = serve_store("127.0.0.1", 30)
    port = store.port
    assert listening(port) == {"tcp"}
    clients_share_keys(store, "127.0.0.1")
    del store
    gc.collect()
    assert listening(port) == set()


def has_ipv6() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::", 0))
        return Path("/proc/net/tcp6").exists()
    except OSError:
        return False


@pytest.mark.skipif(not has_ipv6(), reason="needs IPv6 (torch's own listener is dual-stack there) and /proc/net")
def test_a_host_name_keeps_torchs_own_listener() -> None:
    store = serve_store("localhost", 30)
    assert "tcp6" in listening(store.port)
    clients_share_keys(store, "localhost")
