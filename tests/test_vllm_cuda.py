"""A real CUDA vLLM engine fed by a trainer on the GPUs (vLLM 0.26 carried by bench/vllm_carry.sh;
run by `bench/gpu_runs.sh vllm`, never in CI).

One engine (in process, GPU 0, dummy weights) takes every sync; a second engine that loaded the
reference weights from disk gives what the first must hold after each sync: every parameter and
buffer equal by digest (`ckpt_param_digests`, vLLM's own fused / sliced layout), and greedy tokens
equal. The trainer is an HF model in this process, on GPU 1 (nccl) or GPU 0 (colocated).
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
transformers = pytest.importorskip("transformers")

from ckpt_engine import CheckpointEngineConfig  # noqa: E402
from ckpt_engine.rollout_adapters.vllm import WORKER_EXTENSION, VllmRollout  # noqa: E402
from ckpt_engine.sources.base import StateDictSource  # noqa: E402
from ckpt_engine.sync.api import close_sessions, sync_rollout_weights  # noqa: E402

os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
os.environ.setdefault("VLLM_USE_DEEP_GEMM", "0")
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # the trainer uses CUDA in this process

QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 512, "hidden_size": 256,
    "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "initializer_range": 0.2, "bos_token_id": 1, "eos_token_id": 2,
}
ENGINE = {"max_model_len": 128, "max_num_seqs": 4, "gpu_memory_utilization": 0.12, "enforce_eager": True, "dtype": "bfloat16"}
PROMPTS = [[5, 6, 7, 8], [100, 3, 250, 17, 42]]
REFERENCE_SEED = 0


def hf_model(model_dir: Path, seed: int, device: str) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.AutoConfig.from_pretrained(model_dir)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).to(device).eval()


def source(model: torch.nn.Module, only: set[str] | None = None) -> StateDictSource:
    return StateDictSource({n: t.detach() for n, t in model.state_dict().items() if only is None or n in only})


def greedy(llm: Any) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def digests(llm: Any) -> dict[str, str]:
    (out,) = llm.collective_rpc("ckpt_param_digests")
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """config.json plus the reference weights (seed REFERENCE_SEED) as safetensors."""
    d = tmp_path_factory.mktemp("qwen2-cuda")
    (d / "config.json").write_text(json.dumps(QWEN2))
    hf_model(d, REFERENCE_SEED, "cpu").save_pretrained(d, safe_serialization=True)
    return d


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> tuple[dict[str, str], list[list[int]]]:
    """What an engine that loaded the reference weights from disk holds and generates."""
    from vllm import LLM

    llm = LLM(model=str(model_dir), skip_tokenizer_init=True, worker_extension_cls=WORKER_EXTENSION, **ENGINE)
    try:
        return digests(llm), greedy(llm)
    finally:
        llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def engine(model_dir: Path, reference: Any) -> Iterator[Any]:
    from vllm import LLM

    llm = LLM(model=str(model_dir), load_format="dummy", skip_tokenizer_init=True, worker_extension_cls=WORKER_EXTENSION, **ENGINE)
    yield llm
    close_sessions()
    llm.llm_engine.engine_core.shutdown()


def assert_holds_reference(llm: Any, reference: tuple[dict[str, str], list[list[int]]]) -> None:
    want, tokens = reference
    got = digests(llm)
    assert got.keys() == want.keys()
    assert [n for n in want if got[n] != want[n]] == []
    assert greedy(llm) == tokens


def test_nccl_from_the_trainers_gpu_not_the_current_one(engine: Any, model_dir: Path, reference: Any) -> None:
    """The trainer's tensors on cuda:1 while cuda:0 (the engine's GPU) is current: the sender
    joins from its tensors' device (NCCL refused two ranks on one GPU before)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    torch.cuda.set_device(0)
    trainer = hf_model(model_dir, REFERENCE_SEED, "cuda:1")
    handle = VllmRollout("vllm-cuda", engine, timeout_s=60.0)
    config = CheckpointEngineConfig(backend="nccl", timeout_s=60.0, stage="off")
    report = sync_rollout_weights(source(trainer), [handle], config=config)
    assert report is not None and report.delta == "off"
    assert_holds_reference(engine, reference)


