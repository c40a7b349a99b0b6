"""Waiting on one future per engine with one shared deadline, collecting who failed and why."""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from ckpt_engine.rollout_adapters.capabilities import Capable, bounded_within

if TYPE_CHECKING:
    from ckpt_engine.rollout_adapters.base import Membership

__all__ = ["ask_memberships", "collect_failures", "collect_memberships", "fan_out", "leave_all", "mark_stale_and_probe", "probe_all", "receive_failures", "wait_for_joins"]

logger = logging.getLogger(__name__)


E = TypeVar("E", bound=Capable)
T = TypeVar("T")


def fan_out(pool: cf.Executor, engines: Sequence[E], fn: Callable[[E], T], stage: str, timeout_s: float) -> tuple[dict[str, T], dict[str, str]]:
    """`fn` on every engine at once: ({engine: answer}, {engine: why it failed}), each wait within
    `timeout_s` in all. One engine whose calls end on their own within `timeout_s` (`bounded_calls`,
    a handle timeout no longer) is called on this thread: a pool thread's two hand-offs fewer a step
    (~0.1-0.3 ms each beside a busy interpreter)."""
    if len(engines) == 1 and bounded_within(engines[0], timeout_s):
        try:
            return {engines[0].name: fn(engines[0])}, {}
        except Exception as exc:
            return {}, {engines[0].name: f"{type(exc).__name__}: {exc}"}
    futures = {e.name: pool.submit(fn, e) for e in engines}
    failed = collect_failures(futures, stage, timeout_s)
    return {name: f.result() for name, f in futures.items() if name not in failed}, failed


def collect_failures(futures: dict[str, cf.Future[Any]], stage: str, timeout_s: float) -> dict[str, str]:
    """{engine: reason} for every future that raised or did not finish within `timeout_s` in all."""
    failed: dict[str, str] = {}
    deadline = time.monotonic() + timeout_s
    for name, fut in futures.items():
        try:
            fut.result(timeout=max(0.0, deadline - time.monotonic()))
        except cf.TimeoutError:
            failed[name] = f"no answer to {stage} within {timeout_s}s"
        except Exception as exc:
            failed[name] = f"{type(exc).__name__}: {exc}"
    return failed


def receive_failures(
    members: Iterable[Any], receives: dict[str, cf.Future[Any]], grace_s: float, failing: bool = False,
) -> tuple[dict[str, str], set[str]]:
    """({engine: reason}, the unreachable) after a transfer: the receives that failed, or, when some
    member is dead, only the dead ones (a receiver that merely timed out behind a dead peer is not
    the cause). Each member is probed at most once, and only once the transfer failed; the caller
    probes no more. The unreachable are not waited for again. `failing`:
    the transfer has failed already (the send raised), so the probes start now, beside the wait for
    the receives' answers: a frozen engine costs one of the two waits, not both. (A probe beside a
    receive in flight is what the sequential order met after a receive's timeout: the reference
    receiver and vLLM's HTTP route probe over a connection of their own, an in-process vLLM reads
    its engine core's state.)"""
    members = list(members)
    probing: cf.Future[dict[str, Exception]] | None = None
    if failing:
        alongside = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-probe-all")
        probing = alongside.submit(probe_all, members)
        alongside.shutdown(wait=False)  # each probe ends within its own call's bound
    failed = collect_failures(receives, "receive", grace_s)
    if not failed and probing is None:
        return failed, set()
    errors = probing.result() if probing is not None else probe_all(members)
    dead = {name: f"died or froze during the transfer (no answer to a health probe: {exc})" for name, exc in errors.items()}
    return (dead, set(dead)) if dead else (failed, set())


def probe_all(members: Iterable[Any]) -> dict[str, Exception]:
    """A health probe of every member at once ({name: its error} for the unreachable): each probe is
    bounded by its own call's timeout, so a frozen engine costs one such wait, not one per engine."""
    members = list(members)
    if not members:
        return {}
    with cf.ThreadPoolExecutor(max_workers=len(members), thread_name_prefix="ckpt-probe") as pool:
        probes = {m.name: pool.submit(m.health) for m in members}
    return {name: exc for name, fut in probes.items() if (exc := fut.exception()) is not None and isinstance(exc, Exception)}


def mark_stale_and_probe(members: Iterable[Any], failed: dict[str, str], stale: set[str]) -> None:
    """After a failed stage: every member is stale until a complete sync; members not already named
    in `failed` get a health probe, and the unreachable ones are added to `failed` by name."""
    members = list(members)
    stale.update(m.name for m in members)
    for name, exc in probe_all(m for m in members if m.name not in failed).items():
        failed[name] = f"unreachable after the failure: {exc}"


def wait_for_joins(sender: cf.Future[Any], joins: dict[str, cf.Future[Any]], timeout_s: float) -> dict[str, str]:
    """Wait for the sender's and every engine's group join; {} when all joined.

    Returns as soon as anything fails: the engines whose join failed (by name), else the sender
    (its own error), else, at the deadline, every member still waiting. A rendezvous waits for all
    members, so one failed join would otherwise keep the others waiting until the timeout.
    """
    deadline = time.monotonic() + timeout_s
    pending: set[cf.Future[Any]] = {sender, *joins.values()}
    names = {fut: name for name, fut in joins.items()}
    while pending:
        done, pending = cf.wait(pending, timeout=max(0.0, deadline - time.monotonic()), return_when=cf.FIRST_COMPLETED)
        if not done:
            break
        failed = {names[f]: f"{type(f.exception()).__name__}: {f.exception()}" for f in done if f is not sender and f.exception()}
        if failed:
            return failed
        if sender in done and sender.exception() is not None:
            exc = sender.exception()
            return {"sender": f"{type(exc).__name__}: {exc}"}
    waiting = {names.get(f, "sender"): f"no answer to join within {timeout_s}s" for f in pending}
    return dict(sorted(waiting.items()))


def ask_memberships(pool: cf.Executor, members: Iterable[Any]) -> dict[str, cf.Future[Membership]]:
    """Send every engine its membership query now and collect later (`collect_memberships`): the
    round trips overlap the caller's own work (a sync reads its source's metadata meanwhile)."""
    return {m.name: pool.submit(m.membership) for m in members}


def collect_memberships(futures: dict[str, cf.Future[Membership]], timeout_s: float) -> tuple[dict[str, Membership], dict[str, str]]:
    """What every engine holds and which group its ranks are in (`membership`), and {engine: why}
    for those that did not say within `timeout_s` in all."""
    failed = {n: f"version query: {why}" for n, why in collect_failures(futures, "a version query", timeout_s).items()}
    return ({n: f.result() for n, f in futures.items()} if not failed else {}), failed


def leave_all(members: Iterable[Any]) -> None:
    """Every member leaves the group, best effort (a failure is logged)."""
    for m in members:
        try:
            m.leave()
        except Exception as exc:
            logger.warning("engine %s did not leave cleanly: %s", m.name, exc)
