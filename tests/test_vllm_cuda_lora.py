"""LoRA adapter syncs into a real CUDA vLLM engine (vLLM 0.26 carried by bench/vllm_carry.sh; run by
`bench/gpu_runs.sh vllm`, never in CI). One GPU: the trainer's PEFT model beside the engine
(`backend: colocated`), and over NCCL from cuda:1 where a second GPU exists.

What the engine serves under a synced adapter version must be what it serves under the same adapter
loaded by vLLM itself from a PEFT folder (`LoRARequest(path)`): same engine, same kernels, so greedy
tokens are equal exactly when the installed adapter weights are. A second adapter synced in between
must change the tokens (the check can fail), and the previous version keeps serving after a
refused sync.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
vllm = pytest.importorskip("vllm")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from ckpt_engine import CheckpointEngineConfig  # noqa: E402
from ckpt_engine.rollout_adapters.base import ManifestRejectedError  # noqa: E402
from ckpt_engine.rollout_adapters.vllm import WORKER_EXTENSION  # noqa: E402
from ckpt_engine.rollout_adapters.vllm.lora import VllmLoraRollout  # noqa: E402
from ckpt_engine.sources.adapters import AdapterSource  # noqa: E402
from ckpt_engine.sync.api import SyncError, close_sessions, sync_rollout_weights  # noqa: E402

os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
os.environ.setdefault("VLLM_USE_DEEP_GEMM", "0")
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # the trainer uses CUDA in this process

QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 512, "hidden_size": 256,
    "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "initializer_range": 0.2, "bos_token_id": 1, "eos_token_id": 2,
}
LORA = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj", "down_proj"]}
PROMPTS = [[5, 6, 7, 8], [100, 3, 250, 17, 42]]
TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("qwen2-cuda-lora")
    (d / "config.json").write_text(json.dumps(QWEN2))
    torch.manual_seed(0)
    config = transformers.AutoConfig.from_pretrained(d)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(d, safe_serialization=True)
    return d


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> Iterator[Any]:
    from vllm import LLM

    engine = LLM(
        model=str(model_dir), skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16", max_model_len=128,
        max_num_seqs=4, gpu_memory_utilization=0.15, worker_extension_cls=WORKER_EXTENSION,
        enable_lora=True, max_lora_rank=8, max_loras=2, max_cpu_loras=4,
    )
    yield engine
    close_sessions()
    engine.llm_engine.engine_core.shutdown()


def trainer(model_dir: Path, seed: int, device: str) -> torch.nn.Module:
    """The base from disk with a random adapter (`seed`), as a trainer holds it after some steps:
    every lora_A and lora_B drawn (PEFT starts lora_B at zero, an adapter that changes nothing:
    two such adapters serve the base model's tokens, as the first CUDA run of this test found)."""
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    model = peft.get_peft_model(base, peft.LoraConfig(**LORA))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model.to(device)


def greedy(llm: Any, lora: Any) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, lora_request=lora, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def from_disk(llm: Any, model: torch.nn.Module, folder: Path, lora_id: int) -> list[list[int]]:
    """Greedy tokens under the same adapter loaded by vLLM itself from a PEFT folder."""
    from vllm.lora.request import LoRARequest

    model.save_pretrained(folder)
    return greedy(llm, LoRARequest(f"disk-{lora_id}", lora_id, str(folder)))


@pytest.mark.parametrize("backend", ["colocated", "nccl"])
def test_adapter_syncs_serve_what_vllm_serves_from_disk(llm: Any, model_dir: Path, tmp_path: Path, backend: str) -> None:
    if backend == "nccl" and torch.cuda.device_count() < 2:
        pytest.skip("nccl needs the trainer on a second GPU")
    device = "cuda:0" if backend == "colocated" else "cuda:1"
    rollout = VllmLoraRollout(f"lora-{backend}", llm, max_adapter_versions=2, timeout_s=TIMEOUT_S)
    config = CheckpointEngineConfig(backend=backend, timeout_s=TIMEOUT_S, weights="adapters", stage="off")
    seen = []
    for i, seed in enumerate((11, 12)):
        model = trainer(model_dir, seed, device)
        sync_rollout_weights(AdapterSource(model), [rollout], config=config)
        seen.append(greedy(llm, rollout.lora_request()))
        assert seen[-1] == from_disk(llm, model, tmp_path / f"a{seed}", 100 + 10 * i + (backend == "nccl")), \
            f"sync {i + 1} over {backend}: the synced adapter serves other tokens than vLLM's own load of it"
    assert seen[0] != seen[1], "two different adapters served the same tokens: is LoRA applied?"
    # A refused sync (rank above the engine's max_lora_rank) moves nothing: the last version serves.
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    big = peft.get_peft_model(base, peft.LoraConfig(r=16, lora_alpha=16, target_modules=["q_proj"], init_lora_weights="gaussian")).to(device)
    with pytest.raises((ManifestRejectedError, SyncError), match="max_lora_rank"):
        sync_rollout_weights(AdapterSource(big), [rollout], config=config)
    assert greedy(llm, rollout.lora_request()) == seen[1]
