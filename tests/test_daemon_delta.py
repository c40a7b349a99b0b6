"""Delta syncs through the daemon: `checkpoint_engine.delta=on` in the job config, reference
engines in their own processes registered by descriptor, gloo.

The daemon's group is a WeightSyncSession, so its syncs chain like the library's: a dense seed,
then patches of real AdamW steps (bf16 wire), every engine bit-exact after each; a new member
rebuilds the group, and the next sync seeds again. What the daemon records (last sync, history)
and what `ckpt-engine status` prints carry the wire bytes next to the dense bytes and the delta
kind.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import torch

from ckpt_engine.daemon import DaemonConfig, WeightSyncDaemon
from ckpt_engine.daemon.outcome import wire_text
from ckpt_engine.rollout_adapters.torch_ref import TorchRefRollout, write_spec_file
from ckpt_engine.trainer.config import load_job_config
from ckpt_engine.sources.base import StateDictSource
from multisender import model_state, wire
from helpers_procs import run_program
from refengines import holds, spawn_engine

pytestmark = pytest.mark.timeout(180)

TIMEOUT_S = 20.0
TOKEN = "test-daemon-delta-token"


def version(v: int) -> dict[str, torch.Tensor]:
    return wire(model_state(v, lr=1e-5))


@pytest.fixture
def spec_file(tmp_path: pytest.TempPathFactory) -> str:
    path = tmp_path / "spec.msgpack"  # type: ignore[operator]
    write_spec_file(path, StateDictSource(version(0)).metadata())
    return str(path)


@pytest.fixture
def engines(spec_file: str) -> Iterator[list[TorchRefRollout]]:
    spawned: list[TorchRefRollout] = []
    spawned += [spawn_engine(f"d{i}", spec_file=spec_file, timeout_s=TIMEOUT_S, token=TOKEN) for i in range(2)]
    yield spawned
    for r in spawned:
        r.close()


def descriptor(r: TorchRefRollout) -> dict[str, object]:
    return {"kind": "torch_ref", "host": r.rpc.host, "port": r.rpc.port}


def test_config_override_on_means_delta_on() -> None:
    """`checkpoint_engine.delta=on` on the command line (YAML reads a bare `on` as true)."""
    job = load_job_config(None, ["checkpoint_engine.delta=on", "checkpoint_engine.full_sync_every=0"])
    assert job.checkpoint_engine.delta == "on"
    assert load_job_config(None, ["checkpoint_engine.delta=off"]).checkpoint_engine.delta == "off"
    assert load_job_config(None, ["checkpoint_engine.delta=auto"]).checkpoint_engine.delta == "auto"


def test_daemon_delta_chain_is_bit_exact_and_status_shows_the_wire(engines: list[TorchRefRollout], spec_file: str) -> None:
    job = load_job_config(
        None, ["checkpoint_engine.backend=gloo", "checkpoint_engine.bucket_size_mb=0.0625", f"checkpoint_engine.timeout_s={TIMEOUT_S}", "checkpoint_engine.delta=on"]
    )
    daemon = WeightSyncDaemon(job.checkpoint_engine, DaemonConfig(heartbeat_timeout_s=0, health_interval_s=0.5), token=TOKEN)
    try:
        daemon.serve()
        for r in engines:
            daemon.register(r.name, descriptor(r))
        kinds = []
        for v in range(4):
            sd = version(v)
            outcome = daemon.sync(StateDictSource(sd))
            assert outcome.ok, outcome.error
            report = outcome.report
            assert report is not None
            kinds.append(report["delta"])
            for r in engines:
                assert holds(r, sd) == [], f"{r.name} differs from the trainer after v{outcome.version}"
            if report["delta"] == "patch":
                assert 0 < report["wire_bytes"] < 0.6 * report["dense_bytes"]
                assert 0 < report["changed_fraction"] < 0.5
            else:
                assert report["wire_bytes"] == report["dense_bytes"] > 0
        assert kinds == ["seed", "patch", "patch", "patch"]

        # What the daemon records: the last sync's report and the history lines.
        status = daemon.status()
        last = status["last_sync"]["report"]
        assert last["delta"] == "patch" and last["senders"] == 1 and last["wire_bytes"] < last["dense_bytes"]
        assert [(h["version"], h["delta"]) for h in status["history"]] == [(1, "seed"), (2, "patch"), (3, "patch"), (4, "patch")]
        assert all(h["wire_bytes"] > 0 and h["dense_bytes"] >= h["wire_bytes"] for h in status["history"])

        # What `ckpt-engine status` prints (rich tables) and returns as JSON (its `main`, forked).
        argv = ["status", "--address", str(daemon.address), "--token", TOKEN]
        code, out, err = run_program("ckpt_engine.cli:main", argv, "status", env={"COLUMNS": "200"}, timeout_s=120)
        assert code == 0, (code, err, out)
        assert wire_text(last) in out, out
        assert "wire" in out and "seed" in out and "senders" in out
        code, raw, err = run_program("ckpt_engine.cli:main", [*argv, "--json"], "status", env={"COLUMNS": "200"}, timeout_s=120)
        assert code == 0, (code, err, raw)
        shown = json.loads(raw)["last_sync"]["report"]
        assert (shown["delta"], shown["wire_bytes"], shown["dense_bytes"]) == (last["delta"], last["wire_bytes"], last["dense_bytes"])

        # A new member joins with no base: the group is rebuilt and the next sync seeds everyone.
        engines.append(spawn_engine("d2", spec_file=spec_file, timeout_s=TIMEOUT_S, token=TOKEN))
        daemon.register("d2", descriptor(engines[-1]))
        for v, kind in ((4, "seed"), (5, "patch")):
            sd = version(v)
            outcome = daemon.sync(StateDictSource(sd))
            assert outcome.ok and outcome.report is not None and outcome.report["delta"] == kind, outcome.error
            assert outcome.engines == {"d0": v + 1, "d1": v + 1, "d2": v + 1}
            for r in engines:
                assert holds(r, sd) == [], f"{r.name} differs from the trainer after v{outcome.version}"
    finally:
        daemon.close()


def test_wire_text_reads_reports_and_history_lines() -> None:
    assert wire_text({"delta": "patch", "wire_bytes": 1_200_000, "dense_bytes": 58_000_000, "bytes": 58_000_000}) == "patch 1.20 MB of 58.00 MB (2.1 %)"
    assert wire_text({"delta": "seed", "wire_bytes": 5000, "dense_bytes": 5000}) == "seed 5.0 kB of 5.0 kB (100.0 %)"
    assert wire_text({"delta": "off", "wire_bytes": 2_000_000, "dense_bytes": 2_000_000}) == "dense 2.00 MB"
    assert wire_text({"bytes": 300_000}) == "dense 0.30 MB"  # a record from before delta syncs
