"""Which weight-sync session last joined each engine, within this process (claims).

Joining a group makes an engine leave the group it was in, so a session that joined it earlier is
outdated: its next sync would stream into a group the engine no longer listens to. Sessions claim
their engines when they join and check the claim before pausing anything, so an outdated session
is refused with a clear error instead of failing mid-stream.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Hashable, Mapping
from typing import Any

__all__ = ["EngineClaims", "claims"]


class EngineClaims:
    """engine key -> the session that last joined it (weakly held: a dropped session frees it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owners: dict[Hashable, weakref.ref[Any]] = {}

    def claim(self, keys: Mapping[str, Hashable], owner: Any) -> None:
        ref = weakref.ref(owner)
        with self._lock:
            for key in keys.values():
                self._owners[key] = ref

    def taken_over(self, keys: Mapping[str, Hashable], owner: Any) -> list[str]:
        """Names (keys of `keys`) whose engine another live session joined after `owner` did."""
        out = []
        with self._lock:
            for name, key in keys.items():
                ref = self._owners.get(key)
                current = ref() if ref is not None else None
                if current is not None and current is not owner:
                    out.append(name)
        return out

    def check_current(self, keys: Mapping[str, Hashable], owner: Any) -> None:
        """Raise (nothing paused or sent) if another session has joined any of these engines
        since `owner` did."""
        lost = self.taken_over(keys, owner)
        if lost:
            raise RuntimeError(
                f"this weight-sync session is outdated: engine(s) {', '.join(map(repr, lost))} joined another session's "
                "group after this one's; nothing was paused or sent. Sync through the newer session (or close this one "
                "and make a new one, which takes the engines back)"
            )

    def release(self, owner: Any) -> None:
        with self._lock:
            for key in [k for k, ref in self._owners.items() if ref() is owner or ref() is None]:
                del self._owners[key]


claims = EngineClaims()
"""The process-wide table every WeightSyncSession uses."""
