"""Weight versions: the one rule every protocol edge checks them by.

A version labels the weights an engine serves (vLLM stamps it on every output), so it must be a
plain int that fits every consumer (msgpack, C int64, torch) and only ever grow. Checking it where
it enters (a control request, a CLI flag, a `sync(version=...)` call) keeps a bad value from
reaching the middle of a sync, where it would fail after engines were paused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["MAX_VERSION", "check_version", "next_version"]

MAX_VERSION = 2**63 - 1
"""Largest version: an int64, what msgpack, torch and C consumers all hold."""


def check_version(value: Any, what: str, *, at_least: int = 0) -> int:
    """`value` as a version in [at_least, MAX_VERSION], or ValueError naming `what` and the range."""
    if isinstance(value, bool) or not isinstance(value, int) or not at_least <= value <= MAX_VERSION:
        raise ValueError(f"{what} must be an int in [{at_least}, 2**63-1], got {value!r:.40}")
    return value


def next_version(held: Mapping[str, int | None], last: int, requested: int | None) -> int:
    """The version a sync stamps: `requested`, or one past the newest any engine holds (`held`,
    by engine name) or the caller last stamped (`last`); a requested one below what an engine
    holds is refused (versions only grow)."""
    newest = max([v for v in held.values() if v is not None] + [last])
    if requested is None:
        return check_version(newest + 1, "the next version")
    check_version(requested, "version")
    ahead = {n: v for n, v in held.items() if v is not None and v > requested}
    if ahead:
        raise ValueError(
            f"version {requested} is older than what engines hold ({', '.join(f'{n}: v{v}' for n, v in ahead.items())}); "
            f"versions only grow: pass version=None (next: {newest + 1}) or a version >= {newest}"
        )
    return requested
