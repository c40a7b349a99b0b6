"""An in-process `vllm.LLM` whose engine core runs in this process too (`VLLM_ENABLE_V1_MULTIPROCESSING=0`,
as hybrid-engine trainers run vLLM), started with ckpt-engine as its weight-transfer backend
(`weight_transfer_config={"backend": "ckpt_engine"}`) and tests/_vllm_stall_ext.py's extension beside
it (only to stall a worker method and to read the backend's worker state).

- `LLMWeightSyncClient` decides by the engine-core client's type how it reaches the engine core, and
  bounds every wait: a worker stuck inside the engine core's pause ends `pause` within the client's
  timeout with a `TimeoutError` naming the engine and the call (it waited for the stall before).
- A pause, or a prefix-cache reset preempting the running requests, made while a step runs on a
  generating thread (vLLM's in-process engine core steps in the thread of whoever generates) returns
  only once that step ended.
- After every sync through vLLM's weight-transfer API (unchecked, checked, staged) the workers report
  the version the engine serves (an unchecked unstaged sync left them at the previous one).
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ckpt_engine import CheckpointEngineConfig, WeightSyncSession
from ckpt_engine.sources.base import StateDictSource

pytest.importorskip("vllm")
pytest.importorskip("transformers")

import _vllm_stall_ext as stall  # noqa: E402
from ckpt_engine.rollout_adapters.vllm import VllmRollout, WeightTransferChannel  # noqa: E402
from ckpt_engine.rollout_adapters.vllm.clients import LLMWeightSyncClient  # noqa: E402
from helpers_vllm import ENGINE_ARGS, inprocess_llm, stop_llm  # noqa: E402
from test_installed_checks_vllm import QWEN2, weights  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

BOUND_S = 2.0
"""The client's timeout in the stall test, which each case's stuck pause waits out (5 s before;
tests/test_vllm_engine_core_calls.py bounds its stuck client the same). Inside it (plus the grace
second) only in-process Python runs: the pause reaching the stalled worker method, and after the
release the same client's resume; milliseconds each, far inside 3 s on a loaded box."""
HOLD_S = 120.0
"""How long the stalled worker method waits unless released (far past BOUND_S: the call that did
not wait the stall out ends within half of it on any box; the test releases it at once after)."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("qwen2-inproc-core")
    (d / "config.json").write_text(json.dumps(QWEN2))
    return d


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> Iterator[Any]:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    engine = inprocess_llm(
        model=str(model_dir), load_format="dummy", skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
        weight_transfer_config={"backend": "ckpt_engine"}, worker_extension_cls=stall.EXTENSION, **ENGINE_ARGS,
    )
    yield engine
    stop_llm(engine)


@pytest.mark.parametrize("rep", range(3))
def test_a_worker_stuck_in_the_engine_cores_pause_ends_the_call_naming_engine_and_call(llm: Any, model_dir: Path, rep: int) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    client = LLMWeightSyncClient(llm, timeout=BOUND_S)  # named by its model
    llm.collective_rpc("test_stall", kwargs={"method": "synchronize_device", "hold_s": HOLD_S})
    t0 = time.monotonic()
    try:
        with pytest.raises(TimeoutError, match=re.escape(f"vLLM engine LLM({model_dir}): pause_scheduler did not answer within 2s")):
            client.pause("keep")
        assert time.monotonic() - t0 < HOLD_S / 2  # it did not wait the stall out
        assert stall.STALLED.is_set()  # the pause was stuck inside the engine core, in the worker
    finally:
        stall.RELEASE.set()
    # vLLM set the pause before it waited for the device: resuming serves again
    client.resume()
    assert not llm.llm_engine.engine_core.engine_core.is_scheduler_paused()
    out = llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


@pytest.mark.parametrize("call", ["pause", "prefix_cache_reset"])
def test_an_in_process_pause_or_reset_waits_for_the_step_a_generating_thread_is_running(llm: Any, call: str) -> None:
    """The step's forward is held inside the worker (`test_stall` on `execute_model`) while another
    thread pauses, or resets the prefix cache preempting the running requests (what a sync does
    after its load): the call returns only after the step was let go. So the copies a sync makes
    after its pause never land between two layers of one step, and a reset never moves requests under
    a step's schedule (before, both returned at once).

    The engine steps on this thread, the one that built it, as a trainer's generation loop does (vLLM's
    CPU attention checks that a step's OpenMP thread count is the one its metadata was built with, which
    a fresh thread need not share); a second thread plays the sync."""
    client = LLMWeightSyncClient(llm, timeout=HOLD_S)
    assert_call_waits_for_the_running_step(llm, call, lambda: client)


def assert_call_waits_for_the_running_step(llm: Any, call: str, client_of: Callable[[], LLMWeightSyncClient]) -> None:
    """Generate on this thread with the step's forward held in the worker; on another thread, once the
    step is held, take the client (`client_of`) and pause or reset: the call must return only after the
    step was let go, and the request must run to its end."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm.collective_rpc("test_stall", kwargs={"method": "execute_model", "hold_s": HOLD_S})
    seen: dict[str, Any] = {}
    clients: list[LLMWeightSyncClient] = []

    def sync_call() -> None:
        client = client_of()
        clients.append(client)
        if call == "pause":
            client.pause("keep")
        else:
            client.reset_prefix_cache(running=True)
        seen.setdefault("returned_at", time.monotonic())

    def sync_thread() -> None:
        try:
            if not stall.STALLED.wait(HOLD_S / 2):
                seen["error"] = "the generating thread's step never reached the model"
                return
            calling = threading.Thread(target=sync_call)
            calling.start()
            calling.join(1.0)  # time for a call that does not wait to return
            seen["released_at"] = time.monotonic()
            stall.RELEASE.set()
            calling.join(HOLD_S / 2)
            seen["paused"] = llm.llm_engine.engine_core.engine_core.is_scheduler_paused()
        finally:
            stall.RELEASE.set()
            if call == "pause" and clients:
                clients[0].resume()  # the frozen request runs to its end

    syncing = threading.Thread(target=sync_thread)
    syncing.start()
    try:
        outputs = llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    finally:
        syncing.join(HOLD_S / 2)
    assert "error" not in seen, seen.get("error")
    assert "returned_at" in seen and seen["returned_at"] > seen["released_at"], f"the {call} returned while a step was still running"
    assert seen["paused"] == (call == "pause") and not syncing.is_alive()
    assert len(outputs[0].outputs[0].token_ids) == 4  # a preempted request is scheduled again and runs to its end


