"""Whether a descriptor has something to read, for any descriptor number.

`select.select` refuses descriptors from 1024 on (FD_SETSIZE), and a trainer reaches them easily:
each host tensor it shares with a colocated receiver keeps a descriptor open (a Qwen3-30B-A3B-sized
state dict: ~9,400), beside its data loaders' and process groups'. Starting a reference receiver
then failed with "filedescriptor out of range in select()", and every control connection was taken
for closed by the peer. `poll` has no such bound.
"""

from __future__ import annotations

import select
from typing import Protocol

__all__ = ["readable"]


class _HasFileno(Protocol):
    def fileno(self) -> int: ...


def readable(f: int | _HasFileno, timeout_s: float = 0.0) -> bool:
    """Whether `f` (a descriptor, or an object with `fileno()`: a file, a socket) can be read without
    blocking, or is at end of file or hung up, within `timeout_s` (0: now)."""
    poller = select.poll()
    poller.register(f, select.POLLIN | select.POLLPRI)
    return bool(poller.poll(max(0, int(timeout_s * 1000))))
