"""`ckpt-engine serve` with `daemon.state_file`: a job stopped whole never issues a version again.

Real processes: `serve` forked from the test session's preloaded server and SIGKILLed, reference
engines in their own processes (one killed and started again at its address, holding nothing), a
trainer following `serve` (`WeightSyncDaemon(upstream=...)`), gloo.

The version `serve` must keep is not only one a trainer reported: a trainer that synced while
`serve` was down (or died before its report) leaves `serve` to learn the version from its engines
when they register. Then the whole job stops; the engine restarted first holds nothing, the one
holding that version registers last. The file must have kept it, or the next trainer issues it
again on other weights and the late engine looks current while it serves the old ones.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest

from ckpt_engine.daemon import DaemonClient, EngineState, WeightSyncDaemon
from ckpt_engine.sources.base import StateDictSource
from helpers_daemon import engine_fixtures, Engines, Serve, config, descriptor, holds, start_serve, weights
from helpers_wait import wait_for

pytestmark = pytest.mark.timeout(300)

TOKEN = "test-daemon-state-file-token"


spec_file, receivers = engine_fixtures(TOKEN, "state-file")


def kill(serve: Serve) -> None:
    os.kill(serve.process.pid, signal.SIGKILL)
    serve.process.wait(10)


def test_serve_keeps_a_version_it_learned_from_its_engines_across_a_whole_job_restart(receivers: Engines, tmp_path: Path) -> None:
    state = tmp_path / "versions.json"
    keep = f"daemon.state_file={state}"
    r0, r1 = receivers.spawn("r0"), receivers.spawn("r1")
    serve = start_serve(tmp_path, TOKEN, keep)
    trainer = WeightSyncDaemon(config(), upstream=DaemonClient(serve.address, TOKEN, timeout_s=5))
    try:
        client = DaemonClient(serve.address, TOKEN, timeout_s=10)
        for r in (r0, r1):
            client.register(r.name, descriptor(r))
        assert trainer.sync(StateDictSource(weights(1))).version == 1
        assert json.loads(state.read_text()) == {"version": 1}, "a trainer's report is kept"

        kill(serve)  # the trainer syncs on while `serve` is down: its report of v2 reaches nobody
        sd2 = weights(2)
        outcome = trainer.sync(StateDictSource(sd2))
        assert outcome.ok and outcome.version == 2, outcome.error
        serve = start_serve(tmp_path, TOKEN, keep)
        client = DaemonClient(serve.address, TOKEN, timeout_s=10)
        for r in (r0, r1):
            client.register(r.name, descriptor(r))  # as their heartbeats would
        assert client.status()["version"] == 2, "serve adopts the version its engines hold"
        assert json.loads(state.read_text()) == {"version": 2}, "a version serve learned from its engines is the job's, kept like one it was told"
    finally:
        trainer.close()

    # The whole job stops: `serve` and the trainer killed, r0 restarted at its address (holding
    # nothing); r1 still serves v2 (sd2) and registers last.
    kill(serve)
    r0.process.kill()
    r0.process.wait(10)
    r0 = receivers.spawn("r0", port=r0.rpc.port)
    serve = start_serve(tmp_path, TOKEN, keep)
    client = DaemonClient(serve.address, TOKEN, timeout_s=10)
    trainer = WeightSyncDaemon(config(), upstream=DaemonClient(serve.address, TOKEN, timeout_s=5))
    try:
        assert client.register("r0", descriptor(r0))["version"] is None
        sd3 = weights(3)
        outcome = trainer.sync(StateDictSource(sd3))
        assert outcome.ok and outcome.version == 3, f"the restarted job issued v{outcome.version} again on other weights"
        assert holds(r0, sd3, 3)
        late = client.register("r1", descriptor(r1))
        assert (late["state"], late["version"]) == (EngineState.SERVING, 2) and "r1" in trainer.pending(), late
        caught = trainer.catch_up(StateDictSource(sd3))
        assert caught is not None and caught.ok and caught.version == 3 and caught.catch_up, caught
        assert holds(r0, sd3, 3) and holds(r1, sd3, 3)
        assert json.loads(state.read_text()) == {"version": 3}
    finally:
        trainer.close()
        serve.stop()
    assert "Traceback" not in (tmp_path / "serve.log").read_text()


def test_a_version_a_trainer_began_is_kept_before_any_engine_holds_it(receivers: Engines, tmp_path: Path) -> None:
    """A trainer following `serve` names each version to `serve` before it syncs (`begin_sync`): the
    state file holds it while the engines' loads are still held. So the whole job stopped before the
    trainer's report, and before `serve` heard of it from the engines (here `serve` is killed
    mid-sync, the engines after), never issues that version again on other weights. Before, the
    file held the last reported version, and the next job issued v2 a second time."""
    state = tmp_path / "versions.json"
    keep = f"daemon.state_file={state}"
    hold = tmp_path / "hold"
    r0, r1 = receivers.spawn("r0", hold_file=str(hold)), receivers.spawn("r1")
    serve = start_serve(tmp_path, TOKEN, keep)
    trainer = WeightSyncDaemon(config(), upstream=DaemonClient(serve.address, TOKEN, timeout_s=5))
    try:
        client = DaemonClient(serve.address, TOKEN, timeout_s=10)
        for r in (r0, r1):
            client.register(r.name, descriptor(r))
        assert trainer.sync(StateDictSource(weights(1))).version == 1
        hold.touch()
        done: list[Any] = []
        t = threading.Thread(target=lambda: done.append(trainer.sync(StateDictSource(weights(2)))), daemon=True)
        try:
            t.start()
            wait_for("r0 is mid-sync (a bucket load waits on its hold file)", lambda: bool(r0.health()["held"]), 60)
            assert json.loads(state.read_text()) == {"version": 2}, "serve kept v2 only once it was reported"
            kill(serve)  # the trainer's report of v2 reaches nobody, and serve never probes the engines
        finally:
            hold.unlink(missing_ok=True)
        t.join(60)
        assert done and done[0].ok and done[0].version == 2, done
    finally:
        trainer.close()
    # the engines go too and come back holding nothing; serve and a new trainer start again
    for r in (r0, r1):
        r.process.kill()
        r.process.wait(10)
    r0, r1 = receivers.spawn("r0", port=r0.rpc.port), receivers.spawn("r1", port=r1.rpc.port)
    serve = start_serve(tmp_path, TOKEN, keep)
    trainer = WeightSyncDaemon(config(), upstream=DaemonClient(serve.address, TOKEN, timeout_s=5))
    try:
        client = DaemonClient(serve.address, TOKEN, timeout_s=10)
        for r in (r0, r1):
            assert client.register(r.name, descriptor(r))["version"] is None
        sd3 = weights(3)
        outcome = trainer.sync(StateDictSource(sd3))
        assert outcome.ok and outcome.version == 3, f"the restarted job issued v{outcome.version} again on other weights"
        assert holds(r0, sd3, 3) and holds(r1, sd3, 3)
    finally:
        trainer.close()
        serve.stop()
