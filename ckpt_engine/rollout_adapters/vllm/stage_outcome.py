"""How a vLLM worker tells the trainer side (`VllmRollout`) that a staged receive ended, on every
route: the worker extension's and vLLM's weight-transfer API.

vLLM 0.32's `update_weights` returns nothing from the workers, so a worker cannot answer "still
streaming" or "done" through it except by raising, and every raise leaves tracebacks in vLLM's worker,
engine-core and API-server logs; polling the extension instead costs a call between two engine steps
every few ms. Instead each worker sets one key in the weight-sync group's own
rendezvous store (the TCPStore whose client `Rendezvous.connect_store` makes, every key under the
group's token) when its staged version is whole and checked, or has failed: `ok` or
`failed: <why>`, plain UTF-8 bytes. The key names the sync's ticket (the trainer side makes a new one
per staged receive and sends it in the receive call) and the worker's rank in the group. The trainer
side (`StagedOutcomes`) waits for every rank's key (bounded), reads them, and then swaps or discards.

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
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "FAILED", "OK", "STOPPED", "Outcomes", "StagedOutcomes", "check_ticket", "clear_outcomes", "new_ticket", "outcome_key", "report_outcome", "stop_waiting",
    "wait_outcomes",
]

logger = logging.getLogger(__name__)

_STOP_WAIT_S = 5.0
"""How long a discard or leave waits for a stopped staged receive to let go of the handle's store
client (well inside the session's 10 s for a discard: its stopped wait returns at once)."""
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
    store.set(outcome_key(ticket, rank), value.encode("utf-8", "replace"))  # type: ignore[arg-type]  # a Store takes bytes too


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


class StagedOutcomes:
    """Trainer side: one engine handle's staged receives, as its workers report their ends in the
    group's store. `receiving()` opens one under a fresh ticket, `wait` waits for every rank (at
    most 2 x `timeout_s`), `check` raises for a failed, stopped or silent one; a discard or leave on
    another thread `stop`s a wait in flight and `clear`s the keys after the workers discarded."""

    def __init__(self, engine: str, timeout_s: float) -> None:
        self.engine, self.timeout_s = engine, timeout_s
        self._rendezvous: Any = None  # the group's Rendezvous: its store holds the outcome keys
        self._ranks: list[int] = []  # the engine's workers' ranks in the weight-sync group
        self._store: Any = None  # this handle's client of the store, opened at the first staged receive
        self._ticket: str | None = None
        """The last staged receive's ticket while its outcome keys may still land (this side owns them)."""
        self._idle = threading.Event()
        """Set while no staged receive is between its start and the end of its wait (a discard or
        leave on another thread stops that wait, then waits for this before touching the client)."""
        self._idle.set()
        self._stopped = False  # a discard or leave stopped the staged receive in flight: it owns the cleanup

    def join(self, rendezvous: Any, ranks: list[int]) -> None:
        """A new group (a new store prefix): the workers report under `ranks` there."""
        self._rendezvous, self._ranks, self._store, self._ticket = rendezvous, list(ranks), None, None

    def take_over(self, previous: StagedOutcomes) -> None:
        """A new handle on an engine still in `previous`'s group (a session rebound to it): its
        staged receives report there (it never joins: the engine already did)."""
        self.join(previous._rendezvous, previous._ranks)

    def _client(self) -> Any:
        if self._rendezvous is None:
            raise RuntimeError(f"engine {self.engine!r}: a staged receive before join(); join the weight-sync group first")
        if self._store is None:
            self._store = self._rendezvous.connect_store(is_master=False)
        return self._store

    @contextmanager
    def receiving(self) -> Iterator[str]:
        """One staged receive's ticket; start it and `wait` inside (a discard meanwhile stops the wait)."""
        self._client()  # before any worker can report: a discard must be able to clear
        ticket = self._ticket = new_ticket()
        self._stopped = False
        self._idle.clear()
        try:
            yield ticket
        finally:
            self._idle.set()

    def wait(self, ticket: str) -> Outcomes:
        return wait_outcomes(self._client(), ticket, self._ranks, self.timeout_s * 2)

    def check(self, outcomes: Outcomes, discard: Callable[[], None]) -> None:
        """After the wait: a receive that a discard or leave stopped is raised as such (that call does
        the cleanup); a failed one is discarded and raised naming the engine and the worker's why; a
        worker that reported nothing in time (dead, hung) is raised naming its rank (the session then
        discards: the engine keeps its old weights)."""
        if self._stopped:
            raise RuntimeError(f"engine {self.engine!r}: staged receive stopped (discarded or left) before worker rank(s) {outcomes.missing} reported")
        failed = outcomes.failed
        if failed:
            rank, why = next(iter(failed.items()))
            logger.warning("engine %s: staged receive failed on worker rank(s) %s: %s", self.engine, sorted(failed), why)
            discard()
            raise RuntimeError(f"engine {self.engine!r}: staged receive failed (rank {rank}: {why[:500]}); it keeps serving its old weights")
        if outcomes.missing:
            raise TimeoutError(
                f"engine {self.engine!r}: staged receive: worker rank(s) {outcomes.missing} reported no outcome within "
                f"{self.timeout_s * 2:.0f}s ({outcomes.why_missing}); the worker died or hangs"
            )
        self._ticket = None  # every worker reported, and its key is gone

    def stop(self) -> bool:
        """End a staged receive in flight on another thread (its start call, or its wait) through a
        store client of its own (the waiting thread holds the handle's): every worker's key not set
        yet gets `stopped`, so the wait returns at once, or at once when it starts; then wait, bounded,
        until that thread is done with the client. A wait must not outlive the store it waits in, and
        the client serves one call at a time. Whether that thread is done (else the caller goes on
        after `_STOP_WAIT_S`, and clears through a client of its own)."""
        ticket, rendezvous = self._ticket, self._rendezvous
        if self._idle.is_set() or ticket is None or rendezvous is None:
            return True
        self._stopped = True
        try:
            stop_waiting(rendezvous.connect_store(is_master=False), ticket, self._ranks)
        except Exception as exc:  # the store is gone: so is the wait
            logger.info("engine %s: could not stop the staged receive's wait: %s", self.engine, exc)
        bound = min(self.timeout_s, _STOP_WAIT_S)
        if self._idle.wait(bound):
            return True
        logger.warning("engine %s: the staged receive did not end within %.0fs of being stopped", self.engine, bound)
        return False

    def clear(self, idle: bool) -> None:
        """Delete every worker's outcome key under the last staged receive's ticket (a `stopped` mark
        written after the wait ended included). After a discard no worker reports any more (its
        discard waits for its staged receive to report its end). `idle`: the receive's thread is
        done with the handle's store client (else a client of its own clears)."""
        ticket, self._ticket = self._ticket, None
        if ticket is None or self._rendezvous is None:
            return
        try:
            store = self._client() if idle else self._rendezvous.connect_store(is_master=False)
            clear_outcomes(store, ticket, self._ranks)
        except Exception as exc:  # the store is gone: nothing is left in it
            logger.info("engine %s: staged outcome keys not cleared: %s", self.engine, exc)

    def leave(self) -> None:
        """Before the group goes: a wait in flight lets go of the store, the keys go."""
        self.clear(self.stop())
        self._rendezvous, self._store = None, None
