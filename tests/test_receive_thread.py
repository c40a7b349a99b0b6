"""The vLLM worker's parked receive thread (`vllm/background_receive.py`, issue 39): one thread runs
every begun receive, answers or errors reach the caller, a receive still running refuses the next."""

from __future__ import annotations

import threading

import pytest
import torch

from ckpt_engine.rollout_adapters.vllm.background_receive import ReceiveThread

pytestmark = pytest.mark.fast


def test_every_receive_runs_on_the_same_parked_thread_without_autograd() -> None:
    receives = ReceiveThread(torch.device("cpu"))
    seen: list[tuple[int, bool]] = []

    def receive(i: int) -> dict[str, object]:
        seen.append((threading.get_ident(), torch.is_grad_enabled()))
        return {"i": i}

    for i in range(3):
        receives.start(lambda i=i: receive(i))
        assert receives.begun
        assert receives.result(10.0) == {"i": i} and not receives.begun and not receives.running
    assert len({ident for ident, _ in seen}) == 1 and seen[0][0] != threading.get_ident()
    assert not any(grad for _, grad in seen)


def test_an_error_is_raised_to_the_collector_and_the_thread_takes_the_next_receive() -> None:
    receives = ReceiveThread(torch.device("cpu"))

    def fails() -> dict[str, object]:
        raise RuntimeError("bucket 3: checksum mismatch")

    receives.start(fails)
    with pytest.raises(RuntimeError, match="bucket 3: checksum mismatch"):
        receives.result(10.0)
    receives.start(lambda: {"ok": True})
    assert receives.result(10.0) == {"ok": True}


def test_a_receive_still_running_refuses_the_next_and_stays_to_be_collected() -> None:
    receives = ReceiveThread(torch.device("cpu"))
    release = threading.Event()

    def slow() -> dict[str, object]:
        release.wait(10.0)
        return {"slow": True}

    receives.start(slow)
    with pytest.raises(TimeoutError, match="did not end within 0s"):
        receives.result(0.0)
    assert receives.running and receives.begun
    with pytest.raises(RuntimeError, match="a receive is already running on this worker"):
        receives.start(lambda: {"second": True})
    release.set()
    assert receives.result(10.0) == {"slow": True}


def test_nothing_begun_is_refused_by_name() -> None:
    with pytest.raises(RuntimeError, match="no receive was begun on this worker"):
        ReceiveThread(torch.device("cpu")).result(1.0)


def test_a_burst_receive_is_quiet_once_its_copies_are_queued_before_it_ends() -> None:
    """`quiet=False` (copies out of a colocated sender's memory): `quiet_within` is True once the
    receive called `copies_queued`, while it still runs (the device copies); a receive that never
    calls it is quiet when it ends; `quiet=True` is quiet at once."""
    receives = ReceiveThread(torch.device("cpu"))
    queued, release = threading.Event(), threading.Event()

    def receive() -> dict[str, object]:
        receives.copies_queued()
        queued.set()
        assert release.wait(30.0)  # the device copies: the receive has not ended
        return {"ok": True}

    receives.start(receive, quiet=False)
    assert receives.quiet_within(30.0)
    assert queued.is_set() and receives.running
    release.set()
    assert receives.result(30.0) == {"ok": True}

    release.clear()
    receives.start(lambda: {"ok": release.wait(30.0)}, quiet=False)
    assert not receives.quiet_within(0.05)  # never said: still running, not quiet
    release.set()
    assert receives.quiet_within(30.0)  # ended: quiet
    assert receives.result(30.0) == {"ok": True}

    release.clear()
    receives.start(lambda: {"ok": release.wait(30.0)})
    assert receives.quiet_within(0.0)  # quiet at once
    assert receives.running
    release.set()
    assert receives.result(30.0) == {"ok": True}