def test_staged_delta_syncs_land_exactly(engine: Any, model_dir: Path, reference: Any) -> None:
    """Staged (the default) and delta: away to other weights, back by a patch; exact after each."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    handle = VllmRollout("vllm-cuda", engine, timeout_s=60.0)
    config = CheckpointEngineConfig(backend="nccl", timeout_s=60.0, delta="on")
    other = hf_model(model_dir, 7, "cuda:1")
    first = sync_rollout_weights(source(other), [handle], config=config)
    assert first is not None and first.staged != "off"
    assert digests(engine) != reference[0]
    trainer = hf_model(model_dir, REFERENCE_SEED, "cuda:1")
    back = sync_rollout_weights(source(trainer), [handle], config=config)
    assert back is not None and back.version == first.version + 1
    assert_holds_reference(engine, reference)


def test_a_staged_subset_leaves_the_other_tensors_as_they_are(engine: Any, model_dir: Path, reference: Any) -> None:
    """Two tensors of another version, staged: only their parameters change; the rest keep the
    reference bytes (issue 45: a staged subset once overwrote the rest at the swap)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    handle = VllmRollout("vllm-cuda", engine, timeout_s=60.0)
    config = CheckpointEngineConfig(backend="nccl", timeout_s=60.0)
    trainer = hf_model(model_dir, REFERENCE_SEED, "cuda:1")
    sync_rollout_weights(source(trainer), [handle], config=config)
    assert_holds_reference(engine, reference)
    other = hf_model(model_dir, 9, "cuda:1")
    subset = {"model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.o_proj.weight"}  # norms init to ones: equal across seeds
    report = sync_rollout_weights(source(other, only=subset), [handle], config=config)
    assert report is not None and report.tensors == 2
    got, want = digests(engine), reference[0]
    assert sorted(n for n in want if got[n] != want[n]) == sorted(subset)
    sync_rollout_weights(source(trainer), [handle], config=config)
    assert_holds_reference(engine, reference)


def test_colocated_on_the_engines_gpu(engine: Any, model_dir: Path, reference: Any) -> None:
    """Trainer and engine on one GPU (hybrid engine): the sender hands its buffers over by CUDA IPC."""
    handle = VllmRollout("vllm-cuda", engine, timeout_s=60.0)
    other = hf_model(model_dir, 5, "cuda:0")
    config = CheckpointEngineConfig(backend="colocated", timeout_s=60.0, stage="off")
    sync_rollout_weights(source(other), [handle], config=config)
    assert digests(engine) != reference[0]
    trainer = hf_model(model_dir, REFERENCE_SEED, "cuda:0")
    sync_rollout_weights(source(trainer), [handle], config=config)
    assert_holds_reference(engine, reference)


def test_a_sender_device_other_than_the_tensors_is_refused_by_name(engine: Any, model_dir: Path) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    handle = VllmRollout("vllm-cuda", engine, timeout_s=60.0)
    before = handle.held_version()
    trainer = hf_model(model_dir, 3, "cuda:1")
    config = CheckpointEngineConfig(backend="nccl", timeout_s=60.0, engine_kwargs={"nccl": {"device": "cuda:0"}})
    with pytest.raises(ValueError, match=r"on cuda:1 but the nccl sender is set to cuda:0"):
        sync_rollout_weights(source(trainer), [handle], config=config)
    assert handle.held_version() == before


def test_vllm_serve_over_nccl(model_dir: Path, tmp_path: Path) -> None:
    """`vllm serve` with the worker extension (dev-mode HTTP routes), fed over NCCL from cuda:1:
    every parameter vLLM keeps under the checkpoint's own name (unfused) holds the trainer's bytes."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    import hashlib

    import requests

    from ckpt_engine.rollout_adapters.vllm import VllmServerRollout
    from helpers_vllm import api_server

    extra = ["--worker-extension-cls", WORKER_EXTENSION]
    with api_server(model_dir, tmp_path / "server.log", extra, env={"CUDA_VISIBLE_DEVICES": "0"}) as server:
        trainer = hf_model(model_dir, 11, "cuda:1").float()
        handle = VllmServerRollout("vllm-serve", server.url, timeout_s=60.0)
        config = CheckpointEngineConfig(backend="nccl", timeout_s=60.0)
        report = sync_rollout_weights(source(trainer), [handle], config=config)
        assert report is not None and handle.held_version() == report.version
        (got,) = requests.post(f"{server.url}/collective_rpc", json={"method": "ckpt_param_digests"}, timeout=60).json()["results"]
        plain = [n for n in trainer.state_dict() if n in got]
        assert len(plain) >= 4
        for n in plain:
            want = hashlib.sha256(trainer.state_dict()[n].detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()).hexdigest()
            assert got[n] == want, n
        close_sessions()
