"""`AdapterVersions`: the adapter versions one engine rank holds, and when each may go.

New requests get the newest version; a request that started under version v keeps v until it
ends. So a version stays while requests still use it, and goes after its last one: at most
`max_versions` live at once (the newest plus the older ones still in use). A sync whose version,
with the ones requests still use, would exceed that is refused before a byte moves, naming them.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Generic, TypeVar

__all__ = ["AdapterVersions"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class AdapterVersions(Generic[T]):
    """Version -> the engine's adapter object, oldest first. Not thread-safe: the engine calls it
    from the one thread that runs its steps and its control calls (a vLLM worker's)."""

    def __init__(self, max_versions: int) -> None:
        if isinstance(max_versions, bool) or not isinstance(max_versions, int) or max_versions < 1:
            raise ValueError(f"max_adapter_versions must be an int >= 1, got {max_versions!r}")
        self.max_versions = max_versions
        self.live: OrderedDict[int, T] = OrderedDict()
        self.in_use: set[int] = set()

    @property
    def newest(self) -> int | None:
        return next(reversed(self.live), None)

    def get(self, version: int) -> T | None:
        return self.live.get(version)

    def room_problem(self) -> str | None:
        """Why one more version cannot be installed now (None: it can): after it, the live versions
        are the new one and every version a request still uses."""
        busy = [v for v in self.live if v in self.in_use]
        if len(busy) + 1 > self.max_versions:
            return (
                f"the engine keeps at most max_adapter_versions={self.max_versions} adapter versions and requests still use "
                f"version(s) {busy}; wait for them to finish or raise max_adapter_versions"
            )
        return None

    def install(self, version: int, adapter: T) -> list[int]:
        """Make `version` the newest; returns the older versions to unload now (no request uses them)."""
        if self.newest is not None and version <= self.newest:
            raise ValueError(f"adapter version {version} is not newer than the newest held ({self.newest})")
        self.live[version] = adapter
        return self.observe(self.in_use)

    def observe(self, active: set[int]) -> list[int]:
        """The versions the engine's current requests use; returns older versions no request uses
        any more (to unload), dropping them from the live set."""
        self.in_use = set(active)
        newest = self.newest
        gone = [v for v in self.live if v != newest and v not in self.in_use]
        over = len(self.live) - len(gone) - self.max_versions
        if over > 0:  # cannot happen after room_problem() said yes; keep the bound anyway
            logger.warning("%d adapter versions in use exceed max_adapter_versions=%d", len(self.live) - len(gone), self.max_versions)
        for v in gone:
            del self.live[v]
        return gone
