"""The daemon under misuse and faults (issue 10): misowned engines, a failing source, a trainer
killed mid-sync, out-of-range versions.

Real reference receiver processes, real sockets, real gloo groups; each test fails on the code
before the fix (the engine accepted two groups, the daemon dropped healthy engines and blamed
them, status said `serving` for paused stale engines, 2**64-1 was accepted as a version).
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt_engine.config import CheckpointEngineConfig
from ckpt_engine.daemon import DaemonClient, DaemonConfig, EngineState, WeightSyncDaemon
from ckpt_engine.daemon.cli import READY_PREFIX
from ckpt_engine.rollout_adapters.torch_ref import TorchRefRollout, write_spec_file
from ckpt_engine.sources.base import StateDictSource
from ckpt_engine.control.wire import RpcError

pytestmark = pytest.mark.timeout(180)

TIMEOUT_S = 20.0
TOKEN = "reliability-job-token"
NUM_TENSORS = 8


def weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}.weight": torch.randn(64, 1024, generator=g) for i in range(NUM_TENSORS)}  # 256 KiB each


@pytest.fixture(scope="module")
def spec_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("reliability") / "spec.msgpack"
    write_spec_file(path, StateDictSource(weights(0)).metadata())
    return str(path)


@pytest.fixture
def engines(spec_file: str) -> Iterator[Callable[..., TorchRefRollout]]:
    made: list[TorchRefRollout] = []

    def spawn(name: str, token: str = TOKEN, load_delay_s: float = 0.0) -> TorchRefRollout:
        r = TorchRefRollout.spawn(name, spec_file=spec_file, timeout_s=TIMEOUT_S, token=token, load_delay_s=load_delay_s)
        made.append(r)
        return r

    yield spawn
    for r in made:
        r.close()


def config() -> CheckpointEngineConfig:
    return CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.25, timeout_s=TIMEOUT_S)


def descriptor(r: TorchRefRollout) -> dict[str, Any]:
    return {"kind": "torch_ref", "host": r.rpc.host, "port": r.rpc.port}


def holds(r: TorchRefRollout, sd: dict[str, torch.Tensor], version: int) -> bool:
    h = r.health()
    return (h["version"], h["paused"], h["stale"]) == (version, False, False) and all(torch.equal(r.get_tensor(n), t) for n, t in sd.items())


def wait_for(what: str, check: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"not within {timeout_s}s: {what}")
        time.sleep(0.1)


# --- item 2: one engine, one weight-sync job (issue 26: a daemon of the same job takes over) ----
def test_an_engine_belongs_to_one_job(engines: Callable[..., TorchRefRollout]) -> None:
    a = WeightSyncDaemon(config(), DaemonConfig(heartbeat_timeout_s=0), token=TOKEN)
    b = WeightSyncDaemon(config(), DaemonConfig(heartbeat_timeout_s=0), token=TOKEN)  # the same job (a restarted daemon)
    other_job = WeightSyncDaemon(config(), DaemonConfig(heartbeat_timeout_s=0))
    try:
        assert a.group == b.group != other_job.group, "the claim names the job"
        e = engines("e")
        a.register("e", descriptor(e))
        with pytest.raises(ValueError, match="'e' .* refused this job's token: it was started for another job"):
            other_job.register("e", descriptor(e))
        assert other_job.membership.names() == []
        # A controller naming another group (or none) cannot change the engine's state.
        stray = TorchRefRollout("e", e.rpc.host, e.rpc.port, None, TIMEOUT_S, token=TOKEN)
        with pytest.raises(RpcError, match="PermissionError: engine belongs to weight-sync group"):
            stray.resume()
        with pytest.raises(RpcError, match="PermissionError: engine belongs to weight-sync group"):
            stray.claim("another-group", 5.0)
        stray.close()

        sd1 = weights(1)
        assert a.sync(StateDictSource(sd1)).ok and holds(e, sd1, 1)
        assert a.leave("e")  # released at once
        wait_for("the leave released the engine", lambda: not e.health()["owned"], 5)
        b.register("e", descriptor(e))  # the same job's daemon takes it at once, and carries on from v1
        sd2 = weights(2)
        with pytest.raises(ValueError, match="version 1 is what 'e' already hold, and this daemon did not send it"):
            b.sync(StateDictSource(sd2), version=1)
        assert b.sync(StateDictSource(sd2), version=2).ok and holds(e, sd2, 2)
    finally:
        for d in (a, b, other_job):
            d.close()


def test_a_foreign_claim_lapses_when_its_group_goes_silent(engines: Callable[..., TorchRefRollout]) -> None:
    live = WeightSyncDaemon(config(), DaemonConfig(heartbeat_timeout_s=0), token=TOKEN)
    try:
        e = engines("e")
        foreign = TorchRefRollout("e", e.rpc.host, e.rpc.port, None, TIMEOUT_S, token=TOKEN)
        foreign.claim("another-group", 1.0)  # then never heard from again
        foreign.close()
        with pytest.raises(ValueError, match="belongs to another weight-sync group"):
            live.register("e", descriptor(e))
        time.sleep(1.3)
        live.register("e", descriptor(e))
        sd = weights(3)
        assert live.sync(StateDictSource(sd)).ok and holds(e, sd, 1)
    finally:
        live.close()


# --- item 3: a failing weight source is the source's fault -------------------------------------
class BrokenSource(StateDictSource):
    """Yields a few tensors, then fails as a trainer bug or a lost shard would."""

    def __init__(self, sd: dict[str, torch.Tensor], fail_after: int) -> None:
        super().__init__(sd)
        self.fail_after = fail_after

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for i, item in enumerate(super().iter_weights()):
            if i == self.fail_after:
                raise OSError("shard 3 of the checkpoint is unreadable")
            yield item


def test_a_failing_source_is_named_and_healthy_engines_stay(engines: Callable[..., TorchRefRollout]) -> None:
    d = WeightSyncDaemon(config(), DaemonConfig(heartbeat_timeout_s=0), token=TOKEN)
    try:
        rs = [engines(f"r{i}") for i in range(2)]
        for r in rs:
            d.register(r.name, descriptor(r))
        sd1 = weights(1)
        assert d.sync(StateDictSource(sd1)).ok

        t0 = time.monotonic()
        outcome = d.sync(BrokenSource(weights(2), fail_after=3))
        assert time.monotonic() - t0 < TIMEOUT_S + 10
        assert not outcome.ok and not outcome.dropped, outcome
        assert outcome.error is not None and "weight source BrokenSource raised OSError: shard 3 of the checkpoint is unreadable" in outcome.error
        assert sorted(d.membership.names()) == ["r0", "r1"]
        states = {e["name"]: (e["state"], e["version"]) for e in d.status()["engines"]}
        assert states == {"r0": (EngineState.STALE, None), "r1": (EngineState.STALE, None)}
        for r in rs:
            h = r.health()
            assert h["paused"] and h["stale"] and h["version"] is None, h
        assert sorted(d.pending()) == ["r0", "r1"]

        sd3 = weights(3)  # the next complete sync heals every engine
        outcome = d.sync(StateDictSource(sd3))
        assert outcome.ok and outcome.version == 2 and outcome.engines == {"r0": 2, "r1": 2}
        for r in rs:
            assert holds(r, sd3, 2)
    finally:
        d.close()


# --- item 6: status after a trainer died mid-sync ----------------------------------------------
TRAINER = """
import sys, torch
from ckpt_engine.config import CheckpointEngineConfig
from ckpt_engine.daemon import DaemonClient, WeightSyncDaemon
from ckpt_engine.sources.base import StateDictSource
g = torch.Generator().manual_seed(7)
sd = {f"layer{i}.weight": torch.randn(64, 1024, generator=g) for i in range(%d)}
d = WeightSyncDaemon(CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.25, timeout_s=%g), upstream=DaemonClient(sys.argv[1], sys.argv[2], 10))
d.sync(StateDictSource(sd))
""" % (NUM_TENSORS, TIMEOUT_S)


def start_serve(tmp_path: Path) -> tuple[subprocess.Popen[str], str]:
    cfg = tmp_path / "job.yaml"
    cfg.write_text("checkpoint_engine:\n  backend: gloo\n  bucket_size_mb: 0.25\n  timeout_s: 20\ndaemon:\n  health_interval_s: 0.3\n  heartbeat_timeout_s: 0\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckpt_engine.cli", "serve", "--config", str(cfg), "--token", TOKEN],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    line = proc.stdout.readline() if ready else ""
    if not line.startswith(READY_PREFIX):
        proc.kill()
        pytest.fail(f"ckpt-engine serve did not start: {line!r}")
    return proc, dict(part.split("=", 1) for part in line[len(READY_PREFIX):].split())["address"]


def test_status_is_truthful_after_a_trainer_dies_mid_sync(tmp_path: Path, engines: Callable[..., TorchRefRollout]) -> None:
    proc, address = start_serve(tmp_path)
    trainer: WeightSyncDaemon | None = None
    try:
        client = DaemonClient(address, TOKEN, timeout_s=10)
        rs = [engines(f"r{i}", load_delay_s=0.3) for i in range(2)]
        for r in rs:
            client.register(r.name, descriptor(r))
        trainer = WeightSyncDaemon(config(), upstream=DaemonClient(address, TOKEN, timeout_s=10))
        sd1 = weights(1)
        assert trainer.sync(StateDictSource(sd1)).ok
        wait_for("status says serving v1", lambda: {(e["state"], e["version"]) for e in client.status()["engines"]} == {("serving", 1)}, 5)

        # A trainer process starts v2 and is killed once the engines hold part of it.
        script = tmp_path / "trainer.py"
        script.write_text(TRAINER)
        crashing = subprocess.Popen([sys.executable, str(script), address, TOKEN], stderr=subprocess.DEVNULL)
        try:
            wait_for("the transfer reached the engines", lambda: all(r.health()["buckets_received"] > NUM_TENSORS for r in rs), 60)
        finally:
            os.kill(crashing.pid, signal.SIGKILL)
            crashing.wait(10)
        for r in rs:  # the engine reports no version while it holds a mix
            h = r.health()
            assert h["stale"] and h["paused"] and h["version"] is None, h
        wait_for(
            "status says stale, with no version",
            lambda: {(e["state"], e["version"]) for e in client.status()["engines"]} == {(EngineState.STALE, None)},
            5,
        )
        # Nobody can make a half-written engine serve: not finalize(7) + resume from the owner's group.
        sneaky = TorchRefRollout("r0", rs[0].rpc.host, rs[0].rpc.port, None, TIMEOUT_S, token=TOKEN)
        sneaky.owner = client.hello()["group"]
        with pytest.raises(RpcError, match="no transfer completed since the last finalize"):
            sneaky.finalize(7)
        with pytest.raises(RpcError, match="partially loaded state"):
            sneaky.resume()
        sneaky.close()
        assert not any(r.health()["version"] == 7 for r in rs)

        wait_for("the killed sync's receives ended", lambda: not any(r.health()["receiving"] for r in rs), TIMEOUT_S + 10)
        sd3 = weights(3)
        outcome = trainer.sync(StateDictSource(sd3))
        assert outcome.ok and outcome.version == 2, outcome
        for r in rs:
            assert holds(r, sd3, 2)
        wait_for("status says serving v2", lambda: {(e["state"], e["version"]) for e in client.status()["engines"]} == {("serving", 2)}, 5)
        client.close()
    finally:
        if trainer is not None:
            trainer.close()
        proc.kill()
        proc.wait(10)


# --- item 8: versions are checked where they enter ---------------------------------------------
def test_versions_are_bounded_and_monotone_at_the_edges(engines: Callable[..., TorchRefRollout]) -> None:
    standalone = WeightSyncDaemon(config(), DaemonConfig(heartbeat_timeout_s=0), token=TOKEN, role="standalone")
    standalone.serve()
    trainer: WeightSyncDaemon | None = None
    try:
        client = DaemonClient(standalone.address, TOKEN, timeout_s=10)
        r = engines("r0")
        client.register("r0", descriptor(r))
        huge = {"version": 2**64 - 1, "ok": True, "engines": {"r0": 2**64 - 1}, "states": {"r0": "serving"}, "dropped": {}, "stale": []}
        with pytest.raises(RpcError, match=r"outcome.version must be an int in \[0, 2\*\*63-1\]"):
            client.report_sync(huge)
        with pytest.raises(RpcError, match=r"outcome.engines.r0 must be an int in \[0, 2\*\*63-1\]"):
            client.report_sync({**huge, "version": 1})
        assert client.status()["version"] == 0

        trainer = WeightSyncDaemon(config(), upstream=DaemonClient(standalone.address, TOKEN, timeout_s=10))
        with pytest.raises(ValueError, match=r"version \(at least the current version 1\) must be an int in \[1, 2\*\*63-1\], got 18446744073709551615"):
            trainer.sync(StateDictSource(weights(1)), version=2**64 - 1)
        sd = weights(2)
        assert trainer.sync(StateDictSource(sd), version=5).ok and holds(r, sd, 5)
        with pytest.raises(RpcError, match="older than the current version 5"):
            client.report_sync({**huge, "version": 4, "engines": {"r0": 4}})

        # The engine refuses versions outside the range, and versions below the one it holds.
        owner = TorchRefRollout("r0", r.rpc.host, r.rpc.port, None, TIMEOUT_S, token=TOKEN)
        owner.owner = client.hello()["group"]
        for bad in (2**63, -1, 4):
            with pytest.raises(RpcError, match=r"finalize version must be an int in \[5, 2\*\*63-1\]"):
                owner.finalize(bad)
        owner.close()
        assert r.health()["version"] == 5
        client.close()
    finally:
        if trainer is not None:
            trainer.close()
        standalone.close()
