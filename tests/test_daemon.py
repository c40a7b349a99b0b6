"""WeightSyncDaemon with real receiver processes over gloo: versions, membership, faults.

Every receiver is a real `python -m ckpt_engine.rollout_adapters.torch_ref` process reached over
TCP; engines register by descriptor through the daemon's control server, as remote engines do.
"""

from __future__ import annotations

import threading
import time
from typing import Any
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ckpt_engine.daemon import DaemonClient, DaemonConfig, EngineState, WeightSyncDaemon
from ckpt_engine.daemon.outcome import SyncOutcome
from ckpt_engine.daemon.protocol import ProtocolError, check_outcome
from ckpt_engine.rollout_adapters.base import ManifestRejectedError, RolloutAdapter
from ckpt_engine.rollout_adapters.torch_ref import TorchRefRollout, write_spec_file
from ckpt_engine.sources.base import StateDictSource
from helpers_daemon import engine_fixtures, NUM_TENSORS, Engines, config, descriptor, holds, weights
from helpers_wait import wait_for

pytestmark = pytest.mark.timeout(180)

JOB_TOKEN = "test-daemon-job-token"
"""Engines demand their job's token; the daemons of these tests hold it too."""


spec_file, receivers = engine_fixtures(JOB_TOKEN, "daemon")


@pytest.fixture
def daemon(receivers: Engines) -> Iterator[WeightSyncDaemon]:  # closes before the receivers
    d = WeightSyncDaemon(config(), DaemonConfig(heartbeat_timeout_s=0, health_interval_s=0.5), token=JOB_TOKEN)
    d.serve()
    yield d
    d.close()


LONG_TIMEOUT_S = 120.0
"""The collective timeout of `patient_daemon`: a test that must tell "noticed the fault" from
"waited the timeout out" bounds its wait by half of it, far past any normal run on a slow box."""


@pytest.fixture
def patient_daemon(receivers: Engines) -> Iterator[WeightSyncDaemon]:
    d = WeightSyncDaemon(config(LONG_TIMEOUT_S), DaemonConfig(heartbeat_timeout_s=0, health_interval_s=0.5), token=JOB_TOKEN)
    yield d
    d.close()


def assert_holds(r: TorchRefRollout, sd: dict[str, torch.Tensor], version: int) -> None:
    assert holds(r, sd, version), (r.name, r.health())


def test_versions_increase_and_membership(daemon: WeightSyncDaemon, receivers: Engines) -> None:
    client = DaemonClient(daemon.address, daemon.token, timeout_s=10)
    r0, r1 = receivers.spawn("r0"), receivers.spawn("r1")
    for r in (r0, r1):
        rec = client.register(r.name, descriptor(r))
        assert rec["state"] == EngineState.PENDING
        assert not r.health()["paused"], "registration pauses nothing until a sync starts (issue 26)"
    assert sorted(daemon.pending()) == ["r0", "r1"]

    sds = [weights(s) for s in (1, 2)]
    for v, sd in enumerate(sds, start=1):
        outcome = daemon.sync(StateDictSource(sd))
        assert outcome.ok and outcome.version == v and not outcome.dropped, outcome
        assert outcome.engines == {"r0": v, "r1": v}
        for r in (r0, r1):
            assert_holds(r, sd, v)
    assert daemon.pending() == []
    with pytest.raises(ValueError, match="at least the current version 2"):
        daemon.sync(StateDictSource(sds[1]), version=1)

    # A new engine joins between syncs: it is pending (not paused) until a catch-up of the current version.
    r2 = receivers.spawn("r2")
    client.register("r2", descriptor(r2))
    assert daemon.pending() == ["r2"] and not r2.health()["paused"]
    outcome = daemon.catch_up(StateDictSource(sds[1]))
    assert outcome is not None and outcome.ok and outcome.catch_up and outcome.version == 2
    for r in (r0, r1, r2):
        assert_holds(r, sds[1], 2)
    assert daemon.catch_up(StateDictSource(sds[1])) is None  # nothing pending

    # An engine leaves between syncs: the group is rebuilt without it and it keeps its version.
    assert client.leave("r0") == {"left": True}
    sd3 = weights(3)
    outcome = daemon.sync(StateDictSource(sd3))
    assert outcome.ok and outcome.version == 3 and set(outcome.engines) == {"r1", "r2"}
    assert_holds(r1, sd3, 3)
    assert r0.health()["version"] == 2
    status = client.status()
    assert status["version"] == 3 and status["departed"]["r0"]["reason"] == "left"
    assert status["last_sync"]["ok"] and status["manifest"]["tensors"] == NUM_TENSORS
    client.close()


