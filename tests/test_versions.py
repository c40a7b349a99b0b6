"""Version labels only grow, sessions do not leak, and bad syncs are refused before any pause.

Reference engines in their own processes over a real gloo group.
"""

from __future__ import annotations

import threading
from pathlib import Path
from collections.abc import Iterator

import pytest

from ckpt_engine import CheckpointEngineConfig, WeightSyncSession, sync_rollout_weights
from ckpt_engine.sync import api as sync_module
from ckpt_engine.rollout_adapters.torch_ref import TorchRefRollout
from ckpt_engine.sync.api import close_sessions
from ckpt_engine.sources.base import StateDictSource
from helpers_wait import wait_for
from refengines import holds, serving, source, spawn_engine, state

CFG = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.0625, timeout_s=20)


@pytest.fixture(scope="module")
def engines(spec_file: str) -> Iterator[list[TorchRefRollout]]:
    rs = [spawn_engine(f"ref{i}", spec_file=spec_file, timeout_s=30) for i in range(2)]
    yield rs
    close_sessions()
    for r in rs:
        r.close()


def versions(engines: list[TorchRefRollout]) -> list[int | None]:
    return [e.health()["version"] for e in engines]


def sync_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith("ckpt-sync"))


def test_a_new_session_or_config_carries_versions_on_and_leaks_nothing(engines: list[TorchRefRollout]) -> None:
    first = WeightSyncSession(engines, CFG)
    start = first.sync(source(1)).version
    first.close()
    # A new session (only timeout_s changed) continues from what the engines hold.
    second = WeightSyncSession(engines, CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.0625, timeout_s=21))
    assert second.sync(source(2)).version == start + 1
    second.close()
    close_sessions()
    threads = sync_threads()
    seen = []
    for i in range(4):  # a new config object every call, as a loop that rebuilds its config would
        config = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.0625, timeout_s=20 + i)
        report = sync_rollout_weights(source(3 + i), engines, config=config)
        assert report is not None
        seen.append(report.version)
    assert seen == [start + 2, start + 3, start + 4, start + 5]
    assert versions(engines) == [start + 5] * 2 and holds(engines[0], state(6)) == []
    assert len(sync_module._sessions) == 1, "replaced sessions must be closed and dropped"
    # A new config replaces the session; what the old one completed is never stamped again on other weights.
    other = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.0625, timeout_s=30)
    with pytest.raises(ValueError, match=rf"version {seen[-1]} was completed already \(by this session or one it replaced\)"):
        sync_rollout_weights(source(99), engines, config=other, version=seen[-1])
    assert versions(engines) == [seen[-1]] * 2 and holds(engines[0], state(6)) == []
    # Idle pool threads of closed sessions exit on their own: waited for, not slept on.
    wait_for("closed sessions' threads exited", lambda: sync_threads() <= threads + 2 * len(engines) + 1, 60)


def test_versions_below_what_engines_hold_are_refused_before_anything_is_paused(engines: list[TorchRefRollout]) -> None:
    session = WeightSyncSession(engines, CFG)
    try:
        held = session.sync(source(8)).version
        received = [e.health()["buckets_received"] for e in engines]
        with pytest.raises(ValueError, match=rf"version {held - 1} is older than what engines hold .*ref0: v{held}.*versions only grow"):
            session.sync(source(9), version=held - 1)
        for bad in (-1, True, 2**64 - 1, "7"):
            with pytest.raises(ValueError, match=r"version must be an int in \[0, 2\*\*63-1\]"):
                session.sync(source(9), version=bad)
        # A jump the engines would refuse at their swap (it would freeze every later sync) is
        # refused here, before a byte moves: the same rule on every engine, vLLM's too.
        for bad in (held + 2**32 + 1, 2**63 - 1):
            with pytest.raises(ValueError, match=rf"version {bad} jumps more than 2\*\*32 past the current version {held}"):
                session.sync(source(9), version=bad)
        for e, n in zip(engines, received):
            h = e.health()
            assert serving(h) and h["version"] == held and h["buckets_received"] == n
        assert session.sync(source(9), version=held + 10).version == held + 10  # a jump ahead is fine
        assert session.sync(source(10)).version == held + 11
    finally:
        session.close()


class _Filtered(StateDictSource):
    """A trainer bug: a name filter that drops every tensor."""

    def __init__(self) -> None:
        super().__init__({})


def test_an_empty_source_is_refused_before_anything_is_paused(engines: list[TorchRefRollout]) -> None:
    session = WeightSyncSession(engines, CFG)
    try:
        held = session.sync(source(11)).version
        received = [e.health()["buckets_received"] for e in engines]
        with pytest.raises(ValueError, match=r"weight source \(_Filtered\) lists no tensors"):
            session.sync(_Filtered())
        for e, n in zip(engines, received):
            h = e.health()
            assert serving(h) and h["version"] == held and h["buckets_received"] == n
        assert holds(engines[1], state(11)) == []
    finally:
        session.close()


def test_no_engines_a_generator_of_engines_and_a_config_mapping(engines: list[TorchRefRollout]) -> None:
    """No engines is a ValueError naming it (a bare StopIteration, which ends a `map` or a generator
    silently, before); a generator of engines is read once, not spent by the session's key; the
    `checkpoint_engine` section as a mapping (a verl / Hydra node) is a config."""
    with pytest.raises(ValueError, match=r"needs one or more rollout engines, each named once; got \[\]"):
        sync_rollout_weights(source(12), [], config=CFG)
    with pytest.raises(ValueError, match=r"needs one or more rollout engines"):
        list(map(lambda s: sync_rollout_weights(source(s), [], config=CFG), (12, 13)))
    mapping = {"backend": "gloo", "bucket_size_mb": 0.0625, "timeout_s": 20}
    report = sync_rollout_weights(source(12), (e for e in engines), config=mapping)
    assert report is not None and versions(engines) == [report.version] * 2 and holds(engines[0], state(12)) == []
    with pytest.raises(ValueError, match=r"unknown key\(s\) under checkpoint_engine: backnd"):
        sync_rollout_weights(source(13), engines, config={"backnd": "gloo"})
    close_sessions()


