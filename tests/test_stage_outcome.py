"""Staged-receive outcomes through a real rendezvous TCPStore (`rollout_adapters/vllm/stage_outcome.py`):
the native vLLM backend's workers report the end of a staged receive there instead of raising
"not yet" from vLLM's calls. Here each rank's client of a real store
writes its own key, the waiting side reads every outcome, deletes the keys, and names the ranks that
reported nothing within its timeout. A staged receive that started on some workers only, or a worker
that reports after the wait ended, leaves no key once the workers discarded (real `Staging` objects,
the workers' side of the native backend, report their end into the store)."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import torch

from ckpt_engine.rollout_adapters.vllm.stage_outcome import (
    Outcomes, check_ticket, clear_outcomes, new_ticket, outcome_key, report_outcome, stop_waiting, wait_outcomes,
)
from ckpt_engine.rollout_adapters.vllm.staging import StagedReceive, Staging
from ckpt_engine.engine import Rendezvous
from ckpt_engine.store import serve_store

_MASTERS: dict[int, torch.distributed.TCPStore] = {}


@pytest.fixture
def rendezvous() -> Iterator[Rendezvous]:
    master = serve_store("127.0.0.1", 30)
    _MASTERS[master.port] = master
    yield Rendezvous("127.0.0.1", master.port, uuid.uuid4().hex, 4, "gloo", 30.0)
    del _MASTERS[master.port]
    del master


def num_keys(rendezvous: Rendezvous) -> int:
    """Every key the group's store holds (all prefixes)."""
    return _MASTERS[rendezvous.port].num_keys()


def test_every_rank_reports_ok_or_why_and_the_keys_are_gone(rendezvous: Rendezvous) -> None:
    ticket = new_ticket()
    waiter = rendezvous.connect_store()

    def worker(rank: int, error: str | None) -> None:
        time.sleep(0.05 * rank)  # the waiter blocks in store.wait until the last one lands
        report_outcome(rendezvous.connect_store(), ticket, rank, error)

    threads = [threading.Thread(target=worker, args=(r, None if r != 2 else "TransferError: checksum mismatch in bucket 1")) for r in (1, 2, 3)]
    for t in threads:
        t.start()
    out = wait_outcomes(waiter, ticket, [1, 2, 3], timeout_s=10.0)
    for t in threads:
        t.join()
    assert out.reported == {1: "ok", 2: "failed: TransferError: checksum mismatch in bucket 1", 3: "ok"}
    assert out.failed == {2: "TransferError: checksum mismatch in bucket 1"} and out.missing == []
    assert not any(waiter.check([outcome_key(ticket, r)]) for r in (1, 2, 3))
    # Another group's token never sees these keys (every key is under the group's token).
    other = Rendezvous(rendezvous.host, rendezvous.port, uuid.uuid4().hex, 4, "gloo", 30.0).connect_store()
    report_outcome(rendezvous.connect_store(), ticket, 1, None)
    assert not other.check([outcome_key(ticket, 1)])


def test_a_rank_that_never_reports_is_named_after_the_timeout(rendezvous: Rendezvous) -> None:
    ticket = new_ticket()
    store = rendezvous.connect_store()
    report_outcome(rendezvous.connect_store(), ticket, 1, None)
    t0 = time.monotonic()
    out = wait_outcomes(store, ticket, [1, 2], timeout_s=0.5)
    # It waited its own 0.5 s (a lower bound: no box returns early), not the store's 30 s timeout
    # (the upper bound is half of that: far past a 0.5 s wait on any box).
    assert 0.4 < time.monotonic() - t0 < rendezvous.timeout_s / 2
    assert out.reported == {1: "ok"} and out.missing == [2] and out.why_missing
    assert not store.check([outcome_key(ticket, 1)])  # read and deleted even so


def test_tickets_are_checked() -> None:
    assert check_ticket(new_ticket())
    for bad in ("", "a/b", "x" * 65, 7, None):
        with pytest.raises(ValueError, match="ticket must be 1-64 characters"):
            check_ticket(bad)


class Worker:
    """One native-backend worker's staging: a staged receive on its thread that streams until the
    group aborts (`abort`), then reports its end into the store, a moment late (a report that lands
    after the discard returned would be left behind)."""

    def __init__(self, rendezvous: Rendezvous, rank: int, report_delay_s: float = 0.3) -> None:
        self.store, self.rank, self.delay_s = rendezvous.connect_store(), rank, report_delay_s
        self.staging = Staging()
        self.aborted = threading.Event()

    def stage(self, ticket: str) -> None:
        def stream(staged: StagedReceive) -> dict[str, object]:
            if not self.aborted.wait(30):
                raise TimeoutError("nobody aborted the group")
            raise RuntimeError("rank %d: bucket 1 failed: Connection closed by peer" % self.rank)

        def on_end(error: str | None) -> None:
            time.sleep(self.delay_s)
            report_outcome(self.store, ticket, self.rank, error)

        self.staging.start("d" * 12, stream, keep_views=True, on_end=on_end)

    def discard(self) -> bool:
        self.aborted.set()  # a failed sync aborts the group: the stream ends
        return self.staging.discard(timeout_s=30.0)


