"""After a failed stage every engine's health is probed at once (`sync/fanout.py` `probe_all`): two
engines whose probes each wait for the other's to start both answer (probed one after the other,
the first would wait out its barrier and be named unreachable), and a dead one is named by its
error; the probes that find engines dead mid-transfer name only those."""

from __future__ import annotations

import concurrent.futures as cf
import threading

from ckpt_engine.sync.fanout import mark_stale_and_probe, receive_failures

BARRIER_S = 60.0
"""Bound of the barrier the probes meet at (a liveness bound: met at once when they run together)."""


class Member:
    def __init__(self, name: str, barrier: threading.Barrier | None = None, dead: bool = False) -> None:
        self.name, self.barrier, self.dead = name, barrier, dead
        self.probes = 0

    def health(self) -> dict[str, object]:
        self.probes += 1
        if self.barrier is not None:
            self.barrier.wait()  # BrokenBarrierError if the other probe never starts
        if self.dead:
            raise ConnectionRefusedError(f"{self.name}: connection refused")
        return {}


def test_the_probes_after_a_failure_run_at_once_and_name_the_unreachable() -> None:
    barrier = threading.Barrier(2, timeout=BARRIER_S)
    members = [Member("a", barrier), Member("b", barrier), Member("dead", dead=True), Member("named")]
    failed = {"named": "its receive failed"}
    stale: set[str] = set()
    mark_stale_and_probe(members, failed, stale)
    assert stale == {"a", "b", "dead", "named"}
    assert failed == {"named": "its receive failed", "dead": "unreachable after the failure: dead: connection refused"}, failed
    assert [m.probes for m in members] == [1, 1, 1, 0]  # an engine already named is not probed


def test_engines_found_dead_after_a_transfer_are_the_ones_named() -> None:
    barrier = threading.Barrier(2, timeout=BARRIER_S)
    members = [Member("a", barrier), Member("b", barrier, dead=True)]
    receives: dict[str, cf.Future[object]] = {m.name: cf.Future() for m in members}
    receives["a"].set_exception(RuntimeError("gloo: connection reset by peer b"))
    receives["b"].set_exception(RuntimeError("killed"))
    assert receive_failures(members, receives, grace_s=1.0) == {"b": "died during the transfer (b: connection refused)"}
