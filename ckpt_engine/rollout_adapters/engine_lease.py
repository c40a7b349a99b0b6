"""Which weight-sync group owns an engine process, for how long (the reference receiver's guard).

An engine belongs to one weight-sync group at a time: `claim(owner, lease_s)` by a daemon makes
every state-changing call from anyone else fail until the owner releases it or stops renewing the
lease (any call from the owner, including health probes, renews it).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["DEFAULT_LEASE_S", "EngineLease"]

DEFAULT_LEASE_S = 60.0


class EngineLease:
    """The owner of one engine and its lease."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.owner: str | None = None
        self._until = 0.0
        self._lease_s = DEFAULT_LEASE_S

    def claim(self, owner: str, lease_s: float) -> None:
        """Make `owner` (a weight-sync group) this engine's only controller for `lease_s`, renewed by its calls."""
        if not isinstance(owner, str) or not 0 < len(owner) <= 128:
            raise ValueError(f"owner must be a non-empty string of at most 128 characters, got {owner!r:.40}")
        if isinstance(lease_s, bool) or not isinstance(lease_s, (int, float)) or not 0 < lease_s <= 86400:
            raise ValueError(f"lease_s must be a number in (0, 86400], got {lease_s!r:.40}")
        with self._lock:
            self._check_locked(owner)
            self.owner, self._lease_s = owner, float(lease_s)
            self._until = time.monotonic() + self._lease_s

    def release(self, owner: str) -> bool:
        with self._lock:
            if self.owner is None or owner != self.owner:
                return False
            self.owner = None
            return True

    def renew(self, owner: str | None) -> None:
        """A health probe from the owner renews its lease (and checks nothing)."""
        if owner is not None:
            with self._lock:
                if owner == self.owner:
                    self._until = time.monotonic() + self._lease_s

    @property
    def owned(self) -> bool:
        return self.owner is not None and time.monotonic() < self._until

    def _check_locked(self, owner: str | None) -> None:
        now = time.monotonic()
        if self.owner is not None and now < self._until and owner != self.owner:
            who = "a caller that names no group" if owner is None else f"group {owner[:16]}"
            raise PermissionError(
                f"engine belongs to weight-sync group {self.owner[:16]} (another job or daemon); refusing {who}. "
                f"It is released when that group lets it go (leave/close) or {self._until - now:.0f}s after that group was last heard from"
            )
        if owner is not None:  # the owner's calls renew its lease; an unowned engine is claimed by its first caller
            self.owner, self._until = owner, now + self._lease_s

    def owned_call(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn` as an RPC handler that takes the caller's `owner` and refuses anyone but the owner."""

        def call(owner: str | None = None, **params: Any) -> Any:
            if owner is not None and (not isinstance(owner, str) or not 0 < len(owner) <= 128):
                raise ValueError(f"owner must be a non-empty string of at most 128 characters or nil, got {owner!r:.40}")
            with self._lock:
                self._check_locked(owner)
            return fn(**params)

        return call
