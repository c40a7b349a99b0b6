"""Restarts (issue 26): a trainer, a daemon or an engine restarts and the job carries on.

Real processes throughout: reference engines in their own processes, trainers killed with SIGKILL
and started again, `ckpt-engine serve` killed and started again on its port; real gloo groups.
Each fault is repeated three times in one test.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt_engine.daemon import DaemonClient, DaemonConfig, HeartbeatSender, WeightSyncDaemon
from ckpt_engine.rollout_adapters.base import ManifestRejectedError
from ckpt_engine.rollout_adapters.torch_ref import TorchRefRollout
from ckpt_engine.sources.base import StateDictSource
from ckpt_engine.sync.report import SyncError
from ckpt_engine.sync.api import close_sessions, sync_rollout_weights
from ckpt_engine.sync.session import WeightSyncSession
from helpers_daemon import TIMEOUT_S, Engines, config, descriptor, start_serve, weights, write_spec
from helpers_daemon import holds as exact
from helpers_wait import wait_for
from helpers_procs import fork_program, free_port

pytestmark = pytest.mark.timeout(300)

TOKEN = "restarts-job-token"
REPEATS = 3
SHORT_TIMEOUT_S = 5.0
LONG_TIMEOUT_S = 120.0
"""The restarted trainers' collective timeout: far past any normal sync, so that a sync that waited
it out is told apart on any box by a bound of half of it."""
WAIT_S = 60.0
"""Bound of a wait for something that surely comes (a liveness check, not a speed claim)."""


@pytest.fixture(scope="module")
def spec_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_spec(tmp_path_factory.mktemp("restarts") / "spec.msgpack")


@pytest.fixture
def engines(spec_file: str) -> Iterator[Callable[..., TorchRefRollout]]:
    made = Engines(spec_file, TOKEN)

    def spawn(name: str, port: int = 0) -> TorchRefRollout:
        return made.spawn(name, port=port)

    yield spawn
    made.close()


class PauseWatch:
    """Polls every engine's health; `longest`: the longest time any engine was surely paused.

    An answer was given somewhere between its call's start and its return, so an engine seen paused
    by two answers was paused at least from the first one's return to the second one's start: a
    lower bound of the real pause, however late a loaded box delivers the answers."""

    def __init__(self, rs: list[TorchRefRollout]) -> None:
        self.rs = rs
        self.longest = 0.0
        self._since: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> PauseWatch:
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(0.02):
            for r in self.rs:
                asked = time.monotonic()
                try:
                    paused = r.health()["paused"]
                except Exception:
                    continue
                answered = time.monotonic()
                if paused:
                    self.longest = max(self.longest, asked - self._since.setdefault(r.name, answered))
                else:
                    self._since.pop(r.name, None)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


# --- a trainer killed after a version and restarted from its checkpoint ------------------------
def trainer_main(argv: list[str]) -> None:
    """A trainer process: syncs one version per seed (embedded daemon or following `serve`),
    prints one JSON line per sync, then waits to be killed."""
    mode, address, token, engines, seeds = argv
    if mode == "embedded":
        d = WeightSyncDaemon(config(LONG_TIMEOUT_S), DaemonConfig(heartbeat_timeout_s=0), token=token)
        for name, desc in json.loads(engines).items():
            d.register(name, desc)
    else:
        d = WeightSyncDaemon(config(LONG_TIMEOUT_S), upstream=DaemonClient(address, token, 10))
    for seed in map(int, seeds.split(",")):
        o = d.sync(StateDictSource(weights(seed)))
        print(json.dumps({"seed": seed, "version": o.version, "ok": o.ok, "seconds": o.seconds, "error": o.error}), flush=True)
    time.sleep(3600)


def run_trainer(log: Path, mode: str, address: str, rs: list[TorchRefRollout], seeds: list[int]) -> list[dict[str, Any]]:
    """Start a trainer process, read one line per sync, then SIGKILL it (its checkpoint is `seeds`)."""
    engines = json.dumps({r.name: descriptor(r) for r in rs})
    program = fork_program("test_restarts:trainer_main", [mode, address, TOKEN, engines, ",".join(map(str, seeds))], "trainer", stderr_path=str(log))
    lines = []
    try:
        for _ in seeds:
            line = program.read_line("", 90)
            assert line, f"the trainer printed nothing (exit code {program.process.poll()}); stderr: {log.read_text()[-2000:] if log.exists() else ''}"
            lines.append(json.loads(line))
    finally:
        program.process.kill()
        program.process.wait(10)
    return lines


@pytest.mark.parametrize("mode", ["embedded", "following"])
def test_a_restarted_trainer_carries_on_from_what_engines_hold(tmp_path: Path, engines: Callable[..., TorchRefRollout], mode: str) -> None:
    rs = [engines(f"r{i}") for i in range(2)]
    serve, address = (None, "-")
    if mode == "following":
        serve = start_serve(tmp_path, TOKEN)
        address = serve.address
        client = DaemonClient(address, TOKEN, timeout_s=10)
        for r in rs:
            client.register(r.name, descriptor(r))
        client.close()
    log = tmp_path / "trainer.log"
    log.touch()
    try:
        first = run_trainer(log, mode, address, rs, [1, 2, 3])
        assert [(o["version"], o["ok"]) for o in first] == [(1, True), (2, True), (3, True)], first
        for attempt in range(REPEATS):  # killed after version 3 + attempt, restarted from its checkpoint
            version, seed = 4 + attempt, 10 + attempt
            with PauseWatch(rs) as watch:
                (o,) = run_trainer(log, mode, address, rs, [seed])
            assert o["ok"] and o["version"] == version, o
            assert o["seconds"] < LONG_TIMEOUT_S / 2, o  # it did not wait out the collective timeout (the dead trainer's group)
            assert watch.longest <= o["seconds"], f"an engine was paused {watch.longest:.2f}s around a {o['seconds']:.2f}s sync"
            for r in rs:
                assert exact(r, weights(seed), version)
        assert "Traceback" not in log.read_text(), log.read_text()[-3000:]
    finally:
        if serve is not None:
            serve.stop()
    if serve is not None:
        assert "Traceback" not in (tmp_path / "serve.log").read_text()


class BrokenSource(StateDictSource):
    """Fails after a few tensors: the engines are left paused and stale (a trainer that died mid-stream)."""

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for i, item in enumerate(super().iter_weights()):
            if i == 3:
                raise OSError("the trainer died mid-stream")
            yield item


def test_a_fresh_daemon_adopts_refuses_old_versions_and_resumes_what_it_paused(engines: Callable[..., TorchRefRollout]) -> None:
    rs = [engines(f"r{i}") for i in range(2)]
    first = WeightSyncDaemon(config(), DaemonConfig(heartbeat_timeout_s=0), token=TOKEN)
    for r in rs:
        first.register(r.name, descriptor(r))
    assert first.sync(StateDictSource(weights(1))).ok and first.sync(StateDictSource(weights(2))).ok
    first.close()
    version = 2
    for attempt in range(REPEATS):
        d = WeightSyncDaemon(config(), DaemonConfig(heartbeat_timeout_s=0), token=TOKEN)
        stale = attempt == 1  # the last daemon died mid-stream: no engine holds a complete version
        try:
            for r in rs:
                paused = r.health()["paused"]
                rec = d.register(r.name, descriptor(r))
                assert rec["version"] == (None if stale else version), rec
                assert r.health()["paused"] == paused == stale, "registration pauses nothing"
            assert d.version == version, "a fresh daemon adopts what its engines hold (or last finalized)"
            assert d.pending() == (["r0", "r1"] if stale else [])
            received = [r.health()["buckets_received"] for r in rs]
            with pytest.raises(ValueError, match=rf"at least the current version {version}"):
                d.sync(StateDictSource(weights(50)), version=version - 1)
            holders = "this job's engines" if stale else "'r0', 'r1'"
            with pytest.raises(ValueError, match=rf"version {version} is what {holders} already hold, and this daemon did not send it"):
                d.sync(StateDictSource(weights(50)), version=version)
            assert [r.health()["buckets_received"] for r in rs] == received
            assert all(r.health()["paused"] == stale for r in rs), "a refused version pauses nothing"
            version += 1
            sd = weights(20 + attempt)
            outcome = d.sync(StateDictSource(sd))
            assert outcome.ok and outcome.version == version, outcome
            for r in rs:
                assert exact(r, sd, version), "every engine exact, a stale one seeded"
            if attempt == 0:  # this daemon dies mid-stream: the next one finds stale engines
                assert not d.sync(BrokenSource(weights(21))).ok
                assert all(r.health()["stale"] for r in rs)
                continue
            # A sync of ours that stopped after pausing (as one that died would): closing resumes them.
            for name in ("r0", "r1"):
                rec = d.membership.get(name)
                assert rec is not None and rec.adapter is not None
                rec.adapter.pause("keep")
            assert all(r.health()["paused"] for r in rs)
        finally:
            d.close()
        assert all(exact(r, sd, version) for r in rs), "a closing daemon leaves every engine that holds a version serving"



def test_a_state_file_keeps_versions_going_up_when_the_whole_job_restarts(tmp_path: Path, engines: Callable[..., TorchRefRollout]) -> None:
    """Daemon, trainer and engine stopped together and started again, 3 times: the engine comes back
    holding nothing, so only `daemon.state_file` knows how far the job got, and every daemon carries
    on from it; without the file a fresh daemon starts again at 1 (what the file is for). A state
    file the daemon cannot use is refused by name when the daemon starts."""
    state = str(tmp_path / "versions.json")
    r = engines("r0")
    version = 0
    for attempt in range(REPEATS):
        d = WeightSyncDaemon(config(), DaemonConfig(heartbeat_timeout_s=0, state_file=state), token=TOKEN)
        try:
            assert d.register(r.name, descriptor(r))["version"] is None, "the restarted engine holds nothing"
            for seed in (1, 2):
                version += 1
                sd = weights(10 * attempt + seed)
                outcome = d.sync(StateDictSource(sd))
                assert outcome.ok and outcome.version == version, (outcome.version, outcome.error)
                assert exact(r, sd, version)
        finally:
            d.close()
        r.process.kill()
        r.process.wait(10)
        r = engines("r0", port=r.rpc.port)
    without = WeightSyncDaemon(config(), DaemonConfig(heartbeat_timeout_s=0), token=TOKEN)
    try:
        without.register(r.name, descriptor(r))
        assert without.sync(StateDictSource(weights(99))).version == 1
    finally:
        without.close()
    (tmp_path / "junk.json").write_text("not a version")
    for bad, says in ((tmp_path / "gone" / "v.json", "folder .* does not exist"), (tmp_path / "junk.json", "is not a version file")):
        with pytest.raises(ValueError, match=f"daemon.state_file.*{says}"):
            WeightSyncDaemon(config(), DaemonConfig(heartbeat_timeout_s=0, state_file=str(bad)), token=TOKEN)

# --- `ckpt-engine serve` killed and restarted on its port and token ---------------------------
def test_a_restarted_serve_gets_its_engines_back(tmp_path: Path, engines: Callable[..., TorchRefRollout], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    port = free_port()
    serve = start_serve(tmp_path, TOKEN, port=port)
    address = serve.address
    rs = [engines(f"r{i}") for i in range(2)]
    beats = [HeartbeatSender(DaemonClient(address, TOKEN, timeout_s=2), r.name, 0.25, engine=descriptor(r)).start() for r in rs]
    trainer = WeightSyncDaemon(config(), upstream=DaemonClient(address, TOKEN, timeout_s=5))
    client = DaemonClient(address, TOKEN, timeout_s=5)
    try:
        wait_for("the engines registered", lambda: len(client.members()["engines"]) == 2, WAIT_S)
        assert trainer.sync(StateDictSource(weights(1))).ok
        version = 1
        for attempt in range(REPEATS):
            os.kill(serve.process.pid, signal.SIGKILL)
            serve.process.wait(10)
            if attempt == 0:  # the trainer syncs while the daemon is down: no traceback, the engines it knows
                outcome = trainer.sync(StateDictSource(weights(30)))
                assert outcome.ok, outcome
                version += 1
            serve = start_serve(tmp_path, TOKEN, port=port)
            assert serve.address == address
            wait_for("the engines registered again", lambda: len(client.members()["engines"]) == 2, WAIT_S)  # their heartbeats did it (counted below)
            wait_for("the daemon adopted the engines' version", lambda: client.status()["version"] == version, WAIT_S)
            version += 1
            sd = weights(40 + attempt)
            outcome = trainer.sync(StateDictSource(sd))
            assert outcome.ok and outcome.version == version and not outcome.dropped, outcome
            for r in rs:
                assert exact(r, sd, version)
            wait_for("the daemon took the report", lambda: client.status()["version"] == version, WAIT_S)
        assert all(b.registrations >= REPEATS for b in beats)
    finally:
        for b in beats:
            b.stop()
        trainer.close()
        client.close()
        serve.stop()
    assert "Traceback" not in (tmp_path / "serve.log").read_text()
    assert not [r for r in caplog.records if r.exc_info], "no traceback in the trainer's log"


# --- an engine restarted at its address between two syncs --------------------------------------
def test_an_engine_restarted_at_its_address_is_reseeded_and_nobody_is_dropped(engines: Callable[..., TorchRefRollout]) -> None:
    rs = [engines(f"r{i}") for i in range(3)]
    d = WeightSyncDaemon(config(), DaemonConfig(heartbeat_timeout_s=0), token=TOKEN)
    try:
        for r in rs:
            d.register(r.name, descriptor(r))
        assert d.sync(StateDictSource(weights(1))).ok
        for attempt in range(REPEATS):
            victim = rs[attempt]
            victim.process.kill()
            victim.process.wait(10)
            rs[attempt] = victim = engines(victim.name, port=victim.rpc.port)  # back at the same address
            version, sd = attempt + 2, weights(60 + attempt)
            outcome = d.sync(StateDictSource(sd))
            print(f"restart {attempt}: {outcome.seconds:.2f}s, attempts {outcome.attempts}")
            assert outcome.ok and outcome.version == version and not outcome.dropped, outcome
            # Noticed before the sync (its probe says it holds nothing: the group is rebuilt), not by a
            # failed attempt through the old group, which waits for it and is then pushed again.
            assert outcome.attempts == [], outcome.attempts
            assert sorted(d.membership.names()) == ["r0", "r1", "r2"]
            for r in rs:
                assert exact(r, sd, version)
    finally:
        d.close()


# --- versions never go back and never repeat ---------------------------------------------------
def test_versions_continue_from_the_highest_sent_and_never_repeat(engines: Callable[..., TorchRefRollout]) -> None:
    procs = [engines(f"r{i}") for i in range(2)]
    rs = [TorchRefRollout(p.name, p.rpc.host, p.rpc.port, None, TIMEOUT_S, token=TOKEN) for p in procs]  # the trainer's handles
    session = WeightSyncSession(rs, config())
    try:
        assert session.sync(StateDictSource(weights(1))).version == 1
        for attempt in range(REPEATS):
            for i, p in enumerate(procs):  # every engine restarted mid-job at its address: none holds a version
                p.process.kill()
                p.process.wait(10)
                procs[i] = engines(p.name, port=p.rpc.port)
            sd = weights(70 + attempt)
            # The restart is noticed before anything is sent (the engines report no group): the
            # session rejoins them and seeds them in this very sync, and blames nobody.
            report = session.sync(StateDictSource(sd))
            assert report.version == attempt + 2, "the next version continues from the highest sent, never 1 again"
            assert report.delta in ("off", "seed")
            for r in rs:
                assert exact(r, sd, attempt + 2)
        held = REPEATS + 1
        other = WeightSyncSession(rs, config())  # another trainer: the same version is refused by name
        try:
            received = [r.health()["buckets_received"] for r in rs]
            with pytest.raises(ValueError, match=rf"version {held} is what engine\(s\) 'r0', 'r1' already hold"):
                other.sync(StateDictSource(weights(99)), version=held)
            assert [r.health()["buckets_received"] for r in rs] == received and not any(r.health()["paused"] for r in rs)
            assert other.sync(StateDictSource(weights(98))).version == held + 1
        finally:
            other.close()
    finally:
        session.close()
        for r in rs:
            r.close()


def test_an_engine_replaced_under_its_name_never_takes_a_version_back(engines: Callable[..., TorchRefRollout]) -> None:
    """`sync_rollout_weights` into an engine replaced by a new one of the same name (an `LLM`
    replaced in process; here a receiver at a new address), which holds nothing: the versions carry
    on from what this trainer sent. An explicit version the session completed is refused."""
    close_sessions()
    try:
        first: int | None = None
        for attempt in range(REPEATS):
            proc = engines("replaced")  # a new engine each round, at a new address, under one name
            handle = TorchRefRollout(proc.name, proc.rpc.host, proc.rpc.port, None, TIMEOUT_S, token=TOKEN)
            report = sync_rollout_weights(StateDictSource(weights(80 + attempt)), [handle], config=config())
            assert report is not None
            first = report.version if first is None else first
            assert report.version == first + attempt, "a replaced engine holds nothing, yet the version never goes back"
            received = handle.health()["buckets_received"]
            with pytest.raises(ValueError, match=rf"version {report.version} was completed already \(by this session or one it replaced\)"):
                sync_rollout_weights(StateDictSource(weights(90 + attempt)), [handle], version=report.version, config=config())
            assert handle.health()["buckets_received"] == received and not handle.health()["paused"]
            proc.process.kill()
            proc.process.wait(10)
    finally:
        close_sessions()


def test_an_engine_dead_before_the_sync_is_named_and_nothing_is_said_paused(engines: Callable[..., TorchRefRollout]) -> None:
    """The version query fails before any pause: the error says nothing was paused (it said the
    engines were left paused and stale) and the live engine keeps serving, unpaused."""
    alive, dead = engines("alive"), engines("dead")
    session = WeightSyncSession([alive, dead], config())
    try:
        assert session.sync(StateDictSource(weights(5))).version >= 1
        dead.process.kill()
        dead.process.wait(10)
        with pytest.raises(SyncError, match=r"during validate: dead: .*; nothing was paused; engines to rejoin at the next sync: .*dead") as info:
            session.sync(StateDictSource(weights(6)))
        assert "left paused" not in str(info.value)
        assert not alive.health()["paused"]
    finally:
        session.close()


def test_a_failure_with_every_engine_alive_drops_nobody(engines: Callable[..., TorchRefRollout]) -> None:
    """An engine taken into another group behind the daemon's back (as one restarted would have
    left it) while it reports what the daemon knows: the daemon's next sync sees that it left the
    group before anything is sent, rebuilds the group and pushes the version to everyone in one
    attempt; nobody is dropped. (It failed the transfer before, and a retry healed it.)"""
    rs = [engines(f"r{i}") for i in range(3)]
    d = WeightSyncDaemon(config(SHORT_TIMEOUT_S), DaemonConfig(heartbeat_timeout_s=0), token=TOKEN)
    try:
        for r in rs:
            d.register(r.name, descriptor(r))
        assert d.sync(StateDictSource(weights(1))).ok
        for attempt in range(REPEATS):
            version = attempt + 1  # what every engine holds
            victim = rs[attempt]
            handle = TorchRefRollout(victim.name, victim.rpc.host, victim.rpc.port, None, TIMEOUT_S, token=TOKEN)
            handle.owner = d.group
            elsewhere = WeightSyncSession([handle], config())
            with pytest.raises(ManifestRejectedError):  # it joined the other group, then refused its weights: still v{version}
                elsewhere.sync(StateDictSource({"layer0.weight": torch.zeros(3)}))
            elsewhere.close()
            assert victim.health()["version"] == version
            handle.close()
            sd = weights(80 + attempt)
            outcome = d.sync(StateDictSource(sd))
            assert outcome.ok and outcome.version == version + 1 and not outcome.dropped, outcome
            assert outcome.attempts == [], outcome.attempts  # no failed attempt to retry
            assert sorted(d.membership.names()) == ["r0", "r1", "r2"]
            for r in rs:
                assert exact(r, sd, version + 1)
    finally:
        d.close()
