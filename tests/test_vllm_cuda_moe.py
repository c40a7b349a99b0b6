"""A tiny Qwen3-MoE CUDA vLLM engine fed on its own GPU (colocated): routed experts load straight
into vLLM's fused expert weights, with no layerwise reload, when vLLM runs them on its Triton
kernels (`vllm/reload.py` `loads_in_place`).

Under layerwise reload a 30B-A3B sync ran the engine out of memory (2×H200, vLLM 0.26). In place,
after each sync (unstaged and staged, installed check on), the engine must hold, by sha256 of every
parameter in vLLM's fused layout and in greedy tokens, what an engine that loaded the same weights
from disk holds. Run on the GPU machine (`bench/gpu_runs.sh vllm-one`), never in CI.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("vllm")

from ckpt_engine import CheckpointEngineConfig  # noqa: E402
from ckpt_engine.rollout_adapters.vllm import WORKER_EXTENSION, VllmRollout  # noqa: E402
from ckpt_engine.sources.base import StateDictSource  # noqa: E402
from ckpt_engine.sync.api import close_sessions, sync_rollout_weights  # noqa: E402
from helpers_vllm_cuda import digests, greedy  # noqa: E402
from test_vllm_cuda import ENGINE, QWEN3_MOE, REFERENCE_SEED, assert_holds_reference, checkpoint_weights, hf_model, write_model  # noqa: E402


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("qwen3-moe-cuda"), QWEN3_MOE, REFERENCE_SEED)


@pytest.fixture(scope="module")
def moe_reference(moe_dir: Path) -> tuple[dict[str, str], list[list[int]]]:
    from vllm import LLM

    llm = LLM(model=str(moe_dir), skip_tokenizer_init=True, worker_extension_cls=WORKER_EXTENSION, **ENGINE)
    try:
        return digests(llm), greedy(llm)
    finally:
        llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def moe_engine(moe_dir: Path, moe_reference: Any) -> Iterator[Any]:
    from vllm import LLM

    llm = LLM(model=str(moe_dir), load_format="dummy", skip_tokenizer_init=True, worker_extension_cls=WORKER_EXTENSION, **ENGINE)
    yield llm
    close_sessions()
    llm.llm_engine.engine_core.shutdown()


@pytest.mark.parametrize("stage", ["off", "full"])
def test_moe_experts_load_in_place_exactly(moe_engine: Any, moe_dir: Path, moe_reference: Any, stage: str) -> None:
    handle = VllmRollout(f"vllm-moe-{stage}", moe_engine, timeout_s=60.0)
    config = CheckpointEngineConfig(backend="colocated", timeout_s=60.0, stage=stage, verify_installed=1)
    other = StateDictSource(checkpoint_weights(hf_model(moe_dir, 5, "cuda:0")))
    sync_rollout_weights(other, [handle], config=config)
    assert digests(moe_engine) != moe_reference[0]
    trainer = StateDictSource(checkpoint_weights(hf_model(moe_dir, REFERENCE_SEED, "cuda:0")))
    report = sync_rollout_weights(trainer, [handle], config=config)
    assert report is not None
    assert_holds_reference(moe_engine, moe_reference)
    if stage == "off":  # the unstaged receive reports how it loaded
        assert report.receivers[handle.name]["loads_in_place"] == 1.0, report.receivers[handle.name]
