"""An engine that registers again while a daemon's sync streams into it (F8): real reference
receivers in their own processes, registered by descriptor, gloo, delta syncs.

The re-registration lands while the engine's bucket loads wait on its hold file (load_gate.py), so
it is mid-sync on any box; the sync then completes. The engine holds the sync's version, so the
outcome must say so (not `stale`), nothing stays pending, and the next sync is a patch through the
same group (the new handle takes the old one's place), not a needless dense seed.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from ckpt_engine.config import CheckpointEngineConfig
from ckpt_engine.daemon import DaemonConfig, EngineState, SyncOutcome, WeightSyncDaemon
from ckpt_engine.rollout_adapters.torch_ref import TorchRefRollout
from ckpt_engine.sources.base import StateDictSource
from helpers_daemon import engine_fixtures, TIMEOUT_S, Engines, descriptor, holds, weights
from helpers_wait import wait_for

pytestmark = pytest.mark.timeout(180)

TOKEN = "test-daemon-reregister-token"
WAIT_S = 60.0
"""Bound of a wait for something that surely comes (liveness, not speed)."""


spec_file, receivers = engine_fixtures(TOKEN, "reregister")


def step(seed: int) -> dict[str, torch.Tensor]:
    """Weights one small step past `weights(1)`: a patch of them is far smaller than a seed."""
    sd = weights(1)
    for i, t in enumerate(sd.values()):
        t[0, seed % t.shape[1]] += 1.0 + i
    return sd


def sync_in_background(d: WeightSyncDaemon, sd: dict[str, torch.Tensor]) -> tuple[threading.Thread, list[SyncOutcome]]:
    done: list[SyncOutcome] = []
    t = threading.Thread(target=lambda: done.append(d.sync(StateDictSource(sd))), daemon=True)
    t.start()
    return t, done


def registered_mid_sync(d: WeightSyncDaemon, r: TorchRefRollout, hold: Path, sd: dict[str, torch.Tensor]) -> SyncOutcome:
    """Sync `sd` with `r`'s loads held, register `r` again while they are, let the loads go; the outcome."""
    hold.touch()
    try:
        t, done = sync_in_background(d, sd)
        wait_for(f"{r.name} is mid-sync (a bucket load waits on its hold file)", lambda: bool(r.health()["held"]), WAIT_S)
        registered = d.register(r.name, descriptor(r))
        assert registered["state"] == EngineState.STALE, registered  # what it said mid-sync: its loads wait
    finally:
        hold.unlink(missing_ok=True)
    t.join(WAIT_S)
    assert done, "the sync did not end"
    return done[0]


def test_an_engine_registered_again_mid_sync_holds_the_version_and_is_not_seeded_again(receivers: Engines, tmp_path: Path) -> None:
    hold = tmp_path / "hold"
    r0, r1 = receivers.spawn("r0", hold_file=str(hold)), receivers.spawn("r1")
    config = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.25, timeout_s=TIMEOUT_S, stage="off", delta="on")
    d = WeightSyncDaemon(config, DaemonConfig(heartbeat_timeout_s=0), token=TOKEN)
    try:
        for r in (r0, r1):
            d.register(r.name, descriptor(r))
        first = d.sync(StateDictSource(weights(1)))
        assert first.ok and first.report is not None and first.report["delta"] == "seed", first.error

        sd2 = step(2)
        outcome = registered_mid_sync(d, r0, hold, sd2)
        assert outcome.ok and outcome.version == 2, outcome.error
        assert outcome.stale == [] and outcome.states == {"r0": "serving", "r1": "serving"}, (outcome.stale, outcome.states)
        assert outcome.engines == {"r0": 2, "r1": 2}
        for r in (r0, r1):
            assert holds(r, sd2, 2), (r.name, r.health())
        assert d.pending() == [], "an engine that holds the version waits for nothing"
        assert d.catch_up(StateDictSource(sd2)) is None, "no catch-up seeds an engine that holds the version"

        sd3 = step(3)
        nxt = d.sync(StateDictSource(sd3))
        assert nxt.ok and nxt.version == 3 and nxt.report is not None, nxt.error
        assert nxt.report["delta"] == "patch", f"the next sync seeded again ({nxt.report['delta']}): the group was rebuilt for a handle of the same engine"
        for r in (r0, r1):
            assert holds(r, sd3, 3), (r.name, r.health())
    finally:
        d.close()

