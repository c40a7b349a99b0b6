"""The rendezvous store's server: a torch `TCPStore` master that listens on an IPv4 socket of its own
when the members dial an IPv4 address.

torch's store server turns the address of every peer that connects into a name (`getnameinfo`, a
reverse lookup) on its one event-loop thread. Its own listener is dual-stack, so an IPv4 peer,
loopback included, arrives as a v4-mapped IPv6 address, which `/etc/hosts` never matches: every
connection asks DNS, and where DNS drops the query each connection holds every member's store
traffic for the resolver's timeout (5 s by default). On a box whose resolver drops concurrent
queries, 24 of 120 loopback connects (8 members at once, fresh processes) waited 5.0 s each on
torch's listener and none on an IPv4 one (`bench/store_connects.py`). An IPv4 listener hands the
lookup an IPv4 address, which `/etc/hosts` answers for loopback and for the nodes it lists.
"""

from __future__ import annotations

import datetime
import ipaddress
import socket

import torch

__all__ = ["serve_store"]


def serve_store(host: str, timeout_s: float, *, world_size: int | None = None) -> torch.distributed.TCPStore:
    """A store server on a free port (`.port`) of every interface; its own client dials `host`.
    An IPv4 `host` gets an IPv4 listener (see above); any other keeps torch's."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if not _is_ipv4(host):
        return torch.distributed.TCPStore(host, 0, world_size, is_master=True, wait_for_workers=False, timeout=timeout)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("0.0.0.0", 0))
        port = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    # The store owns the socket from here and closes it with the server.
    return torch.distributed.TCPStore(
        host, port, world_size, is_master=True, wait_for_workers=False, timeout=timeout, master_listen_fd=sock.detach()
    )


def _is_ipv4(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).version == 4
    except ValueError:
        return False
