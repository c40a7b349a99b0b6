"""Versions never go back through vLLM's own weight-transfer API, whatever drives it (issue 42 item 2):
vLLM's plain `HTTPVLLMWeightSyncClient` has no call that reads the engine's version, so a new trainer
engine (a new session) over a new plain client used to count from 0 and stamp 1 after 5. The channel
now reads the server's `/weight_info` behind vLLM's plain client. Against the session's shared
native-backend api_server (tests/conftest.py), with vLLM's real trainer-side factory and client."""

from __future__ import annotations

from pathlib import Path

import pytest
import requests

from ckpt_engine import CheckpointEngineConfig, ManifestRejectedError, SyncError, WeightSyncSession
from ckpt_engine.sources.base import StateDictSource
from helpers_vllm import VllmServer
from refengines import BrokenSource
from shared_server import SharedServer

pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")

from ckpt_engine.rollout_adapters.vllm.compat import features_of  # noqa: E402

if not features_of().trainer_transfer_api:  # vLLM 0.26 (the GPU machines): no trainer-side ckpt_engine engine there
    pytest.skip(f"vLLM {features_of().version}'s trainer-side weight-transfer API is not 0.32's", allow_module_level=True)

from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory  # noqa: E402
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient  # noqa: E402

from ckpt_engine.rollout_adapters.vllm import VllmRollout, WeightTransferChannel  # noqa: E402
from ckpt_engine.sync.vllm_trainer_engine import CkptEngineTrainerInitInfo  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

CONFIG = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.25, timeout_s=120.0, stage="off")


def held(url: str) -> int:
    """The server's version stamp as vLLM reports it (0 for a fresh engine's "default")."""
    version = str(requests.get(f"{url}/weight_info", timeout=10).json()["weight_version"])
    return int(version) if version.isdigit() else 0


def model(model_dir: Path, seed: int) -> object:
    import torch

    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(model_dir), dtype=torch.float32)


def test_plain_vllm_clients_carry_versions_on(native_vllm_server: SharedServer[VllmServer]) -> None:
    server = native_vllm_server.get()
    base = held(server.url)
    # A trainer engine over vLLM's plain client stamps an explicit version 5 past what the server holds.
    first = WeightTransferTrainerFactory.trainer_init(
        CkptEngineTrainerInitInfo(rank=0, num_workers=1, config=CONFIG, engine_name="plain-1"),
        client=HTTPVLLMWeightSyncClient(server.url, timeout=120), source=ModuleSource(model(server.model_dir, 1)),
    )
    try:
        report = first.send_weights(version=base + 5)
        assert report is not None and report.version == base + 5 and held(server.url) == base + 5
    finally:
        first.shutdown()
    # A new trainer engine, a new plain client: it counts on from the server's version (it stamped 1 here).
    for n in range(2):
        again = WeightTransferTrainerFactory.trainer_init(
            CkptEngineTrainerInitInfo(rank=0, num_workers=1, config=CONFIG, engine_name=f"plain-{n + 2}"),
            client=HTTPVLLMWeightSyncClient(server.url, timeout=120), source=ModuleSource(model(server.model_dir, 2 + n)),
        )
        try:
            report = again.send_weights()
            assert report is not None and report.version == base + 6 + n and held(server.url) == base + 6 + n
        finally:
            again.shutdown()
    # The same through `VllmRollout` over a plain client, and a session of its own.
    handle = VllmRollout("plain-handle", WeightTransferChannel(HTTPVLLMWeightSyncClient(server.url, timeout=120), num_workers=1), timeout_s=120.0)
    session = WeightSyncSession([handle], CONFIG)
    try:
        weights = {n: t.detach() for n, t in model(server.model_dir, 9).state_dict().items() if n != "lm_head.weight"}  # type: ignore[attr-defined]
        assert session.sync(StateDictSource(weights)).version == base + 8 and held(server.url) == base + 8
        # The server's answer reaches the session through vLLM's plain client (it raises a bare HTTP 500): a
        # manifest the workers reject is refused by name, nothing moved.
        bad = {**weights, "model.norm.weight": weights["model.norm.weight"][:-1]}
        with pytest.raises(ManifestRejectedError, match=r"plain-handle.*model\.norm\.weight"):
            session.sync(StateDictSource(bad))
        assert held(server.url) == base + 8
        # A bare client cannot pause the engine: a sync that fails mid-stream says the engine may serve part of it
        # (not "left paused"); the next sync heals it.
        with pytest.raises(SyncError, match=r"not paused while it received \(pause_mode none, or a client that cannot pause\): it may serve part of the new version: plain-handle") as info:
            session.sync(BrokenSource(weights, fail_after=4))
        assert "paused and stale" not in str(info.value), str(info.value)
        assert session.sync(StateDictSource(weights)).version == base + 9 and held(server.url) == base + 9
    finally:
        session.close()


def test_a_native_server_restarted_at_its_url_is_rejoined_and_seeded(native_vllm_server: SharedServer[VllmServer]) -> None:
    """Through vLLM's weight-transfer API no worker says which group it joined; a server restarted at
    its URL is known by its stamp gone back to vLLM's first ("default") under a handle that stamped
    one: the next sync rejoins and seeds it before anything is sent, instead of blaming it mid-sync."""
    from ckpt_engine.rollout_adapters.vllm.clients import HTTPWeightSyncClient

    server = native_vllm_server.get()
    handle = VllmRollout("ours", WeightTransferChannel(HTTPWeightSyncClient(server.url, 120), num_workers=1), timeout_s=120.0)
    session = WeightSyncSession([handle], CONFIG)
    try:
        first = session.sync(StateDictSource(_weights(server.model_dir, 11))).version
        native_vllm_server.discard()  # stopped, and started again at the same URL
        assert native_vllm_server.get().url == server.url and held(server.url) == 0
        assert session.sync(StateDictSource(_weights(server.model_dir, 12))).version == first + 1 == held(server.url)
    finally:
        session.close()


def _weights(model_dir: Path, seed: int) -> dict[str, object]:
    return {n: t.detach() for n, t in model(model_dir, seed).state_dict().items() if n != "lm_head.weight"}  # type: ignore[attr-defined]

