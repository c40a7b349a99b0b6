"""A handle made while another thread's `generate` is inside a step of an in-process vLLM engine core
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`): its first pause still waits for that step.

Every step of such an engine core holds the core's step lock (`vllm/engine_core.py`), so that a
sync's pause lands between steps. The lock used to be put on the core's steps by its first handle; a
step already running then held nothing, and the first pause went through while its forward ran.
ckpt-engine's vLLM plugin (`vllm/plugin.py`, loaded by vLLM as the core is made) now puts it there
from the core's first step. This file's engine is its own: no handle was made for it before the
test's, which the test makes while the step is held."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

import _vllm_stall_ext as stall  # noqa: E402
from ckpt_engine.rollout_adapters.vllm.clients import LLMWeightSyncClient  # noqa: E402
from helpers_vllm import ENGINE_ARGS, inprocess_llm, stop_llm  # noqa: E402
from test_installed_checks_vllm import QWEN2  # noqa: E402
from test_vllm_inproc_core import HOLD_S, assert_call_waits_for_the_running_step  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def fresh_llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    d: Path = tmp_path_factory.mktemp("qwen2-first-handle")
    (d / "config.json").write_text(json.dumps(QWEN2))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    engine = inprocess_llm(
        model=str(d), load_format="dummy", skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
        worker_extension_cls=stall.EXTENSION, **ENGINE_ARGS,
    )
    yield engine
    stop_llm(engine)


def test_a_handle_made_during_a_step_pauses_only_after_it(fresh_llm: Any) -> None:
    assert_call_waits_for_the_running_step(fresh_llm, "pause", lambda: LLMWeightSyncClient(fresh_llm, timeout=HOLD_S))