def handles(engines: list[TorchRefRollout]) -> list[TorchRefRollout]:
    """New handles on the same engines, as a loop that rebuilds them every step makes them."""
    return [TorchRefRollout(e.name, e.rpc.host, e.rpc.port, None, e.timeout_s, token=e.token) for e in engines]


def test_one_engine_under_two_names_is_refused_by_name(engines: list[TorchRefRollout]) -> None:
    e = engines[0]
    twin = TorchRefRollout("twin", e.rpc.host, e.rpc.port, None, e.timeout_s, token=e.token)
    with pytest.raises(ValueError, match=r"rollout engines \['ref0', 'twin'\] are one engine under several names"):
        WeightSyncSession([e, engines[1], twin], CFG)


def test_handles_rebuilt_every_step_keep_the_session_and_its_delta_chain(engines: list[TorchRefRollout]) -> None:
    close_sessions()
    config = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.0625, timeout_s=20, delta="on")
    reports = [sync_rollout_weights(source(20 + i), handles(engines), config=config) for i in range(3)]
    assert [r.delta for r in reports if r is not None] == ["seed", "patch", "patch"]
    assert len(sync_module._sessions) == 1 and holds(engines[1], state(22)) == []
    close_sessions()


@pytest.mark.parametrize("rebuilt", [False, True], ids=["same-handles", "new-handles"])
def test_an_outdated_session_is_refused_by_name_without_pausing(engines: list[TorchRefRollout], rebuilt: bool) -> None:
    old = WeightSyncSession(engines, CFG)
    new = WeightSyncSession(handles(engines) if rebuilt else engines, CFG)
    try:
        old.sync(source(12))
        held = new.sync(source(13)).version  # joins the engines into its own group: `old` is outdated
        with pytest.raises(RuntimeError, match=r"session is outdated: engine\(s\) 'ref0', 'ref1' joined another session"):
            old.sync(source(14))  # refused by the session's own claim check, before any call to an engine
        for e in engines:
            h = e.health()
            assert serving(h) and h["version"] == held
        assert holds(engines[0], state(13)) == []
        old.close()  # must not make the engines leave the newer session's group
        assert new.sync(source(15)).version == held + 1
        assert holds(engines[1], state(15)) == []
    finally:
        old.close()
        new.close()


def test_an_engines_report_cannot_freeze_the_jobs_versions() -> None:
    """Issue 45, item 4: the daemon adopted any version an engine's health named short of 2**63-1
    (2**63-2 left one more sync, then nothing). A fresh daemon adopts what outlived it, within
    2**32; once it knows the job's version from a trusted party, an engine may be one past it."""
    from ckpt_engine.daemon.versions import JobVersions

    v = JobVersions()
    v.adopt_health({"version": 2**62, "last_version": 2**62}, "engine hostile")
    assert v.current == 0
    v.adopt_health({"version": 5000, "last_version": 5000}, "engine a")  # outlived the last daemon
    assert v.current == 5000
    assert v.target(None, []) == (5001, False)
    v.completed(5001)
    v.adopt_health({"version": None, "last_version": 2**63 - 2}, "engine hostile")
    v.adopt_health({"version": 5003}, "engine hostile")
    assert v.current == 5001
    v.adopt_health({"version": 5002}, "engine b")  # another daemon of the job synced it
    assert v.current == 5002 and v.target(None, []) == (5003, False)
    # An engine registering holds what an earlier daemon of the job issued (a job restarted whole: this daemon
    # synced the engines that came back first): the job moves on past it, within 2**32, not refused ever after.
    v.adopt_health({"version": 5010}, "engine c", arriving=True)
    assert v.current == 5010 and v.target(None, []) == (5011, False)
    v.adopt_health({"version": 2**62}, "engine hostile", arriving=True)
    assert v.current == 5010


def _complete_every_other(state_file: str, first: int, last: int) -> None:
    from ckpt_engine.daemon.versions import JobVersions

    v = JobVersions(state_file)
    for version in range(first, last + 1, 2):
        v.completed(version)


def test_two_writers_of_one_state_file_never_take_it_down_or_leave_it_half_written(tmp_path: Path) -> None:
    """`daemon.state_file` given to two coordinators of one job (`serve` and a trainer handed the same
    configuration): a lower version written after a higher one kept the lower one (each wrote only
    its own), and both wrote through one temporary name. Now the file only grows, whoever writes."""
    import json
    import multiprocessing

    from ckpt_engine.daemon.versions import JobVersions

    state = tmp_path / "versions.json"
    a, b = JobVersions(str(state)), JobVersions(str(state))
    a.completed(5)
    b.completed(3)  # b knows less than a: the file keeps 5
    assert json.loads(state.read_text()) == {"version": 5}

    ctx = multiprocessing.get_context("spawn")
    writers = [ctx.Process(target=_complete_every_other, args=(str(state), first, 400)) for first in (6, 7)]
    for w in writers:
        w.start()
    seen = [5]
    while any(w.is_alive() for w in writers):
        seen.append(json.loads(state.read_text())["version"])  # whole at every read (replaced, never written in place)
    for w in writers:
        w.join(60)
        assert w.exitcode == 0
    seen.append(json.loads(state.read_text())["version"])
    assert seen == sorted(seen) and seen[-1] == 400, "the state file went down"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["versions.json", "versions.json.lock"]  # no temporary file left
    assert JobVersions(str(state)).current == 400
