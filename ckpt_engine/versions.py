"""Weight versions: the rules every protocol edge checks them by.

A version labels the weights an engine serves (vLLM stamps it on every output), so it must be a
plain int that fits every consumer (msgpack, C int64, torch), only ever grow and never label two
different sets of weights. Checking it where it enters (a control request, a CLI flag, a
`sync(version=...)` call) keeps a bad value from reaching the middle of a sync, where it would
fail after engines were paused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["MAX_VERSION", "MAX_VERSION_STEP", "VersionConflictError", "check_step", "check_version", "next_version"]

MAX_VERSION = 2**63 - 1
"""Largest version: an int64, what msgpack, torch and C consumers all hold."""

MAX_VERSION_STEP = 2**32
"""How far past the version it knows a party may move a job by report (a trainer's outcome sent
to `ckpt-engine serve`): a token holder cannot push the job to 2**63-1 and freeze every later sync."""


class VersionConflictError(ValueError):
    """An explicit version that engines already hold or have passed: someone else (another trainer,
    another session) moved them on. Raised before anything is paused; `ahead` maps each engine to
    the version it holds."""

    def __init__(self, message: str, ahead: Mapping[str, int]) -> None:
        super().__init__(message)
        self.ahead = dict(ahead)


def check_version(value: Any, what: str, *, at_least: int = 0) -> int:
    """`value` as a version in [at_least, MAX_VERSION], or ValueError naming `what` and the range."""
    if isinstance(value, bool) or not isinstance(value, int) or not at_least <= value <= MAX_VERSION:
        raise ValueError(f"{what} must be an int in [{at_least}, 2**63-1], got {value!r:.40}")
    return value


def check_step(value: int, current: int, what: str) -> int:
    """`value` if it is at most MAX_VERSION_STEP past `current` (and leaves room to go on)."""
    if value > current + MAX_VERSION_STEP or value >= MAX_VERSION:
        raise ValueError(
            f"{what} {value} jumps more than 2**32 past the current version {current} (or leaves no room for "
            "another version); refused so that no report can freeze the job's versions"
        )
    return value


def next_version(held: Mapping[str, int | None], sent: int, requested: int | None, completed: int | None = None) -> int:
    """The version of the next sync: one past the highest of what this trainer last `sent` and
    what any engine `held` (name -> complete version, None: none); an explicit `requested` must
    be new: below what an engine holds is refused, and so is equal to what an engine holds unless
    this trainer sent that version itself (a catch-up of the same weights) without `completed` it
    (the session's, or the one it replaced: a catch-up of it would stamp it on other weights), and
    so is a jump of more than MAX_VERSION_STEP (what engines refuse at their swap: it would freeze
    the job's versions). Raises ValueError, before anything is paused."""
    newest = max([v for v in held.values() if v is not None] + [sent])
    if requested is None:
        return check_version(newest + 1, "the next version")
    if check_version(requested, "version") == completed:  # the type first: True == 1
        raise ValueError(
            f"version {requested} was completed already (by this session or one it replaced): a version labels one set of "
            f"weights, so a new sync needs a new one (pass version=None: next {newest + 1})"
        )
    check_step(requested, newest, "version")
    ahead = {n: v for n, v in held.items() if v is not None and v > requested}
    if ahead:
        raise VersionConflictError(
            f"version {requested} is older than what engines hold ({', '.join(f'{n}: v{v}' for n, v in ahead.items())}); "
            f"versions only grow: pass version=None (next: {newest + 1}) or a version > {newest}",
            ahead,
        )
    same = [n for n, v in held.items() if v == requested]
    if same and requested != sent:
        raise VersionConflictError(
            f"version {requested} is what engine(s) {', '.join(map(repr, same))} already hold: a version labels one set of "
            f"weights, so a new sync needs a new one: pass version=None (next: {newest + 1}) or a version > {newest}",
            {n: requested for n in same},
        )
    return requested
