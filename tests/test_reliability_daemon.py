"""The daemon under misuse and faults (issue 10): misowned engines, a failing source, a trainer
killed mid-sync, out-of-range versions.

Real reference receiver processes, real sockets, real gloo groups; each test fails on the code
before the fix (the engine accepted two groups, the daemon dropped healthy engines and blamed
them, status said `serving` for paused stale engines, 2**64-1 was accepted as a version).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckpt_engine.control.wire import RpcError
from ckpt_engine.daemon import DaemonClient, DaemonConfig, EngineState, WeightSyncDaemon
from ckpt_engine.rollout_adapters.torch_ref import TorchRefRollout
from ckpt_engine.sources.base import StateDictSource
from helpers_daemon import NUM_TENSORS, TIMEOUT_S, Engines, config, descriptor, holds, start_serve, weights, write_spec
from helpers_wait import wait_for
from refengines import BrokenSource
from helpers_procs import fork_program

pytestmark = pytest.mark.timeout(180)

WAIT_S = 120.0
"""Bound of a wait for something that surely comes (a liveness check, not a speed claim)."""
TOKEN = "reliability-job-token"


@pytest.fixture(scope="module")
def spec_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_spec(tmp_path_factory.mktemp("reliability") / "spec.msgpack")


@pytest.fixture
def engines(spec_file: str) -> Iterator[Engines]:
    made = Engines(spec_file, TOKEN)
    yield made
    made.close()


# --- item 2: one engine, one weight-sync job (issue 26: a daemon of the same job takes over) ----
def test_an_engine_belongs_to_one_job(engines: Engines) -> None:
    a = WeightSyncDaemon(config(), DaemonConfig(heartbeat_timeout_s=0), token=TOKEN)
    b = WeightSyncDaemon(config(), DaemonConfig(heartbeat_timeout_s=0), token=TOKEN)  # the same job (a restarted daemon)
    other_job = WeightSyncDaemon(config(), DaemonConfig(heartbeat_timeout_s=0))
    try:
        assert a.group == b.group != other_job.group, "the claim names the job"
        e = engines.spawn("e")
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
        wait_for("the leave released the engine", lambda: not e.health()["owned"], WAIT_S)
        b.register("e", descriptor(e))  # the same job's daemon takes it at once, and carries on from v1
        sd2 = weights(2)
        with pytest.raises(ValueError, match="version 1 is what 'e' already hold, and this daemon did not send it"):
            b.sync(StateDictSource(sd2), version=1)
        assert b.sync(StateDictSource(sd2), version=2).ok and holds(e, sd2, 2)
    finally:
        for d in (a, b, other_job):
            d.close()


def test_a_foreign_claim_lapses_when_its_group_goes_silent(engines: Engines) -> None:
    live = WeightSyncDaemon(config(), DaemonConfig(heartbeat_timeout_s=0), token=TOKEN)
    try:
        e = engines.spawn("e")
        foreign = TorchRefRollout("e", e.rpc.host, e.rpc.port, None, TIMEOUT_S, token=TOKEN)
        foreign.claim("another-group", 120.0)  # held past any box's pace while the refusal is asked
        with pytest.raises(ValueError, match="belongs to another weight-sync group"):
            live.register("e", descriptor(e))
        foreign.claim("another-group", 1.0)  # renewed short, then never heard from again
        foreign.close()

        def registered() -> bool:
            try:
                live.register("e", descriptor(e))
            except ValueError as exc:  # still within the 1 s lease
                assert "belongs to another weight-sync group" in str(exc), exc
                return False
            return True

        wait_for("the silent group's claim lapsed", registered, WAIT_S)  # a liveness bound: it lapses 1 s after the renewal
        sd = weights(3)
        assert live.sync(StateDictSource(sd)).ok and holds(e, sd, 1)
    finally:
        live.close()


# --- item 3: a failing weight source is the source's fault -------------------------------------
LONG_TIMEOUT_S = 120.0
"""The collective timeout where a wait of it must be told apart from an end at once: by a bound of
half of it, far past any normal run on a slow box."""


def test_a_failing_source_is_named_and_healthy_engines_stay(engines: Engines) -> None:
    d = WeightSyncDaemon(config(LONG_TIMEOUT_S), DaemonConfig(heartbeat_timeout_s=0), token=TOKEN)
    try:
        rs = [engines.spawn(f"r{i}") for i in range(2)]
        for r in rs:
            d.register(r.name, descriptor(r))
        sd1 = weights(1)
        assert d.sync(StateDictSource(sd1)).ok

        t0 = time.monotonic()
        outcome = d.sync(BrokenSource(weights(2), fail_after=3, error=OSError("shard 3 of the checkpoint is unreadable")))
        assert time.monotonic() - t0 < LONG_TIMEOUT_S / 2  # the engines' receives ended with the sender's, not at their timeout
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
def trainer_main(argv: list[str]) -> None:
    """A trainer process following `serve` (address, token): one sync of version 2's weights."""
    d = WeightSyncDaemon(config(), upstream=DaemonClient(argv[0], argv[1], 10))
    d.sync(StateDictSource(weights(7)))


