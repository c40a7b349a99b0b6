"""Restarts (issue 26): a trainer, a daemon or an engine restarts and the job carries on.

Real processes throughout: reference engines in their own processes, trainers killed with SIGKILL
and started again, `ckpt-engine serve` killed and started again on its port; real gloo groups.
Each fault is repeated three times in one test.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt_engine.config import CheckpointEngineConfig
from ckpt_engine.control.wire import RpcError
from ckpt_engine.daemon import DaemonClient, DaemonConfig, HeartbeatSender, WeightSyncDaemon
from ckpt_engine.daemon.cli import READY_PREFIX
from ckpt_engine.rollout_adapters.base import ManifestRejectedError
from ckpt_engine.rollout_adapters.torch_ref import TorchRefRollout, write_spec_file
from ckpt_engine.sources.base import StateDictSource
from ckpt_engine.sync.report import SyncError
from ckpt_engine.sync.session import WeightSyncSession

pytestmark = pytest.mark.timeout(300)

TIMEOUT_S = 20.0
TOKEN = "restarts-job-token"
NUM_TENSORS = 8
REPEATS = 3


def weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}.weight": torch.randn(64, 1024, generator=g) for i in range(NUM_TENSORS)}  # 256 KiB each


def config() -> CheckpointEngineConfig:
    return CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.25, timeout_s=TIMEOUT_S)


@pytest.fixture(scope="module")
def spec_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("restarts") / "spec.msgpack"
    write_spec_file(path, StateDictSource(weights(0)).metadata())
    return str(path)


@pytest.fixture
def engines(spec_file: str) -> Iterator[Callable[..., TorchRefRollout]]:
    made: list[TorchRefRollout] = []

    def spawn(name: str, port: int = 0) -> TorchRefRollout:
        r = TorchRefRollout.spawn(name, spec_file=spec_file, timeout_s=TIMEOUT_S, token=TOKEN, port=port)
        made.append(r)
        return r

    yield spawn
    for r in made:
        r.close()


def descriptor(r: TorchRefRollout) -> dict[str, Any]:
    return {"kind": "torch_ref", "host": r.rpc.host, "port": r.rpc.port}


def exact(r: TorchRefRollout, sd: dict[str, torch.Tensor], version: int) -> bool:
    h = r.health()
    return (h["version"], h["paused"], h["stale"]) == (version, False, False) and all(torch.equal(r.get_tensor(n), t) for n, t in sd.items())


def wait_for(what: str, check: Callable[[], bool], timeout_s: float) -> float:
    t0 = time.monotonic()
    while not check():
        if time.monotonic() - t0 > timeout_s:
            pytest.fail(f"not within {timeout_s}s: {what}")
        time.sleep(0.05)
    return time.monotonic() - t0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PauseWatch:
    """Polls every engine's health; the longest time any engine was seen paused."""

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
                try:
                    paused = r.health()["paused"]
                except Exception:
                    continue
                now = time.monotonic()
                if paused:
                    self._since.setdefault(r.name, now)
                    self.longest = max(self.longest, now - self._since[r.name])
                else:
                    self._since.pop(r.name, None)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def start_serve(tmp_path: Path, port: int = 0) -> tuple[subprocess.Popen[str], str]:
    cfg = tmp_path / "job.yaml"
    cfg.write_text("checkpoint_engine:\n  backend: gloo\n  bucket_size_mb: 0.25\n  timeout_s: 20\ndaemon:\n  health_interval_s: 0.3\n  heartbeat_timeout_s: 0\n")
    log = open(tmp_path / "serve.log", "a")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckpt_engine.cli", "serve", "--config", str(cfg), "--token", TOKEN, "--port", str(port)],
        stdout=subprocess.PIPE, stderr=log, text=True,
    )
    log.close()
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    line = proc.stdout.readline() if ready else ""
    if not line.startswith(READY_PREFIX):
        proc.kill()
        pytest.fail(f"ckpt-engine serve did not start: {line!r}")
    return proc, dict(part.split("=", 1) for part in line[len(READY_PREFIX):].split())["address"]


# --- a trainer killed after a version and restarted from its checkpoint ------------------------
TRAINER = """
import json, sys, time, torch
from ckpt_engine.config import CheckpointEngineConfig
from ckpt_engine.control.wire import RpcError
from ckpt_engine.daemon import DaemonClient, DaemonConfig, WeightSyncDaemon
from ckpt_engine.sources.base import StateDictSource
mode, address, token, engines, seeds = sys.argv[1:6]
def weights(seed):
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}.weight": torch.randn(64, 1024, generator=g) for i in range(%d)}
cfg = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.25, timeout_s=%g)
if mode == "embedded":
    d = WeightSyncDaemon(cfg, DaemonConfig(heartbeat_timeout_s=0), token=token)
    for name, desc in json.loads(engines).items():
        d.register(name, desc)
else:
    d = WeightSyncDaemon(cfg, upstream=DaemonClient(address, token, 10))
for seed in map(int, seeds.split(",")):
    o = d.sync(StateDictSource(weights(seed)))
    print(json.dumps({"seed": seed, "version": o.version, "ok": o.ok, "seconds": o.seconds, "error": o.error}), flush=True)
time.sleep(3600)
""" % (NUM_TENSORS, TIMEOUT_S)


