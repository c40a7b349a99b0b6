"""After a failed stage every engine's health is probed at once (`sync/fanout.py` `probe_all`): two
engines whose probes each wait for the other's to start both answer (probed one after the other,
the first would wait out its barrier and be named unreachable), and a dead one is named by its
error; the probes that find engines dead mid-transfer name only those. A step of one engine whose
calls bound themselves within the session's timeout runs on the session's thread (`fan_out`); one
whose own timeout is longer is waited for on the pool, so a frozen engine is named within the
session's `timeout_s`, not the handle's."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from ckpt_engine import CheckpointEngineConfig, SyncError, WeightSyncSession
from ckpt_engine.rollout_adapters.capabilities import EngineCapabilities
from ckpt_engine.rollout_adapters.torch_ref import TorchRefRollout
from ckpt_engine.sync.fanout import fan_out, mark_stale_and_probe, receive_failures
from helpers_wait import wait_for
from refengines import holds, source, state

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
    failed, unreachable = receive_failures(members, receives, grace_s=1.0)
    assert failed == {"b": "died or froze during the transfer (no answer to a health probe: b: connection refused)"} and unreachable == {"b"}


class Engine:
    """What `fan_out` reads of a handle: its name, capabilities and its own call timeout."""

    def __init__(self, name: str, bounded: bool, timeout_s: float | None = BARRIER_S) -> None:
        self.name, self.capabilities, self.timeout_s = name, EngineCapabilities(bounded_calls=bounded), timeout_s


def test_one_engine_whose_calls_bound_themselves_is_called_on_the_callers_thread() -> None:
    """One `bounded_calls` engine: its step runs here, no pool hand-off; otherwise, and with two
    engines, on the pool. Answers and failures come back in the same form either way."""
    here = threading.get_ident()

    def where(e: Engine) -> int:
        if e.name == "bad":
            raise RuntimeError("refused")
        return threading.get_ident()

    with cf.ThreadPoolExecutor(2) as pool:
        assert fan_out(pool, [Engine("a", True)], where, "pause", BARRIER_S) == ({"a": here}, {})
        answers, failed = fan_out(pool, [Engine("a", False)], where, "pause", BARRIER_S)
        assert failed == {} and answers["a"] != here
        answers, failed = fan_out(pool, [Engine("a", True), Engine("b", True)], where, "pause", BARRIER_S)
        assert failed == {} and here not in answers.values()
        for longer in (BARRIER_S + 1, None):  # its own calls may outlast the caller's bound: the pool waits within it
            answers, failed = fan_out(pool, [Engine("a", True, longer)], where, "pause", BARRIER_S)
            assert failed == {} and answers["a"] != here
        for bounded in (True, False):
            assert fan_out(pool, [Engine("bad", bounded)], where, "pause", BARRIER_S) == ({}, {"bad": "RuntimeError: refused"})


class Recording(TorchRefRollout):
    """A reference receiver that notes the thread of every pause, finalize and resume."""

    threads: list[int]

    def pause(self, mode: str) -> None:
        self.threads.append(threading.get_ident())
        super().pause(mode)

    def finalize(self, version: int) -> None:
        self.threads.append(threading.get_ident())
        super().finalize(version)

    def resume(self) -> None:
        self.threads.append(threading.get_ident())
        super().resume()


def test_a_session_of_one_reference_receiver_steps_it_on_its_own_thread(spec_file: str) -> None:
    engine = Recording.spawn("one", spec_file=spec_file, timeout_s=60.0)
    engine.threads = []
    session = WeightSyncSession([engine], CheckpointEngineConfig(backend="gloo", timeout_s=60.0, stage="off"))
    try:
        assert session.sync(source(1)).version == 1
        assert engine.threads == [threading.get_ident()] * 3
        assert holds(engine, state(1)) == []
    finally:
        session.close()
        engine.close()


class FreezesAtPause(TorchRefRollout):
    """A reference receiver whose process stops (SIGSTOP) as the session asks it to pause: the
    call goes out once the process is seen stopped (a signal lands asynchronously)."""

    def pause(self, mode: str) -> None:
        os.kill(self.process.pid, signal.SIGSTOP)
        wait_for("the engine's process stopped", lambda: _stopped(self.process.pid), BARRIER_S)
        super().pause(mode)


def _stopped(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2] == "T"  # state T: stopped by a signal


SESSION_S = 3.0
"""The session's bound; the handle's own calls wait 40 times longer."""


def test_one_engine_frozen_in_a_step_is_named_within_the_sessions_timeout_not_the_handles(spec_file: str) -> None:
    """A session of one engine whose handle waits longer than the session's `timeout_s`: a step it
    never answers fails within the session's bound, by name (it ran inline and waited out the
    handle's 120 s before)."""
    engine = FreezesAtPause.spawn("frozen", spec_file=spec_file, timeout_s=40 * SESSION_S)
    session = WeightSyncSession([engine], CheckpointEngineConfig(backend="gloo", timeout_s=SESSION_S, stage="off"))
    try:
        t = time.monotonic()
        with pytest.raises(SyncError) as caught:
            session.sync(source(1))
        elapsed = time.monotonic() - t
        assert caught.value.failed == {"frozen": f"no answer to pause within {SESSION_S}s"}, caught.value
        assert elapsed < 20 * SESSION_S, f"named after {elapsed:.1f}s: the handle's own timeout, not the session's"
    finally:
        os.kill(engine.process.pid, signal.SIGCONT)
        session.close()
        engine.close()


class AliveAfterItsReceive:
    """A live engine whose receive answers (with its own error) only once its health was probed."""

    def __init__(self, name: str, receive: cf.Future[object]) -> None:
        self.name, self.receive, self.probed = name, receive, threading.Event()

    def health(self) -> dict[str, object]:
        self.probed.set()
        return {}

    def answer_once_probed(self) -> None:
        if self.probed.wait(BARRIER_S):
            self.receive.set_exception(RuntimeError("its receive's own error"))


def test_after_a_failed_send_the_probes_run_beside_the_wait_for_the_receives() -> None:
    """A send that failed: the probes start with the wait for the receives' answers, not after it,
    so a frozen engine costs one wait (probed after the wait, this receive would be named by a
    timeout of the wait instead of its own error)."""
    receive: cf.Future[object] = cf.Future()
    member = AliveAfterItsReceive("a", receive)
    answering = threading.Thread(target=member.answer_once_probed, daemon=True)
    answering.start()
    failed, unreachable = receive_failures([member], {"a": receive}, grace_s=2.0, failing=True)
    assert failed == {"a": "RuntimeError: its receive's own error"} and unreachable == set(), failed
    answering.join(BARRIER_S)