def test_killed_engine_is_dropped_survivors_resynced_and_it_rejoins(patient_daemon: WeightSyncDaemon, receivers: Engines, tmp_path: Path) -> None:
    daemon = patient_daemon  # its collective timeout is far past any recovery: a wait of it is told apart on any box
    hold = tmp_path / "hold"  # r1's loads wait while it exists: the kill lands mid-sync on any box (load_gate.py)
    rs = [receivers.spawn(f"r{i}", load_delay_s=0.25, hold_file=str(hold) if i == 1 else None) for i in range(3)]
    for r in rs:
        daemon.register(r.name, descriptor(r))
    sd1, sd2 = weights(11), weights(12)
    assert daemon.sync(StateDictSource(sd1)).ok

    victim = rs[1]
    killed = threading.Event()

    def kill_mid_sync() -> None:
        deadline = time.monotonic() + 60
        try:
            while time.monotonic() < deadline:
                if victim.health()["held"]:  # a bucket load of this sync waits on the hold file: surely mid-sync
                    victim.process.kill()
                    killed.set()
                    return
                time.sleep(0.02)
        finally:
            hold.unlink(missing_ok=True)

    hold.touch()
    killer = threading.Thread(target=kill_mid_sync, daemon=True)
    killer.start()
    t0 = time.monotonic()
    outcome = daemon.sync(StateDictSource(sd2))
    elapsed = time.monotonic() - t0
    print(f"sync with a kill: {elapsed:.2f}s, attempts {outcome.attempts}, report seconds {outcome.report and outcome.report['seconds']}")
    killer.join(5)
    assert killed.is_set(), "the receiver was not killed mid-sync"
    # The sync names the dead engine, then re-syncs the survivors to the same version on its own.
    assert set(outcome.dropped) == {"r1"}, outcome.dropped
    assert "failed during transfer" in outcome.dropped["r1"] and "'r1'" in outcome.dropped["r1"], outcome.dropped
    assert outcome.attempts and outcome.attempts[0]["stage"] == "transfer" and "r1" in outcome.attempts[0]["failed"]
    assert outcome.ok and outcome.version == 2 and outcome.engines == {"r0": 2, "r2": 2} and outcome.stale == []
    assert elapsed < LONG_TIMEOUT_S / 2, f"recovery took {elapsed:.1f}s; it must not wait out the collective timeout ({LONG_TIMEOUT_S:g}s)"
    for r in (rs[0], rs[2]):
        assert_holds(r, sd2, 2)

    # Restarted under the same name, it re-joins pending (not paused) and catches up to the current version.
    back = receivers.spawn("r1", load_delay_s=0.0)
    daemon.register("r1", descriptor(back))
    assert daemon.pending() == ["r1"] and not back.health()["paused"]
    outcome = daemon.catch_up(StateDictSource(sd2))
    assert outcome is not None and outcome.ok and outcome.version == 2 and outcome.catch_up
    for r in (rs[0], back, rs[2]):
        assert_holds(r, sd2, 2)
    sd3 = weights(13)
    assert daemon.sync(StateDictSource(sd3)).engines == {"r0": 3, "r2": 3, "r1": 3}
    assert_holds(back, sd3, 3)


def test_dead_engine_between_syncs_is_dropped_quickly(daemon: WeightSyncDaemon, receivers: Engines) -> None:
    rs = [receivers.spawn(f"r{i}") for i in range(2)]
    for r in rs:
        daemon.register(r.name, descriptor(r))
    assert daemon.sync(StateDictSource(weights(21))).ok
    rs[0].process.kill()
    rs[0].process.wait(10)
    outcome = daemon.sync(StateDictSource(weights(22)))
    assert outcome.ok and set(outcome.dropped) == {"r0"} and outcome.engines == {"r1": 2}
    # Quickly: the probe before the sync found it dead (no attempt through the group failed, which
    # would have waited for the dead rank), and the group was rebuilt without it.
    assert [a["stage"] for a in outcome.attempts] == ["probe"] and set(outcome.attempts[0]["failed"]) == {"r0"}, outcome.attempts
    assert "unreachable before the sync" in outcome.dropped["r0"], outcome.dropped