@pytest.mark.parametrize(
    "kw", [{"verify_installed": "off", "stage": "off"}, {"verify_installed": 1, "stage": "off"}, {"verify_installed": "off", "stage": "auto"}],
    ids=["unchecked", "checked", "staged"],
)
def test_after_every_native_sync_the_workers_hold_the_version_the_engine_serves(llm: Any, model_dir: Path, kw: dict[str, Any]) -> None:
    client = LLMWeightSyncClient(llm, timeout=120.0)
    for seed in (1, 2):
        handle = VllmRollout("inproc-native", WeightTransferChannel(client, num_workers=1), timeout_s=120.0)
        session = WeightSyncSession([handle], CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.25, timeout_s=120.0, **kw))
        try:
            report = session.sync(StateDictSource(weights(model_dir, seed)))
        finally:
            session.close()
        assert (report.staged != "off") == (kw["stage"] == "auto"), report.staged
        served = llm.get_weight_version()
        assert served == str(report.version)
        states = llm.collective_rpc("test_native_state", timeout=60)
        assert [s["version"] for s in states] == [served] and not any(s["stale"] for s in states), states


def test_an_in_process_engine_cores_switches_run_on_the_callers_thread_and_a_pause_that_waits_does_not(llm: Any) -> None:
    """The resume and the version stamp only set the engine core's state: they run on the calling
    thread (no pool thread's round trip). vLLM 0.32's pause synchronizes every worker's device, so it
    keeps its bounded call on a pool thread (a stuck worker ends it: the stall test above); 0.26's
    pause only sets the state and runs on the caller's thread too."""
    core = llm.llm_engine.engine_core.engine_core
    client = LLMWeightSyncClient(llm, timeout=60.0)
    seen: dict[str, threading.Thread] = {}
    for name in ("pause_scheduler", "resume_scheduler", "set_weight_version"):
        original = getattr(core, name)

        def recording(*args: Any, _name: str = name, _original: Any = original) -> Any:
            seen[_name] = threading.current_thread()
            return _original(*args)
        setattr(core, name, recording)
    try:
        client.pause("keep")
        assert core.is_scheduler_paused()
        client.set_weight_version("7")
        client.resume()  # the stamp's resume: sent unwaited, which in this process is a call now
        assert not core.is_scheduler_paused() and llm.get_weight_version() == "7"
        client.pause("keep")
        client.resume()  # a resume on its own: waited for
        assert not core.is_scheduler_paused()
    finally:
        for name in ("pause_scheduler", "resume_scheduler", "set_weight_version"):
            delattr(core, name)  # the instance's wrappers go; the class's methods answer again
        client.close()
    me = threading.current_thread()
    assert seen["resume_scheduler"] is me and seen["set_weight_version"] is me
    assert (seen["pause_scheduler"] is me) == (not client.features.pause_reaches_workers)


def test_a_receive_begins_and_ends_on_the_calling_thread_where_the_worker_runs_in_this_process(llm: Any, model_dir: Path) -> None:
    """With vLLM's one-process executor the worker methods that bound their own waits (the validate,
    the receive's begin and end) are called on the thread that asks (the session's), not handed to the client's
    pool thread; the sync completes."""
    worker = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker
    ran: dict[str, str] = {}
    for name in ("ckpt_receive_begin", "ckpt_receive_end", "ckpt_validate"):
        original = getattr(worker, name)

        def recording(*args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
            ran[_name] = threading.current_thread().name
            return _original(*args, **kwargs)
        setattr(worker, name, recording)
    session = WeightSyncSession([VllmRollout("inproc", llm, timeout_s=120.0)], CheckpointEngineConfig(backend="gloo", timeout_s=120.0, delta="off", stage="off", verify_installed="off"))
    try:
        sent = weights(model_dir, 3)
        report = session.sync(StateDictSource(sent))
    finally:
        session.close()
        for name in ("ckpt_receive_begin", "ckpt_receive_end", "ckpt_validate"):
            delattr(worker, name)
    assert report.tensors == len(sent), ran
    assert "ckpt_receive_begin" in ran, ran
    assert not any(thread.startswith("vllm-rpc") for thread in ran.values()), ran
    health = llm.collective_rpc("ckpt_health", timeout=60)
    assert health[0]["version"] == report.version  # the receive ended and finalized
