"""Issue 39: `LLMWeightSyncClient`'s engine-core calls through vLLM's `SyncMPClient` (the engine core in
its own process), sent from the calling thread and waited on through vLLM's own answer future, when
the engine core is stuck: a worker method stalled inside `pause_scheduler` (tests/_vllm_stall_ext.py;
it waits in the worker's process until the test, past the stuck call's bound, creates its release
file, then goes on).

- A waited call ends within the client's timeout in the same `TimeoutError` as every other call;
  its answer, arriving late, is still taken by vLLM (a future dropped from `utility_results` while
  the engine core lives would kill vLLM's output thread on that answer), and the engine serves on.
- A sync's unwaited version stamp and resume that do not answer within the timeout are raised at the
  client's next call, naming the call and the engine.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from ckpt_engine.rollout_adapters.vllm.clients import LLMWeightSyncClient  # noqa: E402
from shared_server import SharedServer  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

BOUND_S = 2.0
"""The stuck client's timeout."""
HOLD_S = 120.0
"""How long the stalled worker method holds the engine core unless released (far past BOUND_S and
its grace second: every case releases it once the stuck call has ended; it held a fixed 8 s before,
waited out whole by each case)."""


@pytest.fixture(scope="module")
def llm(qwen2_llm: SharedServer[Any]) -> Iterator[Any]:
    """The session's shared `LLM` over QWEN2 (tests/conftest.py; its extension is
    tests/_vllm_stall_ext.py's), its engine core in its own process. Each case leaves it serving,
    unpaused, with no stall pending (each case releases the stall it planted) and its version label back."""
    engine = qwen2_llm.get()
    assert type(engine.llm_engine.engine_core).__name__ == "SyncMPClient"
    yield engine


def _stall_next_pause(llm: Any, release: Path) -> None:
    """vLLM's engine core calls `synchronize_device` inside `pause_scheduler`: the next pause holds
    the engine core until `release` exists (at most `HOLD_S`), then completes."""
    release.unlink(missing_ok=True)
    llm.collective_rpc("test_stall", kwargs={"method": "synchronize_device", "hold_s": HOLD_S, "release_file": str(release)})


def _serves(llm: Any) -> bool:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    out = llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
    return len(out[0].outputs[0].token_ids) == 2


def test_a_stuck_engine_core_call_times_out_and_its_late_answer_is_taken(llm: Any, tmp_path: Path) -> None:
    stuck = LLMWeightSyncClient(llm, timeout=BOUND_S, name="stuck")
    release = tmp_path / "release"
    _stall_next_pause(llm, release)
    try:
        with pytest.raises(TimeoutError, match=re.escape("vLLM engine stuck: pause_scheduler did not answer within 2s (a stuck engine core or worker?)")):
            stuck.pause("keep")
    finally:
        release.touch()  # the stalled pause goes on now, past the call's bound: its answer comes late
    # a patient client's resume queues behind the stalled pause: answered once the pause ended, whose
    # late answer vLLM's output thread took first (the engine core answers in order)
    LLMWeightSyncClient(llm, timeout=60.0).resume()
    assert llm.llm_engine.engine_core.utility_results == {}
    assert not llm.llm_engine.engine_core.call_utility("is_scheduler_paused") and _serves(llm)


def test_an_unwaited_stamp_and_resume_that_never_answer_are_raised_at_the_next_call(llm: Any, tmp_path: Path) -> None:
    stuck = LLMWeightSyncClient(llm, timeout=BOUND_S, name="stuck")
    if not stuck.features.engine_weight_versions:
        pytest.skip("this vLLM keeps no engine weight version: the sync's stamp is no engine-core call (vllm/compat.py)")
    other = LLMWeightSyncClient(llm, timeout=60.0)
    label = other.weight_version()  # the shared engine's, put back at the end
    release = tmp_path / "release"
    _stall_next_pause(llm, release)
    try:
        other._send_unwaited("pause_scheduler", "keep", False)  # holds the engine core until released
        stuck.set_weight_version("7")  # a sync's end: both sent unwaited, queued behind the pause
        stuck.resume()
        with pytest.raises(TimeoutError, match=re.escape("vLLM engine stuck: set_weight_version, sent unwaited at the end of a sync, did not answer within 2s")):
            stuck.health()
        stuck.health()  # raised once
    finally:
        release.touch()
    other.health()  # waits for the pause it sent: the stall ended, and with it the stamp and resume
    assert stuck.weight_version() == "7" and not llm.llm_engine.engine_core.call_utility("is_scheduler_paused") and _serves(llm)
    other.set_weight_version(label)