def test_a_receive_started_on_some_workers_only_leaves_no_key_after_the_discard(rendezvous: Rendezvous) -> None:
    """Worker 1 started its staged receive, worker 2 refused the call (vLLM raised): nobody waits on
    the ticket. The discard that follows returns only once worker 1 reported, and the waiting side
    then deletes every rank's key: the store holds what it held before the sync."""
    waiter = rendezvous.connect_store()
    before = num_keys(rendezvous)
    ticket = new_ticket()
    started = Worker(rendezvous, 1)
    started.stage(ticket)
    assert started.discard() and not started.staging.running
    assert waiter.check([outcome_key(ticket, 1)])  # its end was reported before the discard returned
    assert clear_outcomes(waiter, ticket, [1, 2]) == 1
    assert num_keys(rendezvous) == before


def test_a_worker_that_reports_after_the_wait_leaves_no_key_after_the_discard(rendezvous: Rendezvous) -> None:
    waiter = rendezvous.connect_store()
    before = num_keys(rendezvous)
    ticket = new_ticket()
    late = Worker(rendezvous, 2, report_delay_s=0.0)
    late.stage(ticket)
    report_outcome(rendezvous.connect_store(), ticket, 1, None)
    out = wait_outcomes(waiter, ticket, [1, 2], timeout_s=0.3)
    assert out.reported == {1: "ok"} and out.missing == [2]
    assert num_keys(rendezvous) == before  # what arrived was deleted with the wait
    late.discard()  # rank 2's stream ends and reports now, after the wait gave up on it
    assert waiter.check([outcome_key(ticket, 2)])
    clear_outcomes(waiter, ticket, [1, 2])
    assert num_keys(rendezvous) == before


def test_every_rank_key_is_gone_after_a_failed_wait(rendezvous: Rendezvous) -> None:
    waiter = rendezvous.connect_store()
    before = num_keys(rendezvous)
    ticket = new_ticket()
    for rank, error in ((1, None), (2, "TransferError: checksum mismatch in bucket 0")):
        report_outcome(rendezvous.connect_store(), ticket, rank, error)
    out = wait_outcomes(waiter, ticket, [1, 2], timeout_s=5.0)
    assert out.failed == {2: "TransferError: checksum mismatch in bucket 0"}
    assert num_keys(rendezvous) == before
    assert clear_outcomes(waiter, ticket, [1, 2]) == 0


def test_a_stopped_wait_lets_go_of_the_store_before_the_store_closes(capfd: pytest.CaptureFixture[str]) -> None:
    """The sync failed elsewhere: the discard stops the staged receive's wait (through a client of its
    own), which returns at once, so closing the store then finds no client waiting in it (torch prints
    "recvValueWithTimeout failed ... Connection was likely closed" with a C++ stack for one that is).
    A rank that reported keeps its outcome; a report that lands after the stop is cleared with the rest."""
    master = serve_store("127.0.0.1", 30)
    rendezvous = Rendezvous("127.0.0.1", master.port, uuid.uuid4().hex, 4, "gloo", 30.0)
    before = master.num_keys()
    ticket = new_ticket()
    report_outcome(rendezvous.connect_store(), ticket, 1, None)
    found: list[Outcomes] = []
    waiter = threading.Thread(target=lambda: found.append(wait_outcomes(rendezvous.connect_store(), ticket, [1, 2], 60.0)))
    waiter.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    stop_waiting(rendezvous.connect_store(), ticket, [1, 2])
    waiter.join(30.0)
    assert not waiter.is_alive() and time.monotonic() - t0 < 30.0  # the wait's own timeout is 60 s
    (out,) = found
    assert out.reported == {1: "ok"} and out.missing == [2] and "stopped" in out.why_missing  # the stop ended it, not the timeout
    report_outcome(rendezvous.connect_store(), ticket, 2, "RuntimeError: the group was aborted")  # late
    assert clear_outcomes(rendezvous.connect_store(), ticket, [1, 2]) == 1
    assert master.num_keys() == before
    del master
    time.sleep(0.2)
    err = capfd.readouterr().err
    assert "recvValueWithTimeout" not in err and "waitForInput" not in err, err[-2000:]


