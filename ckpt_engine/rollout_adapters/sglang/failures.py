"""What the SGLang adapters saw fail, per weight-update group, for the wire's sender to stop at once.

SGLang's servers take each bucket in two halves: the adapter's `/update_weights_from_distributed`
request and the sender's broadcast. When a server dies or its scheduler fails mid-stream, the
request fails at once (500, a reset connection) but the sender's broadcast has nobody to tell it:
with the server's process still holding its end of the group it would wait `timeout_s`. The
adapters record each failure here under the group's name; the sender (`sglang/wire.py`) checks
while it waits and stops the sync at once, naming the engine. Thread-safe: adapters receive on the
session's pool threads while the sender streams on the caller's.
"""

from __future__ import annotations

import threading

__all__ = ["clear", "failures", "record"]

_lock = threading.Lock()
_failed: dict[str, dict[str, str]] = {}


def record(group_name: str, engine: str, why: str) -> None:
    """Engine `engine` of group `group_name` failed its part of the stream."""
    with _lock:
        _failed.setdefault(group_name, {})[engine] = why


def failures(group_name: str) -> dict[str, str]:
    """The engines of `group_name` that failed so far ({}: none), with why."""
    with _lock:
        return dict(_failed.get(group_name, {}))


def clear(group_name: str) -> None:
    """Forget a group's failures (it was left or rebuilt)."""
    with _lock:
        _failed.pop(group_name, None)
