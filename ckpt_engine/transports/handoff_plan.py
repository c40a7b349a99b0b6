"""Which senders of a weight-sync group hand their buckets over in memory: decided once, at join.

Every rank publishes its device identity through the rendezvous store; the first receiver rank
compares them (or applies an override), checks that the group can run that way, and publishes the
verdict, so every rank acts on the same decision and a refusal reaches every rank as one error.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

import msgpack

from ckpt_engine.engine import TransferError

__all__ = ["agree_on_local_senders", "wait_keys"]


def wait_keys(store: Any, keys: list[str], what: str, timeout_s: float, rank: int | None) -> None:
    """Wait for store keys within `timeout_s`; a TransferError names what was awaited."""
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except Exception as exc:
        raise TransferError(f"rank {rank}: {what} did not arrive within {timeout_s}s: {exc}") from exc


def agree_on_local_senders(
    store: Any, *, rank: int, num_senders: int, world_size: int, identity: str, override: Sequence[int] | None,
    timeout_s: float, backend: str,
) -> frozenset[int]:
    """Collective over the group's ranks: the senders that share the (single) receiver's device.
    `override` is applied by the first receiver rank only. ValueError on every rank when a sender
    shares a receiver's device but the group has more than one receiver rank."""
    store.set(f"handoff/identity/{rank}", identity)
    if rank == num_senders:
        keys = [f"handoff/identity/{r}" for r in range(world_size)]
        wait_keys(store, keys, "every rank's device identity", timeout_s, rank)
        ids = [store.get(k).decode() for k in keys]
        local = [s for s in range(num_senders) if ids[s] in ids[num_senders:]] if override is None else list(override)
        error = None
        if override is not None and any(s >= num_senders for s in override):
            error = f"{backend}: local_senders={list(override)} names senders outside [0, {num_senders})"
        elif local and world_size - num_senders != 1:
            error = (f"{backend}: senders {local} share a device with a receiver and hand their buckets over in memory, "
                     f"which needs exactly one receiver rank; this group has {world_size - num_senders} (use one receiver "
                     "rank, or put the receivers on devices no sender uses)")
        store.set("handoff/plan", msgpack.packb({"local": local, "error": error}))
    wait_keys(store, ["handoff/plan"], "the receiver's hand-off plan", timeout_s, rank)
    try:
        plan = msgpack.unpackb(store.get("handoff/plan"), raw=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise ValueError(f"{backend}: undecodable hand-off plan in the rendezvous store: {exc}") from exc
    if not isinstance(plan, dict) or set(plan) != {"local", "error"} or not isinstance(plan["error"], (str, type(None))):
        raise ValueError(f"{backend}: malformed hand-off plan in the rendezvous store: {plan!r:.200}")
    if plan["error"] is not None:
        raise ValueError(plan["error"])
    local = plan["local"]
    if not isinstance(local, list) or not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s < num_senders for s in local):
        raise ValueError(f"{backend}: malformed hand-off plan in the rendezvous store: {plan!r:.200}")
    return frozenset(local)
