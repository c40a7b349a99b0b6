"""Adapter-only syncs into SGLang through a PEFT folder and `/load_lora_adapter` (no pickle).

Against `tests/sglang_standin.py`, which checks every body against SGLang 0.5.23's own request
classes (`tests/sglang_schema.py`) and reads the folder with PEFT's own loader: each version is
served under its name with tokens equal to HF with that adapter merged (fp32: exact), and the
bytes SGLang read equal the trainer's; at most `max_adapter_versions` are loaded; unloading a
version waits for the request still using it, which finishes under it; a rank above the server's
max is refused by name before a byte moves, and nothing is written.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("requests")
pytest.importorskip("msgspec")

from ckpt_engine import CheckpointEngineConfig, WeightSyncSession  # noqa: E402
from ckpt_engine.rollout_adapters.base import ManifestRejectedError  # noqa: E402
from ckpt_engine.sources.adapters import AdapterSource  # noqa: E402
from sglang_schema import check_body  # noqa: E402
from helpers_sglang import standin, write_model_dir  # noqa: E402
from helpers_wait import wait_for  # noqa: E402
from test_sglang_adapter import PROMPT  # noqa: E402

LORA = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj", "down_proj"]}
TIMEOUT_S = 60.0


def test_lora_bodies_are_sglangs_own() -> None:
    from ckpt_engine.rollout_adapters.sglang import SglangClient

    sent: list[tuple[str, Any]] = []

    class Recording(SglangClient):
        def _call(self, method: str, path: str, body: Any = None, timeout_s: float | None = None, probe: bool = False) -> Any:
            sent.append((path, body))
            return {"success": True}

    client = Recording("sglang-0", "http://127.0.0.1:1")
    client.load_lora_adapter("sglang-0-v3", "/shared/adapters/sglang-0-v3")
    client.load_lora_adapter("sglang-0-v4", "/shared/adapters/sglang-0-v4", pinned=True)
    client.unload_lora_adapter("sglang-0-v3")
    assert [p for p, _ in sent] == ["/load_lora_adapter", "/load_lora_adapter", "/unload_lora_adapter"]
    for path, body in sent:
        check_body(path, body)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("qwen2-sglang-lora"))


@pytest.fixture(scope="module")
def client(model_dir: Path) -> Iterator[object]:
    from ckpt_engine.rollout_adapters.sglang import SglangClient

    with standin(model_dir) as (_proc, url):
        c = SglangClient("sglang-lora", url, timeout_s=TIMEOUT_S)
        try:
            yield c
        finally:
            c.close()


def base_model(model_dir: Path) -> torch.nn.Module:
    """The stand-in's base: its HF model from the config under seed 0."""
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(model_dir), dtype=torch.float32).eval()


def adapter(model_dir: Path, seed: int, lora: dict | None = None) -> torch.nn.Module:
    model = peft.get_peft_model(base_model(model_dir), peft.LoraConfig(**(lora if lora is not None else LORA)))
    torch.manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    return model


@torch.no_grad()
def merged_greedy(model: torch.nn.Module, n: int = 8) -> list[int]:
    import copy

    merged = copy.deepcopy(model).merge_and_unload().eval()
    ids, out = torch.tensor([PROMPT]), []
    for _ in range(n):
        nxt = int(merged(ids).logits[0, -1].argmax())
        out.append(nxt)
        ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


def generate(client: Any, lora: str, n: int = 8) -> list[int]:
    return client._call("POST", "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": n}, "lora_path": lora})["output_ids"]


def test_adapter_versions_load_from_peft_folders_and_unload_after_their_last_request(client: Any, model_dir: Path, tmp_path: Path) -> None:
    from ckpt_engine.rollout_adapters.sglang.lora import SglangLoraRollout

    rollout = SglangLoraRollout(client, adapter_dir=tmp_path, max_lora_rank=8, lora_target_modules=LORA["target_modules"], max_adapter_versions=2)
    session = WeightSyncSession([rollout], CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.05, timeout_s=TIMEOUT_S, weights="adapters"))
    try:
        models = [adapter(model_dir, seed) for seed in (5, 6, 7)]
        names = []
        for model in models[:2]:
            session.sync(AdapterSource(model))
            names.append(rollout.lora_name())
            assert generate(client, names[-1]) == merged_greedy(model)
            sums = {n: float(t.double().sum()) for n, t in AdapterSource(model).iter_weights() if n != "adapter_config.json"}
            assert client._call("GET", "/lora_adapters")[names[-1]] == sums  # the bytes SGLang read are the trainer's
        assert sorted(client._call("GET", "/lora_adapters")) == sorted(names)
        assert generate(client, names[0]) == merged_greedy(models[0]), "the previous version, still loaded, changed"

        # A rank the server cannot serve: refused by name, nothing written, the newest still serves.
        with pytest.raises(ManifestRejectedError, match=r"LoRA rank 16 exceeds the engine's max_lora_rank 8"):
            session.sync(AdapterSource(adapter(model_dir, 8, {"r": 16, "lora_alpha": 16, "target_modules": ["q_proj"]})))
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names)
        assert rollout.lora_name() == names[1]

        # A request under the oldest version is in flight (held by a pause) when the third sync
        # must unload that version: the sync waits for it, and it finishes under its version.
        client.pause_generation("in_place")
        held: list[list[int]] = []
        request = threading.Thread(target=lambda: held.append(generate(client, names[0])), daemon=True)
        request.start()
        # In the server (SGLang's /get_load counts it) before the sync that must wait for it starts.
        wait_for("the request under the oldest version reached the server", lambda: client._call("GET", "/get_load")[0]["num_reqs"] == 1, 30)
        sync = threading.Thread(target=session.sync, args=(AdapterSource(models[2]),), daemon=True)
        sync.start()
        sync.join(1.0)
        assert sync.is_alive(), "the unload did not wait for the request using the version"
        client.continue_generation()
        sync.join(TIMEOUT_S)
        request.join(TIMEOUT_S)
        assert not sync.is_alive() and held == [merged_greedy(models[0])]
        names.append(rollout.lora_name())
        assert sorted(client._call("GET", "/lora_adapters")) == sorted(names[1:])
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[1:])
        assert generate(client, names[2]) == merged_greedy(models[2])
    finally:
        session.close()
