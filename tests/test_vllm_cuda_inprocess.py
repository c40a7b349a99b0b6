"""Colocated syncs into a CUDA vLLM engine whose engine core runs in the trainer's own process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`, as hybrid-engine trainers run vLLM beside their model).

CUDA IPC cannot open a handle in the process that made it: there the colocated join failed with
"CUDA error: invalid device context" (one H200, vLLM 0.26) until the receiver learnt to take the
sender's own buffers and tensors (`transports/shared_tensors.py`). After a sync the engine holds,
by sha256 of every parameter in vLLM's layout and in greedy tokens, what an engine that loaded the
same weights from disk holds; every sync's installed weights checked against the source. Run on
the GPU machine (`bench/gpu_runs.sh vllm-one`), never in CI.
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
from ckpt_engine.sync.api import close_sessions, sync_rollout_weights  # noqa: E402
from test_vllm_cuda import ENGINE, REFERENCE_SEED, assert_holds_reference, hf_model, model_dir, reference, source  # noqa: E402, F401
from helpers_vllm_cuda import digests  # noqa: E402
from helpers_vllm import inprocess_llm  # noqa: E402


@pytest.fixture(scope="module")
def inprocess_engine(model_dir: Path, reference: Any) -> Iterator[Any]:  # noqa: F811 - the imported fixtures
    llm = inprocess_llm(model=str(model_dir), load_format="dummy", skip_tokenizer_init=True, worker_extension_cls=WORKER_EXTENSION, **ENGINE)
    yield llm
    close_sessions()
    llm.llm_engine.engine_core.shutdown()


def test_colocated_into_an_engine_core_in_this_process(inprocess_engine: Any, model_dir: Path, reference: Any) -> None:  # noqa: F811
    assert type(inprocess_engine.llm_engine.engine_core).__name__ == "InprocClient"
    handle = VllmRollout("vllm-inprocess", inprocess_engine, timeout_s=60.0)
    config = CheckpointEngineConfig(backend="colocated", timeout_s=60.0, stage="off", verify_installed=1)
    other = hf_model(model_dir, 5, "cuda:0")
    sync_rollout_weights(source(other), [handle], config=config)
    trainer = hf_model(model_dir, REFERENCE_SEED, "cuda:0")
    for _ in range(2):  # the second: the same tensors offered again, the engine's mappings kept
        report = sync_rollout_weights(source(trainer), [handle], config=config)
        assert report is not None and "installed_check" in report.seconds
        assert_holds_reference(inprocess_engine, reference)
    # The trainer's steps write its tensors in place: each next sync replays the last one's walk (the
    # same memory, the same offer) and the worker its kept copies; each must land the new bytes.
    held = {n: t.clone() for n, t in trainer.state_dict().items()}
    with torch.no_grad():
        for n, t in trainer.state_dict().items():
            t.copy_(other.state_dict()[n])
    report = sync_rollout_weights(source(trainer), [handle], config=config)  # checked: the engine's digests equal the source's
    assert report is not None and "installed_check" in report.seconds and report.receivers[handle.name]["direct_tensors"] > 0
    assert digests(inprocess_engine) != reference[0]
    with torch.no_grad():
        for n, t in trainer.state_dict().items():
            t.copy_(held[n])
    sync_rollout_weights(source(trainer), [handle], config=config)
    assert_holds_reference(inprocess_engine, reference)
    # A walk that moved (another model's tensors): the last walk's tensors are offered and copied before
    # the sender reads this one, then the new ones (the worker is handed every tensor twice); unchecked
    # and checked (the worker's fold launched again behind the second pass), the engine holds exactly the new weights.
    for verify in ("off", 1):
        moved = CheckpointEngineConfig(backend="colocated", timeout_s=60.0, stage="off", verify_installed=verify)
        sync_rollout_weights(source(other), [handle], config=moved)
        report = sync_rollout_weights(source(trainer), [handle], config=moved)
        assert report is not None and report.receivers[handle.name]["loaded"] >= 2 * report.tensors, report.receivers[handle.name]
        assert ("installed_check" in report.seconds) == (verify == 1)
        assert_holds_reference(inprocess_engine, reference)