def run_trainer(script: Path, log: Path, mode: str, address: str, rs: list[TorchRefRollout], seeds: list[int]) -> list[dict[str, Any]]:
    """Start a trainer process, read one line per sync, then SIGKILL it (its checkpoint is `seeds`)."""
    engines = json.dumps({r.name: descriptor(r) for r in rs})
    with open(log, "a") as err:
        proc = subprocess.Popen(
            [sys.executable, str(script), mode, address, TOKEN, engines, ",".join(map(str, seeds))],
            stdout=subprocess.PIPE, stderr=err, text=True,
        )
    assert proc.stdout is not None
    lines = []
    try:
        for _ in seeds:
            ready, _, _ = select.select([proc.stdout], [], [], 90)
            line = proc.stdout.readline() if ready else ""
            assert line, f"the trainer printed nothing (exit code {proc.poll()}); stderr: {log.read_text()[-2000:]}"
            lines.append(json.loads(line))
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    return lines


@pytest.mark.parametrize("mode", ["embedded", "following"])
def test_a_restarted_trainer_carries_on_from_what_engines_hold(tmp_path: Path, engines: Callable[..., TorchRefRollout], mode: str) -> None:
    rs = [engines(f"r{i}") for i in range(2)]
    serve, address = (None, "-")
    if mode == "following":
        serve, address = start_serve(tmp_path)
        client = DaemonClient(address, TOKEN, timeout_s=10)
        for r in rs:
            client.register(r.name, descriptor(r))
        client.close()
    script, log = tmp_path / "trainer.py", tmp_path / "trainer.log"
    script.write_text(TRAINER)
    try:
        first = run_trainer(script, log, mode, address, rs, [1, 2, 3])
        assert [(o["version"], o["ok"]) for o in first] == [(1, True), (2, True), (3, True)], first
        for attempt in range(REPEATS):  # killed after version 3 + attempt, restarted from its checkpoint
            version, seed = 4 + attempt, 10 + attempt
            with PauseWatch(rs) as watch:
                (o,) = run_trainer(script, log, mode, address, rs, [seed])
            assert o["ok"] and o["version"] == version, o
            assert o["seconds"] < TIMEOUT_S, o
            assert watch.longest <= o["seconds"] + 0.5, f"an engine was paused {watch.longest:.2f}s around a {o['seconds']:.2f}s sync"
            for r in rs:
                assert exact(r, weights(seed), version)
        assert "Traceback" not in log.read_text(), log.read_text()[-3000:]
    finally:
        if serve is not None:
            serve.kill()
            serve.wait(10)
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


# --- `ckpt-engine serve` killed and restarted on its port and token ---------------------------
def test_a_restarted_serve_gets_its_engines_back(tmp_path: Path, engines: Callable[..., TorchRefRollout], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    port = free_port()
    serve, address = start_serve(tmp_path, port)
    rs = [engines(f"r{i}") for i in range(2)]
    beats = [HeartbeatSender(DaemonClient(address, TOKEN, timeout_s=2), r.name, 0.25, engine=descriptor(r)).start() for r in rs]
    trainer = WeightSyncDaemon(config(), upstream=DaemonClient(address, TOKEN, timeout_s=5))
    client = DaemonClient(address, TOKEN, timeout_s=5)
    try:
        wait_for("the engines registered", lambda: len(client.members()["engines"]) == 2, 5)
        assert trainer.sync(StateDictSource(weights(1))).ok
        version = 1
        for attempt in range(REPEATS):
            os.kill(serve.pid, signal.SIGKILL)
            serve.wait(10)
            if attempt == 0:  # the trainer syncs while the daemon is down: no traceback, the engines it knows
                outcome = trainer.sync(StateDictSource(weights(30)))
                assert outcome.ok, outcome
                version += 1
            serve, again = start_serve(tmp_path, port)
            assert again == address
            took = wait_for("the engines registered again", lambda: len(client.members()["engines"]) == 2, 5)
            assert took < 5
            wait_for("the daemon adopted the engines' version", lambda: client.status()["version"] == version, 5)
            version += 1
            sd = weights(40 + attempt)
            outcome = trainer.sync(StateDictSource(sd))
            assert outcome.ok and outcome.version == version and not outcome.dropped, outcome
            for r in rs:
                assert exact(r, sd, version)
            wait_for("the daemon took the report", lambda: client.status()["version"] == version, 5)
        assert all(b.registrations >= REPEATS for b in beats)
    finally:
        for b in beats:
            b.stop()
        trainer.close()
        client.close()
        serve.kill()
        serve.wait(10)
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
            t0 = time.monotonic()
            outcome = d.sync(StateDictSource(sd))
            print(f"restart {attempt}: {time.monotonic() - t0:.2f}s, attempts {outcome.attempts}")
            assert outcome.ok and outcome.version == version and not outcome.dropped, outcome
            assert time.monotonic() - t0 < TIMEOUT_S
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
            try:
                report = session.sync(StateDictSource(sd))
            except SyncError:  # the restart broke the session's group: the next sync rebuilds it
                report = session.sync(StateDictSource(sd))
            assert report.version == attempt + 2, "the next version continues from the highest sent, never 1 again"
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


def test_a_failure_with_every_engine_alive_drops_nobody(engines: Callable[..., TorchRefRollout]) -> None:
    """An engine taken into another group behind the daemon's back (as one restarted would have
    left it) fails the daemon's next transfer while it reports what the daemon knows: every
    engine the failure names answers a health probe, so nobody is dropped and the version is
    pushed again with a fresh group."""
    rs = [engines(f"r{i}") for i in range(3)]
    d = WeightSyncDaemon(config(), DaemonConfig(heartbeat_timeout_s=0), token=TOKEN)
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
            assert [a.get("kept") for a in outcome.attempts] == [["r0", "r1", "r2"]], outcome.attempts
            assert sorted(d.membership.names()) == ["r0", "r1", "r2"]
            for r in rs:
                assert exact(r, sd, version + 1)
    finally:
        d.close()
