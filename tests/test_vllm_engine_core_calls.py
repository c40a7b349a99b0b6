"""Issue 39: `LLMWeightSyncClient`'s engine-core calls through vLLM's `SyncMPClient` (the engine core in
its own process), sent from the calling thread and waited on through vLLM's own answer future, when
the engine core is stuck: a worker method stalled inside `pause_scheduler` (tests/_vllm_stall_ext.py;
it waits `HOLD_S` in the engine core's process, then goes on).

- A waited call ends within the client's timeout in the same `TimeoutError` as every other call;
  its answer, arriving late, is still taken by vLLM (a future dropped from `utility_results` while
  the engine core lives would kill vLLM's output thread on that answer), and the engine serves on.
- A sync's unwaited version stamp and resume that do not answer within the timeout are raised at the
  client's next call, naming the call and the engine.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from ckpt_engine.rollout_adapters.vllm.clients import LLMWeightSyncClient  # noqa: E402
from shared_server import SharedServer  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

BOUND_S = 2.0
"""The stuck client's timeout."""
HOLD_S = 8.0
"""How long the stalled worker method holds the engine core (past BOUND_S + its grace second)."""


@pytest.fixture(scope="module")
def llm(qwen2_llm: SharedServer[Any]) -> Iterator[Any]:
    """The session's shared `LLM` over QWEN2 (tests/conftest.py; its extension is
    tests/_vllm_stall_ext.py's), its engine core in its own process. Each case leaves it serving,
    unpaused, with no stall pending (a planted stall ends after HOLD_S) and its version label back."""
    engine = qwen2_llm.get()
    assert type(engine.llm_engine.engine_core).__name__ == "SyncMPClient"
    yield engine


def _stall_next_pause(llm: Any) -> None:
    """vLLM's engine core calls `synchronize_device` inside `pause_scheduler`: the next pause holds
    the engine core `HOLD_S`, then completes."""
    llm.collective_rpc("test_stall", kwargs={"method": "synchronize_device", "hold_s": HOLD_S})


def _serves(llm: Any) -> bool:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    out = llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
    return len(out[0].outputs[0].token_ids) == 2


def test_a_stuck_engine_core_call_times_out_and_its_late_answer_is_taken(llm: Any) -> None:
    stuck = LLMWeightSyncClient(llm, timeout=BOUND_S, name="stuck")
    _stall_next_pause(llm)
    with pytest.raises(TimeoutError, match=re.escape("vLLM engine stuck: pause_scheduler did not answer within 2s (a stuck engine core or worker?)")):
        stuck.pause("keep")
    # a patient client's resume queues behind the stalled pause: answered once the pause ended, whose
    # late answer vLLM's output thread took first (the engine core answers in order)
    LLMWeightSyncClient(llm, timeout=60.0).resume()
    assert llm.llm_engine.engine_core.utility_results == {}
    assert not llm.llm_engine.engine_core.call_utility("is_scheduler_paused") and _serves(llm)


def test_an_unwaited_stamp_and_resume_that_never_answer_are_raised_at_the_next_call(llm: Any) -> None:
    stuck = LLMWeightSyncClient(llm, timeout=BOUND_S, name="stuck")
    if not stuck.features.engine_weight_versions:
        pytest.skip("this vLLM keeps no engine weight version: the sync's stamp is no engine-core call (vllm/compat.py)")
    other = LLMWeightSyncClient(llm, timeout=60.0)
    label = other.weight_version()  # the shared engine's, put back at the end
    _stall_next_pause(llm)
    other._send_unwaited("pause_scheduler", "keep", False)  # holds the engine core HOLD_S
    stuck.set_weight_version("7")  # a sync's end: both sent unwaited, queued behind the pause
    stuck.resume()
    with pytest.raises(TimeoutError, match=re.escape("vLLM engine stuck: set_weight_version, sent unwaited at the end of a sync, did not answer within 2s")):
        stuck.health()
    stuck.health()  # raised once
    other.health()  # waits for the pause it sent: the stall ended, and with it the stamp and resume
    assert stuck.weight_version() == "7" and not llm.llm_engine.engine_core.call_utility("is_scheduler_paused") and _serves(llm)
    other.set_weight_version(label)
