"""Two syncs at once on the same engines: serialized on the trainer side, refused on the receiver side.

Reference engines in their own processes, a real gloo group; every check reads the engines' bytes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch

from ckpt_engine import CheckpointEngineConfig, SyncError, WeightSyncSession, sync_rollout_weights
from ckpt_engine.rollout_adapters.torch_ref import TorchRefRollout
from ckpt_engine.sources.base import StateDictSource
from ckpt_engine.sync.api import SyncReport, close_sessions
from refengines import holds, second_handle, serving, source, spawn_engine, state

CFG = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.0625, timeout_s=20)
PATIENT = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.0625, timeout_s=120)
"""For a session whose group must not be waited out: a wait of its timeout is told apart from an
end at once by a bound of half of it, on any box."""


@pytest.fixture(scope="module")
def engines(spec_file: str) -> Iterator[list[TorchRefRollout]]:
    # A slow loader (10 ms a bucket) makes the two syncs overlap for sure.
    rs = [spawn_engine(f"ref{i}", spec_file=spec_file, load_delay_s=0.01, timeout_s=30) for i in range(2)]
    yield rs
    close_sessions()
    for r in rs:
        r.close()


def run_both(calls: list) -> tuple[dict[int, SyncReport], list[BaseException]]:
    """Start every call at once on its own thread; {call index: report} and the errors."""
    reports: dict[int, SyncReport] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(calls))

    def run(i: int, call) -> None:
        start.wait()
        try:
            reports[i] = call()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a sync hung"
    return reports, errors


def assert_one_complete_version(engines: list[TorchRefRollout], by_version: dict[int, int]) -> None:
    """Every engine serves exactly the version it reports, bit for bit (seed per version)."""
    for e in engines:
        h = e.health()
        assert serving(h), h
        assert h["version"] in by_version, (h, by_version)
        assert holds(e, state(by_version[h["version"]])) == [], f"{e.name} holds a mix of versions"


def test_two_threads_on_one_session_take_turns(engines: list[TorchRefRollout]) -> None:
    session = WeightSyncSession(engines, CFG)
    try:
        for round_ in range(2):
            seeds = (10 + 2 * round_, 11 + 2 * round_)
            reports, errors = run_both([lambda s=s: session.sync(source(s)) for s in seeds])
            assert errors == [] and len(reports) == 2
            by_version = {r.version: seeds[i] for i, r in reports.items()}
            assert len(by_version) == 2, "each caller gets its own version"
            newest = max(by_version)
            assert [e.health()["version"] for e in engines] == [newest, newest]
            assert_one_complete_version(engines, {newest: by_version[newest]})
    finally:
        session.close()


def test_two_threads_through_sync_rollout_weights_take_turns(engines: list[TorchRefRollout]) -> None:
    # The second caller even brings another config: it waits for the first sync, then replaces
    # the cached session (closing the old one) instead of building a second group beside it.
    other = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.0625, timeout_s=25)
    seeds = (20, 21)
    reports, errors = run_both([
        lambda: sync_rollout_weights(source(seeds[0]), engines, config=CFG),
        lambda: sync_rollout_weights(source(seeds[1]), engines, config=other),
    ])
    assert errors == [] and len(reports) == 2
    by_version = {r.version: seeds[i] for i, r in reports.items()}
    newest = max(by_version)
    assert set(by_version) == {newest - 1, newest}, "versions grow across the replaced session"
    assert_one_complete_version(engines, {newest: by_version[newest]})


class HeldMidWalk(StateDictSource):
    """`state(seed)`, half of it yielded, then held until `release` is set (bounded): the sync is
    surely still streaming, its receiver mid-receive, until the test lets it go, however fast or
    loaded the box (a slow source, ~1 s, raced the intruder's set-up)."""

    def __init__(self, seed: int, release: threading.Event) -> None:
        super().__init__(state(seed))
        self.release = release

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        items = list(self.weights.items())
        yield from items[: len(items) // 2]
        if not self.release.wait(60):
            raise RuntimeError("the held sync was never released")
        yield from items[len(items) // 2 :]


def test_a_receiver_in_a_sync_refuses_another_controllers_join(engines: list[TorchRefRollout]) -> None:
    """A second controller (its own handle, its own group) must not tear the first sync's group out
    from under it: the receiver refuses its join while the first sync streams. The refusal ends
    the second controller's group set-up at once, also for the engine that did join."""
    busy, free = engines
    first = WeightSyncSession([busy], CFG)
    intruder = WeightSyncSession([second_handle(busy), free], PATIENT)
    try:
        first.sync(source(30))
        done: list[SyncReport] = []
        release = threading.Event()
        t = threading.Thread(target=lambda: done.append(first.sync(HeldMidWalk(31, release))))
        t.start()
        deadline = time.monotonic() + 60
        while not busy.health()["receiving"]:  # the first sync streams, held mid-walk until the intruder was refused
            assert time.monotonic() < deadline and t.is_alive(), ("the first sync never reached its receive", done)
            time.sleep(0.005)
        start = time.monotonic()
        with pytest.raises(SyncError, match=r"ref0: .*busy with a receive.*join of group .* refused") as info:
            intruder.sync(source(32))
        assert info.value.stage == "join" and set(info.value.failed) == {"ref0"}, info.value.failed
        assert time.monotonic() - start < PATIENT.timeout_s / 2, f"the refused join should end the set-up at once, not after {PATIENT.timeout_s}s"
        release.set()
        t.join(60)
        assert len(done) == 1, "the first sync must complete undisturbed"
        assert_one_complete_version([busy], {done[0].version: 31})
        # The engine that had joined the intruder's group is free again at once.
        start = time.monotonic()
        alone = WeightSyncSession([free], CFG)
        try:
            report = alone.sync(source(33))
        finally:
            alone.close()
        assert time.monotonic() - start < PATIENT.timeout_s / 2  # not after the intruder's group timed out
        assert_one_complete_version([free], {report.version: 33})
    finally:
        release.set()
        intruder.close()
        first.close()
