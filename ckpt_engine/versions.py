"""Weight versions: the one rule every protocol edge checks them by.

A version labels the weights an engine serves (vLLM stamps it on every output), so it must be a
plain int that fits every consumer (msgpack, C int64, torch) and only ever grow. Checking it where
it enters (a control request, a CLI flag, a `sync(version=...)` call) keeps a bad value from
reaching the middle of a sync, where it would fail after engines were paused.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MAX_VERSION", "check_version"]

MAX_VERSION = 2**63 - 1
"""Largest version: an int64, what msgpack, torch and C consumers all hold."""


def check_version(value: Any, what: str, *, at_least: int = 0) -> int:
    """`value` as a version in [at_least, MAX_VERSION], or ValueError naming `what` and the range."""
    if isinstance(value, bool) or not isinstance(value, int) or not at_least <= value <= MAX_VERSION:
        raise ValueError(f"{what} must be an int in [{at_least}, 2**63-1], got {value!r:.40}")
    return value