def test_heartbeat_timeout_drops_silent_engine(receivers: Engines) -> None:
    """A health answer counts as a heartbeat: one pass of the daemon's check, run when both engines'
    registration stamps are older than the timeout, keeps the one that answers and drops the dead
    one. The pass is driven here, not by the monitor's clock, so a starved box cannot make the live
    engine miss a window; then the monitor itself drops the other one once it dies (awaited)."""
    timeout_s = 1.0
    d = WeightSyncDaemon(config(), DaemonConfig(heartbeat_timeout_s=timeout_s, health_interval_s=0.2), token=JOB_TOKEN)
    try:
        silent, live = receivers.spawn("silent"), receivers.spawn("live")
        d.register("silent", descriptor(silent))  # probed first in a pass: its failed probe cannot delay live's
        d.register("live", descriptor(live))
        silent.process.kill()
        silent.process.wait(10)
        newest = d.membership.get("live")
        assert newest is not None
        wait_for("both registrations older than the heartbeat timeout", lambda: time.monotonic() - newest.last_seen > timeout_s + 0.05, 30)
        assert sorted(r.name for r in d.membership.silent_for(timeout_s)) == ["live", "silent"]  # both would go unheard
        d.check_health()
        assert d.membership.names() == ["live"], "the engine that answers the probe stays; the dead one goes"
        assert "no heartbeat" in d.membership.departed["silent"]["reason"]
        with pytest.raises(ValueError, match="not registered"):
            d.heartbeat("silent")
        assert d.heartbeat("live")["state"] == EngineState.PENDING
        d.start_monitor()
        live.process.kill()
        wait_for("the monitor drops the engine that died", lambda: d.membership.names() == [], 60)
        assert "no heartbeat" in d.membership.departed["live"]["reason"]
    finally:
        d.close()


def test_rejecting_engine_is_dropped_and_others_sync(daemon: WeightSyncDaemon, receivers: Engines, tmp_path: Path) -> None:
    other_spec = tmp_path / "other.msgpack"
    write_spec_file(other_spec, StateDictSource({"something.else": torch.zeros(3)}).metadata())
    good = receivers.spawn("good")
    bad = receivers.spawn("bad", spec_file=str(other_spec))
    daemon.register("good", descriptor(good))
    daemon.register("bad", descriptor(bad))
    sd = weights(31)
    outcome = daemon.sync(StateDictSource(sd))
    assert outcome.ok and outcome.engines == {"good": 1} and "bad" in outcome.rejected
    assert "layer0.weight: the engine has no such tensor" in outcome.rejected["bad"][0]
    assert_holds(good, sd, 1)
    assert bad.health()["version"] is None
    # When every engine rejects, the trainer's weights do not fit: that is an error.
    daemon.register("bad", descriptor(bad))
    daemon.leave("good")
    with pytest.raises(ManifestRejectedError, match="bad"):
        daemon.sync(StateDictSource(sd))


def synced_pair(daemon: WeightSyncDaemon, receivers: Engines, seed: int) -> tuple[list[TorchRefRollout], RolloutAdapter]:
    """Two engines registered and synced to `seed`'s weights, and the daemon's handle on the second."""
    rs = [receivers.spawn(f"r{i}") for i in range(2)]
    for r in rs:
        daemon.register(r.name, descriptor(r))
    assert daemon.sync(StateDictSource(weights(seed))).ok
    victim = next(rec.adapter for rec in daemon.membership.records() if rec.name == "r1")
    assert victim is not None
    return rs, victim


def test_a_retry_pushes_the_same_version_to_an_engine_the_failed_attempt_finalized(daemon: WeightSyncDaemon, receivers: Engines) -> None:
    """A sync that fails after an engine finalized (its answer to the resume is lost: a timeout
    under load) leaves that engine on the new version while the daemon retries it. The retry walks
    the same weights, so it must take that engine again under the same version, not refuse the
    version as one the engines already hold (the demo died of that on a loaded CI box)."""
    sd2 = weights(22)
    rs, victim = synced_pair(daemon, receivers, 21)
    real_resume = victim.resume
    lost: list[int] = []

    def resume_once_lost() -> None:
        real_resume()  # the engine resumed, holding the new version
        if not lost:
            lost.append(victim.health()["version"])
            raise TimeoutError("the engine's answer to resume was lost")

    victim.resume = resume_once_lost  # type: ignore[method-assign]
    outcome = daemon.sync(StateDictSource(sd2))
    assert lost == [2], lost  # the failed attempt had finalized r1 on version 2
    assert outcome.attempts and outcome.attempts[0]["stage"] == "resume" and "r1" in outcome.attempts[0]["failed"], outcome.attempts
    assert outcome.ok and outcome.version == 2 and outcome.engines == {"r0": 2, "r1": 2} and not outcome.dropped, outcome
    for r in rs:
        assert_holds(r, sd2, 2)
    assert daemon.sync(StateDictSource(weights(23))).engines == {"r0": 3, "r1": 3}


