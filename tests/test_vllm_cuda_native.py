"""ckpt-engine as vLLM's own weight-transfer backend on CUDA, on the vLLM release the GPU machines
run (0.26, whose API differences live in `rollout_adapters/vllm/compat.py`; 0.32 runs it too).

An in-process `LLM(..., load_format="dummy", weight_transfer_config={"backend": "ckpt_engine"})` on
GPU 0, fed by an HF trainer on the same GPU (backend `colocated`: CUDA IPC), through `VllmRollout`
over a `WeightTransferChannel`: the trainer reaches the workers only through vLLM's weight-update
calls. The worker extension is loaded only so that the test can read every parameter's sha256
(`ckpt_param_digests`); the syncs never use it. After each sync the engine holds, by sha256 of
every parameter in vLLM's layout and in greedy tokens, what an engine that loaded the same weights
from disk holds. Run on the GPU machine, never in CI.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("vllm")

from ckpt_engine import CheckpointEngineConfig, WeightSyncSession  # noqa: E402
from ckpt_engine.rollout_adapters.vllm import WORKER_EXTENSION, VllmRollout, WeightTransferChannel  # noqa: E402
from ckpt_engine.rollout_adapters.vllm.clients import LLMWeightSyncClient  # noqa: E402
from ckpt_engine.rollout_adapters.vllm.compat import features_of  # noqa: E402
from helpers_vllm_cuda import digests  # noqa: E402
from test_vllm_cuda import ENGINE, REFERENCE_SEED, assert_holds_reference, hf_model, model_dir, reference, source  # noqa: E402, F401

TIMEOUT_S = 60.0


def test_the_trainer_engine_refuses_a_vllm_whose_trainer_api_differs() -> None:
    """On 0.26 ckpt-engine's trainer-side engine (written to 0.32's API) refuses to import with the
    version and the route that works there, instead of a TypeError from vLLM's generics."""
    if features_of().trainer_transfer_api:
        pytest.skip(f"vLLM {features_of().version} has the trainer API the engine implements")
    with pytest.raises(ImportError, match=r"vLLM 0\.26\.\d+ has another .*WeightTransferChannel\(client\)"):
        importlib.import_module("ckpt_engine.sync.vllm_trainer_engine")


@pytest.fixture(scope="module")
def native_engine(model_dir: Path, reference: Any) -> Iterator[Any]:  # noqa: F811 - the imported fixtures
    from vllm import LLM

    llm = LLM(
        model=str(model_dir), load_format="dummy", skip_tokenizer_init=True, worker_extension_cls=WORKER_EXTENSION,
        weight_transfer_config={"backend": "ckpt_engine"}, **ENGINE,
    )
    yield llm
    llm.llm_engine.engine_core.shutdown()


def handle_on(llm: Any) -> VllmRollout:
    return VllmRollout("vllm-native", WeightTransferChannel(LLMWeightSyncClient(llm, timeout=TIMEOUT_S)), timeout_s=TIMEOUT_S)


def test_colocated_through_vllms_weight_transfer_api(native_engine: Any, model_dir: Path, reference: Any) -> None:  # noqa: F811
    """Away to other weights, back to the reference (unstaged, its installed weights checked), then
    away and back again staged; closed, a new session joins the same workers and syncs again."""
    features = features_of()
    handle = handle_on(native_engine)
    session = WeightSyncSession([handle], CheckpointEngineConfig(backend="colocated", timeout_s=TIMEOUT_S, stage="off", verify_installed=1))
    other = hf_model(model_dir, 5, "cuda:0")
    trainer = hf_model(model_dir, REFERENCE_SEED, "cuda:0")
    try:
        first = session.sync(source(other))
        assert digests(native_engine) != reference[0]
        back = session.sync(source(trainer))
        assert back.version == first.version + 1 and "installed_check" in back.seconds
        assert_holds_reference(native_engine, reference)
        if features.engine_weight_versions:  # 0.32 stamps the engine; 0.26 keeps no version there
            assert native_engine.get_weight_version() == str(back.version)
        else:
            assert handle.held_version() is None  # the workers hold it; nothing reads it back through vLLM's calls
    finally:
        session.close()  # 0.26: the workers leave the group in an update of their own (phase `leave`)

    staged = WeightSyncSession([handle_on(native_engine)], CheckpointEngineConfig(backend="colocated", timeout_s=TIMEOUT_S, stage="full"))
    try:
        away = staged.sync(source(other))
        assert away.staged == "full" and digests(native_engine) != reference[0]
        staged.sync(source(trainer))
        assert_holds_reference(native_engine, reference)
    finally:
        staged.close()
