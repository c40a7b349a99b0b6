"""Staged-receive outcomes through a real rendezvous TCPStore (`rollout_adapters/stage_outcome.py`):
the native vLLM backend's workers report the end of a staged receive there instead of raising
"not yet" from vLLM's calls. Here each rank's client of a real store
writes its own key, the waiting side reads every outcome, deletes the keys, and names the ranks that
reported nothing within its timeout."""

from __future__ import annotations

import datetime
import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import torch

from ckpt_engine.rollout_adapters.stage_outcome import check_ticket, new_ticket, outcome_key, report_outcome, wait_outcomes
from ckpt_engine.transports.base import Rendezvous


@pytest.fixture
def rendezvous() -> Iterator[Rendezvous]:
    master = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=30))
    yield Rendezvous("127.0.0.1", master.port, uuid.uuid4().hex, 4, "gloo", 30.0)
    del master


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
    assert 0.4 < time.monotonic() - t0 < 10.0
    assert out.reported == {1: "ok"} and out.missing == [2] and out.why_missing
    assert not store.check([outcome_key(ticket, 1)])  # read and deleted even so


def test_tickets_are_checked() -> None:
    assert check_ticket(new_ticket())
    for bad in ("", "a/b", "x" * 65, 7, None):
        with pytest.raises(ValueError, match="ticket must be 1-64 characters"):
            check_ticket(bad)