def sync_beside_another_trainer(daemon: WeightSyncDaemon, rs: list[TorchRefRollout], mine: int, theirs: int) -> tuple[SyncOutcome, list[int]]:
    """`daemon` syncs `mine`'s weights while a second trainer's daemon on the same job token syncs
    `theirs`' once, between the first one's failed attempt and its retry (the walk barrier runs
    there): the outcome, and the versions the other trainer got."""
    other = WeightSyncDaemon(config(), DaemonConfig(heartbeat_timeout_s=0, health_interval_s=0.5), token=JOB_TOKEN)
    versions: list[int] = []

    def barrier(again: bool) -> None:
        if again and not versions:
            for r in rs:
                other.register(r.name, descriptor(r))
            versions.append(other.sync(StateDictSource(weights(theirs))).version)

    try:
        return daemon.sync(StateDictSource(weights(mine)), walk_barrier=barrier), versions
    finally:
        other.close()


def test_two_trainers_on_one_job_token_end_the_retry_with_an_error_saying_so(daemon: WeightSyncDaemon, receivers: Engines) -> None:
    """A second trainer with the same job token syncs the engines between the first one's failed
    attempt and its retry (the walk barrier runs between them): the engines then hold a newer
    version than the retry's. The sync ends with an outcome naming what happened and what to do,
    not a raw ValueError out of the version check (issue 45)."""
    rs, victim = synced_pair(daemon, receivers, 31)
    real_resume = victim.resume
    lost: list[bool] = []

    def resume_once_lost() -> None:  # the first attempt fails after r1 resumed (a lost answer)
        real_resume()
        if not lost:
            lost.append(True)
            raise TimeoutError("the engine's answer to resume was lost")

    victim.resume = resume_once_lost  # type: ignore[method-assign]
    outcome, other_versions = sync_beside_another_trainer(daemon, rs, 32, 99)
    assert lost and other_versions == [3], (lost, other_versions)
    assert not outcome.ok and outcome.error is not None, outcome
    assert "another trainer" in outcome.error and "job token" in outcome.error and "v3" in outcome.error, outcome.error
    for r in rs:  # what the other trainer pushed stays, untouched by the refused retry
        assert_holds(r, weights(99), 3)


def test_a_retry_after_a_failed_validate_does_not_take_another_trainers_version_as_its_own(daemon: WeightSyncDaemon, receivers: Engines) -> None:
    """An attempt that failed before any engine could stamp its version (here: a lost answer to
    validate) grants its retry no catch-up: when another trainer on the same token synced that very
    version meanwhile, the retry is refused, not stamped a second time over other weights (two
    trainers both reported v2 ok, the engines serving one of them)."""
    rs, victim = synced_pair(daemon, receivers, 41)
    real_validate = victim.validate
    lost: list[bool] = []

    def validate_once_lost(*args: Any, **kwargs: Any) -> Any:
        if not lost:
            lost.append(True)
            raise TimeoutError("the engine's answer to validate was lost")
        return real_validate(*args, **kwargs)

    victim.validate = validate_once_lost  # type: ignore[method-assign]
    outcome, other_versions = sync_beside_another_trainer(daemon, rs, 42, 98)
    assert lost and other_versions == [2], (lost, other_versions)
    assert outcome.attempts[0]["stage"] == "validate", outcome.attempts
    assert not outcome.ok and outcome.error is not None and "another trainer" in outcome.error, outcome
    for r in rs:  # the other trainer's v2 stays: one version, one set of weights
        assert_holds(r, weights(98), 2)


def test_a_reported_failure_of_an_engines_earlier_process_keeps_its_new_registration(receivers: Engines) -> None:
    """A trainer's report (`report_sync`) names an engine that failed in its sync; the engine had
    restarted and registered again meanwhile (another address). The standalone daemon keeps the new
    registration, pending its seed, and applies the report only to the engine the sync drove (it
    dropped the new registration by name, so an engine registered once vanished from the job)."""
    daemon = WeightSyncDaemon(config(), DaemonConfig(heartbeat_timeout_s=0, health_interval_s=0.5), token=JOB_TOKEN, role="standalone")
    old, new = receivers.spawn("r0-old"), receivers.spawn("r0-new")
    try:
        daemon.register("r0", descriptor(old))
        drove = {"r0": descriptor(old)}
        daemon.register("r0", descriptor(new))  # restarted elsewhere while the trainer's sync ran
        report = {"version": 1, "ok": False, "engines": {}, "states": {"r0": "stale"}, "dropped": {"r0": "died during transfer"},
                  "stale": [], "descriptors": drove}
        daemon.record_sync(report)
        rec = daemon.membership.get("r0")
        assert rec is not None and rec.engine == descriptor(new) and rec.state == EngineState.PENDING, rec
        daemon.record_sync({**report, "descriptors": {"r0": descriptor(new)}})  # the engine it drove: taken as reported
        assert daemon.membership.get("r0") is None
        with pytest.raises(ProtocolError, match=r"outcome\.descriptors must map engine names"):
            check_outcome({**report, "descriptors": ["r0"]})
    finally:
        daemon.close()