class _Workers:
    """A stand-in for vLLM's weight-transfer calls as the native adapter makes them (the engine
    behind them is not what these tests check: that is the adapter's handling of a staged receive
    stopped from another thread). Its workers never report a staged receive's end; the receive call
    itself takes `receive_s`. It records every phase and fails on calls that overlap: a client
    serves one call at a time."""

    def __init__(self, receive_s: float) -> None:
        self.receive_s = receive_s
        self.calls: list[str] = []
        self.overlaps: list[str] = []
        self._busy = threading.Lock()
        self.receive_started = threading.Event()
        """Set when the receive call starts (its `receive_s` then runs), not by the clock."""
        self.receive_returned = threading.Event()
        """Set when the receive call returned: the adapter then waits for the workers' outcomes."""

    def _call(self, name: str, seconds: float = 0.0) -> None:
        if not self._busy.acquire(blocking=False):
            self.overlaps.append(name)
            return
        try:
            if name.startswith("receive"):
                self.receive_started.set()
            time.sleep(seconds)
            self.calls.append(name)
        finally:
            self._busy.release()
            if name.startswith("receive"):
                self.receive_returned.set()

    def init_weight_transfer_engine(self, init: dict) -> None:
        self._call("init")

    def shutdown_weight_transfer_engine(self) -> None:
        self._call("shutdown")

    def start_weight_update(self) -> None:
        self._call("start")

    def finish_weight_update(self, version: str | None = None) -> None:
        self._call("finish")

    def update_weights(self, update: dict) -> None:
        self._call(update["phase"] + ("+stage" if "stage" in update else ""), self.receive_s if update["phase"] == "receive" else 0.0)

    def pause(self, mode: str) -> None: ...

    def resume(self) -> None: ...

    def reset_prefix_cache(self, running: bool = False) -> None: ...

    def weight_version(self) -> str:
        return "0"


@pytest.mark.parametrize("receive_s,how", [(0.0, "discard"), (1.0, "discard"), (0.0, "leave")], ids=["waiting", "receive-call", "leave"])
def test_a_native_staged_receive_is_stopped_by_a_discard_or_leave_from_another_thread(receive_s: float, how: str) -> None:
    """The session discards (or the handle leaves) while a staged receive is in flight on another
    thread: in its wait for the workers' outcomes, or still in its receive call. The receive ends at
    once, raising that it was stopped (not after its 2 x timeout_s wait) and without a discard of its
    own; the discard's calls never overlap the receive's on the client; no outcome key is left."""
    from ckpt_engine.planning.buckets import plan_buckets
    from ckpt_engine.manifest import TensorSpec
    from ckpt_engine.rollout_adapters.base import JoinOptions
    from ckpt_engine.rollout_adapters.vllm import VllmRollout, WeightTransferChannel

    pytest.importorskip("vllm")  # the adapter reads the features of the vLLM this process imported
    master = serve_store("127.0.0.1", 30)
    rendezvous = Rendezvous("127.0.0.1", master.port, uuid.uuid4().hex, 3, "gloo", 30.0)
    workers = _Workers(receive_s)
    adapter = VllmRollout("vllm", WeightTransferChannel(workers, num_workers=2), timeout_s=60.0)
    adapter.join(rendezvous, 1, JoinOptions(bucket_size_bytes=1 << 20, num_buffers=2, verify=False))
    manifest = plan_buckets([TensorSpec("w", "float32", (4, 4))], 1 << 20)
    adapter.validate(manifest, b"{}")
    before = master.num_keys()
    raised: list[BaseException] = []

    def receive() -> None:
        try:
            adapter.receive(manifest, stage="patches")
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=receive)
    thread.start()
    # Where the stop lands is awaited, not slept for: in the outcome wait (the receive call returned)
    # or inside the 1 s receive call (it started; a stop that a starved box delivers later lands in
    # the outcome wait, the other case, with the same assertions).
    landed = workers.receive_started if receive_s else workers.receive_returned
    assert landed.wait(60.0), ("the receive never reached its call", raised)
    (adapter.discard if how == "discard" else adapter.leave)()
    thread.join(20.0)
    assert not thread.is_alive(), "the stopped receive still waits"
    assert len(raised) == 1 and "stopped" in str(raised[0]), raised
    assert workers.overlaps == []
    assert workers.calls.count("discard") == (1 if how == "discard" else 0)  # the stopper's, not the receive's
    assert workers.calls[-1] == ("finish" if how == "discard" else "shutdown")
    assert master.num_keys() == before
    del master