def test_status_is_truthful_after_a_trainer_dies_mid_sync(tmp_path: Path, engines: Engines) -> None:
    serve = start_serve(tmp_path, TOKEN)
    address = serve.address
    trainer: WeightSyncDaemon | None = None
    try:
        client = DaemonClient(address, TOKEN, timeout_s=10)
        rs = [engines.spawn(f"r{i}", load_delay_s=0.3) for i in range(2)]
        for r in rs:
            client.register(r.name, descriptor(r))
        trainer = WeightSyncDaemon(config(), upstream=DaemonClient(address, TOKEN, timeout_s=10))
        sd1 = weights(1)
        assert trainer.sync(StateDictSource(sd1)).ok
        wait_for("status says serving v1", lambda: {(e["state"], e["version"]) for e in client.status()["engines"]} == {("serving", 1)}, WAIT_S)

        # A trainer process starts v2 and is killed once the engines hold part of it.
        crashing = fork_program("test_reliability_daemon:trainer_main", [address, TOKEN], "trainer", stderr_path=os.devnull).process
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
            WAIT_S,
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

        wait_for("the killed sync's receives ended", lambda: not any(r.health()["receiving"] for r in rs), WAIT_S)
        sd3 = weights(3)
        outcome = trainer.sync(StateDictSource(sd3))
        assert outcome.ok and outcome.version == 2, outcome
        for r in rs:
            assert holds(r, sd3, 2)
        wait_for("status says serving v2", lambda: {(e["state"], e["version"]) for e in client.status()["engines"]} == {("serving", 2)}, WAIT_S)
        client.close()
    finally:
        if trainer is not None:
            trainer.close()
        serve.stop()


# --- item 8: versions are checked where they enter (and issue 26: no report freezes them) -------
def test_versions_are_bounded_and_monotone_at_the_edges(engines: Engines) -> None:
    standalone = WeightSyncDaemon(config(), DaemonConfig(heartbeat_timeout_s=0), token=TOKEN, role="standalone")
    standalone.serve()
    trainer: WeightSyncDaemon | None = None
    try:
        client = DaemonClient(standalone.address, TOKEN, timeout_s=10)
        r = engines.spawn("r0")
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
        # A token holder cannot freeze the job's versions: no report jumps to 2**63-1 or more
        # than 2**32 ahead (issue 26); the trainer's next sync carries on from 5.
        for bad in (2**63 - 1, 5 + 2**32 + 1):
            freeze = {**huge, "version": bad, "engines": {"r0": bad}}
            with pytest.raises(RpcError, match=r"jumps more than 2\*\*32 past the current version"):
                client.report_sync(freeze)
            with pytest.raises(RpcError, match=r"jumps more than 2\*\*32 past the current version"):
                client.begin_sync(bad)  # nor a version a trainer says it begins
        with pytest.raises(RpcError, match="version 4 is older than the current version 5"):
            client.begin_sync(4)
        with pytest.raises(RpcError, match=r"version must be an int in \[0, 2\*\*63-1\]"):
            client.begin_sync(2**64 - 1)
        assert client.status()["version"] == 5
        sd = weights(3)
        outcome = trainer.sync(StateDictSource(sd))
        assert outcome.ok and outcome.version == 6 and holds(r, sd, 6), outcome

        # The engine refuses versions outside the range, and versions below the one it holds.
        owner = TorchRefRollout("r0", r.rpc.host, r.rpc.port, None, TIMEOUT_S, token=TOKEN)
        owner.owner = client.hello()["group"]
        for bad in (2**63, -1, 4):
            with pytest.raises(RpcError, match=r"finalize version must be an int in \[6, 2\*\*63-1\]"):
                owner.finalize(bad)
        owner.close()
        assert r.health()["version"] == 6
        client.close()
    finally:
        if trainer is not None:
            trainer.close()
        standalone.close()
