"""Elastic joins through `ckpt-engine serve` (issue 43 item 2), with `daemon.peer_join=true`: an
engine that registers mid-job, and the same engine restarted and registered again, pulls the job's
current version from a serving member over NIXL (UCX on the CPU box), is reported `serving` only
once it holds it bit for bit, and `ckpt-engine status` says where each engine got its version; the
trainer's next sync covers it like the others. Real processes (serve, reference receivers);
every wait is bounded."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ckpt_engine.daemon import DaemonClient, WeightSyncDaemon
from ckpt_engine.sources.base import StateDictSource
from test_elastic_join import nixl_missing
from helpers_daemon import Engines, config, descriptor, holds, start_serve, weights, write_spec
from helpers_wait import wait_for

pytestmark = pytest.mark.skipif(bool(nixl_missing()), reason=nixl_missing())

TOKEN = "elastic-daemon-token-0123"
WAIT_S = 60.0
"""Bound of a wait for something that surely comes (a liveness check, not a speed claim)."""


def record(client: DaemonClient, name: str) -> dict:
    return next(e for e in client.status()["engines"] if e["name"] == name)


def status_cli(address: str, *extra: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "ckpt_engine.cli", "status", "--address", address, "--token", TOKEN, *extra],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_an_engine_registering_mid_job_joins_from_a_peer_and_status_says_so(tmp_path: Path) -> None:
    engines = Engines(write_spec(tmp_path / "spec.msgpack"), TOKEN)
    serve = start_serve(tmp_path, TOKEN, "daemon.peer_join=true")
    trainer: WeightSyncDaemon | None = None
    try:
        client = DaemonClient(serve.address, TOKEN, timeout_s=10)
        peers = [engines.spawn(f"r{i}") for i in range(2)]
        for r in peers:
            client.register(r.name, descriptor(r))
        trainer = WeightSyncDaemon(config(), upstream=DaemonClient(serve.address, TOKEN, timeout_s=10))
        sd1 = weights(1)
        assert trainer.sync(StateDictSource(sd1)).ok
        wait_for("both serve v1", lambda: {(e["state"], e["version"]) for e in client.status()["engines"]} == {("serving", 1)}, WAIT_S)

        late = engines.spawn("late")
        client.register("late", descriptor(late))
        wait_for("the late engine serves v1", lambda: (record(client, "late")["state"], record(client, "late")["version"]) == ("serving", 1), 60)
        assert holds(late, sd1, 1)
        joined = client.status()["peer_joins"]["late"]
        assert joined["ok"] and joined["peer"] in ("r0", "r1") and joined["version"] == 1 and joined["wall_s"] > 0
        wait_for("status shows where each engine got v1", lambda: record(client, "late")["health"].get("version_from") == f"peer pull from {joined['peer']}", WAIT_S)
        status = json.loads(status_cli(serve.address, "--json"))
        origin = {e["name"]: e["health"]["version_from"] for e in status["engines"]}
        assert origin == {"r0": "trainer sync", "r1": "trainer sync", "late": f"peer pull from {joined['peer']}"}
        text = status_cli(serve.address)
        assert "version from" in text and "peer joins" in text and "trainer sync" in text

        sd2 = weights(2)
        outcome = trainer.sync(StateDictSource(sd2))
        assert outcome.ok and outcome.version == 2 and all(holds(r, sd2, 2) for r in [*peers, late])
        wait_for("status: every engine got v2 from the trainer", lambda: all(e["health"].get("version_from") == "trainer sync" for e in client.status()["engines"]), WAIT_S)

        # The late engine restarts at its address (a fresh process, holding zeros) and registers again.
        port = late.rpc.port
        late.process.send_signal(signal.SIGKILL)
        late.process.wait(30)
        again = engines.spawn("late", port=port)
        client.register("late", descriptor(again))
        wait_for("the restarted engine serves v2", lambda: (record(client, "late")["state"], record(client, "late")["version"]) == ("serving", 2), 60)
        assert holds(again, sd2, 2) and again.health()["version_from"].startswith("peer pull from r")
        sd3 = weights(3)
        assert trainer.sync(StateDictSource(sd3)).ok and all(holds(r, sd3, 3) for r in [*peers, again])
    finally:
        if trainer is not None:
            trainer.close()
        serve.stop()
        engines.close()
