"""How the native vLLM backend's workers tell the trainer side that a staged receive ended.

vLLM 0.32's `update_weights` returns nothing from the workers, so a worker cannot answer "still
streaming" or "done" through it except by raising, and every raise leaves tracebacks in vLLM's worker,
engine-core and API-server logs. Instead each worker sets one key in the weight-sync group's own
rendezvous store (the TCPStore whose client `Rendezvous.connect_store` makes, every key under the
group's token) when its staged version is whole and checked, or has failed: `ok` or
`failed: <why>`, plain UTF-8 bytes. The key names the sync's ticket (the trainer side makes a new one
per staged receive and sends it in the receive call) and the worker's rank in the group. The trainer
side waits for every rank's key (bounded), reads them, and then swaps or discards.

The side that waits owns the ticket: it deletes every rank's key after the wait, whatever the wait
found (`wait_outcomes`), and again once the workers discarded (`clear_outcomes`): a receive that
started on some workers and failed on others, or a worker that reports after the wait ended, would
otherwise leave its key in the store for as long as the group lives. A worker's discard returns only
after its staged receive reported its end, so nothing lands after that second clear.
"""

from __future__ import annotations

import datetime
import logging
import re
import uuid
from dataclasses import dataclass, field

import torch

__all__ = [
    "FAILED", "OK", "STOPPED", "Outcomes", "check_ticket", "clear_outcomes", "new_ticket", "outcome_key", "report_outcome", "stop_waiting",
    "wait_outcomes",
]

logger = logging.getLogger(__name__)

OK = "ok"
STOPPED = "stopped"
"""Written by the waiting side itself (`stop_waiting`) into a rank's key that had no outcome yet."""
FAILED = "failed: "
"""Starts a failed worker's outcome; its reason follows."""
_TICKET = re.compile(r"[0-9A-Za-z_-]{1,64}")


def new_ticket() -> str:
    """A fresh ticket for one staged receive (keys of two syncs never meet)."""
    return uuid.uuid4().hex


def check_ticket(ticket: object) -> str:
    """`ticket` when it can name a store key, else ValueError naming it."""
    if not isinstance(ticket, str) or not _TICKET.fullmatch(ticket):
        raise ValueError(f"ticket must be 1-64 characters of [0-9A-Za-z_-], got {ticket!r:.80}")
    return ticket


def outcome_key(ticket: str, rank: int) -> str:
    return f"staged-outcome/{ticket}/{rank}"


def report_outcome(store: torch.distributed.Store, ticket: str, rank: int, error: str | None) -> None:
    """Worker side: rank `rank`'s staged receive under `ticket` ended (`error` None: whole and checked)."""
    value = OK if error is None else FAILED + error
    store.set(outcome_key(ticket, rank), value.encode("utf-8", "replace"))


@dataclass
class Outcomes:
    """What each rank reported (`ok` or `failed: why`), and the ranks that reported nothing in time."""

    reported: dict[int, str] = field(default_factory=dict)
    missing: list[int] = field(default_factory=list)
    why_missing: str = ""
    """The store's own words when the wait ended without every key (a timeout, a lost store)."""

    @property
    def failed(self) -> dict[int, str]:
        return {rank: value[len(FAILED):] if value.startswith(FAILED) else value for rank, value in self.reported.items() if value != OK}


def wait_outcomes(store: torch.distributed.Store, ticket: str, ranks: list[int], timeout_s: float) -> Outcomes:
    """Trainer side: wait up to `timeout_s` for every rank's outcome under `ticket`, read the keys
    that arrived, then delete every rank's key (a rank missing, or whose key `stop_waiting` wrote,
    is named in `missing`, never waited on again; its key, should it land later, is the caller's to
    clear after a discard)."""
    keys = {rank: outcome_key(ticket, rank) for rank in ranks}
    out = Outcomes()
    gone = False  # the store itself went away: touch it no more (each call would warn again)
    try:
        try:
            store.wait(list(keys.values()), datetime.timedelta(seconds=timeout_s))
        except torch.distributed.DistError as exc:
            gone = isinstance(exc, torch.distributed.DistNetworkError)
            out.why_missing = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
        for rank, key in keys.items():
            if gone:
                out.missing.append(rank)
                continue
            try:
                if out.why_missing and not store.check([key]):
                    out.missing.append(rank)
                    continue
                value = store.get(key).decode("utf-8", "replace")
            except torch.distributed.DistError as exc:  # the store itself is gone: nothing more to read
                logger.warning("staged outcome of rank %s under ticket %s unreadable: %s", rank, ticket, exc)
                gone = True
                out.missing.append(rank)
                out.why_missing = out.why_missing or str(exc).splitlines()[0][:300]
                continue
            if value == STOPPED:
                out.missing.append(rank)
                out.why_missing = out.why_missing or "the wait was stopped (the sync is being discarded, or the engine leaves)"
            else:
                out.reported[rank] = value
    finally:
        if not gone:
            clear_outcomes(store, ticket, ranks)
    return out


def stop_waiting(store: torch.distributed.Store, ticket: str, ranks: list[int]) -> None:
    """End a `wait_outcomes` in flight on another thread (the sync failed elsewhere, or the handle
    leaves) before the store it waits in can go away: every rank's key not set yet gets `STOPPED`,
    so the wait returns at once. A wait must not outlive its store: a store closed under a waiting
    client makes torch print "recvValueWithTimeout failed ... Connection was likely closed" with a
    C++ stack. `store` must be a client of its own (a client runs one call at a time, and the waiting
    thread holds its own until the wait ends); a worker's report that lands later overwrites the mark,
    and the caller clears both after the discard."""
    for rank in ranks:
        store.compare_set(outcome_key(ticket, rank), "", STOPPED)


def clear_outcomes(store: torch.distributed.Store, ticket: str, ranks: list[int]) -> int:
    """Delete every rank's outcome key under `ticket` (a key not set is no error); how many there
    were. A store that is gone holds nothing to delete."""
    deleted = 0
    for rank in ranks:
        try:
            deleted += bool(store.delete_key(outcome_key(ticket, rank)))
        except torch.distributed.DistError as exc:
            logger.info("staged outcome keys under ticket %s not cleared: the store is gone (%s)", ticket, str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__)
            break
    return deleted
