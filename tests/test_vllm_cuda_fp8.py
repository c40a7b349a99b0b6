"""FP8 refit into a real CUDA vLLM engine (vLLM 0.26 carried by bench/vllm_carry.sh; run by
`VLLM_TESTS=tests/test_vllm_cuda_fp8.py bash bench/gpu_runs.sh vllm`, never in CI).

Two engines, each checked against the same engine loaded from disk (every parameter by digest, in
vLLM's own post-processed layout, and greedy tokens), fed from a trainer on a second GPU over `nccl`,
or, on a machine of one GPU, from the engine's own GPU over `colocated`:
- a block-FP8 checkpoint (e4m3, 128 x 128 blocks, `weight_scale_inv`), fed with
  `wire_dtype: fp8` from a bf16 trainer: what it holds after the sync equals what it holds after
  loading the checkpoint our quantizer writes from the same bf16 weights;
- an online-FP8 engine (`quantization="fp8"` on a bf16 checkpoint), fed bf16: vLLM's layerwise
  reload re-quantizes, and it holds what a fresh start from those bf16 weights gives.
Each also refuses the other wire by name, on its old weights.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a GPU", allow_module_level=True)
vllm = pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")

from ckpt_engine import CheckpointEngineConfig, ManifestRejectedError, SyncError  # noqa: E402
from ckpt_engine.fp8.layout import quantizes, scale_name  # noqa: E402
from ckpt_engine.fp8.quantize import quantize_block_fp8  # noqa: E402
from ckpt_engine.manifest import TensorSpec  # noqa: E402
from ckpt_engine.rollout_adapters.vllm import WORKER_EXTENSION, VllmRollout  # noqa: E402
from ckpt_engine.sources.base import StateDictSource  # noqa: E402
from ckpt_engine.sources.fp8 import Fp8WireSource  # noqa: E402
from ckpt_engine.sync.api import close_sessions, sync_rollout_weights  # noqa: E402
from helpers_vllm_cuda import digests, greedy  # noqa: E402

os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
os.environ.setdefault("VLLM_USE_DEEP_GEMM", "0")
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")

QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 512, "hidden_size": 256,
    "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128,
    "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "initializer_range": 0.2, "bos_token_id": 1, "eos_token_id": 2,
}
"""Every projection a whole number of 128 x 128 blocks (q 256, k 128, v 128 rows), as vLLM's block-FP8 layers need."""
BLOCK_FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
TRAINER, BACKEND = ("cuda:1", "nccl") if torch.cuda.device_count() > 1 else ("cuda:0", "colocated")
"""Where the trainer's tensors live and how they travel: the engine holds GPU 0."""
ENGINE = {"max_model_len": 128, "max_num_seqs": 4, "gpu_memory_utilization": 0.12, "enforce_eager": True, "dtype": "bfloat16"}


def bf16_weights(d: Path, seed: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    config = transformers.AutoConfig.from_pretrained(d)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).to(device).eval()
    return {n: t.detach().contiguous() for n, t in model.state_dict().items()}


def write_checkpoint(d: Path, seed: int, block_fp8: bool) -> Path:
    """A bf16 Qwen2 checkpoint of `seed`, or the block-FP8 checkpoint our quantizer makes of it."""
    from safetensors.torch import save_file

    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(QWEN2))
    weights = bf16_weights(d, seed)
    if block_fp8:
        out: dict[str, torch.Tensor] = {}
        for name, t in weights.items():
            if quantizes(TensorSpec(name, "bfloat16", tuple(t.shape))):
                out[name], out[scale_name(name)] = quantize_block_fp8(t)
            else:
                out[name] = t
        weights = out
        (d / "config.json").write_text(json.dumps({**QWEN2, "quantization_config": BLOCK_FP8}))
    save_file({n: t.clone() for n, t in weights.items()}, str(d / "model.safetensors"))
    return d


def start(d: Path, **kw: Any) -> Any:
    from vllm import LLM

    return LLM(model=str(d), skip_tokenizer_init=True, worker_extension_cls=WORKER_EXTENSION, **ENGINE, **kw)


def held(d: Path, **kw: Any) -> tuple[dict[str, str], list[list[int]]]:
    """What an engine that loaded `d` from disk holds and generates."""
    llm = start(d, **kw)
    try:
        return digests(llm), greedy(llm)
    finally:
        llm.llm_engine.engine_core.shutdown()


def refit(tmp_path: Path, block_fp8: bool, engine_kw: dict[str, Any], wire: str | None, wrong: str | None) -> None:
    """An engine started from seed 7 is synced to seed 0's weights (sent from `TRAINER` with
    `wire_dtype=wire`) and must hold what loading seed 0's checkpoint gives; the `wrong` wire is
    refused first, naming the key, with nothing changed."""
    want = held(write_checkpoint(tmp_path / "seed0", 0, block_fp8), **engine_kw)
    llm = start(write_checkpoint(tmp_path / "seed7", 7, block_fp8), **engine_kw)
    try:
        before = digests(llm)
        assert before != want[0]
        trainer = StateDictSource(bf16_weights(tmp_path / "seed0", 0, TRAINER))
        handle = VllmRollout("vllm-fp8", llm, timeout_s=60.0)
        with pytest.raises((ManifestRejectedError, SyncError), match=r"checkpoint_engine\.wire_dtype"):
            sync_rollout_weights(trainer, [handle], config=CheckpointEngineConfig(backend=BACKEND, timeout_s=60.0, wire_dtype=wrong))
        assert digests(llm) == before
        report = sync_rollout_weights(trainer, [handle], config=CheckpointEngineConfig(backend=BACKEND, timeout_s=60.0, wire_dtype=wire))
        assert report is not None and handle.held_version() == report.version
        got = digests(llm)
        assert got.keys() == want[0].keys()
        assert [n for n in want[0] if got[n] != want[0][n]] == []
        assert greedy(llm) == want[1]
        print(f"fp8 refit over {BACKEND} ({'block-FP8 wire' if block_fp8 else 'online FP8, bf16 wire'}): {report.bytes} wire bytes, {report.seconds}")
        if wire == "fp8":
            later_syncs_fill_the_senders_slots(llm, handle, trainer, tmp_path, want[0], before)
    finally:
        close_sessions()
        llm.llm_engine.engine_core.shutdown()


def later_syncs_fill_the_senders_slots(llm: Any, handle: Any, trainer: StateDictSource, tmp_path: Path, want: dict[str, str], seed7: dict[str, str]) -> None:
    """The same trainer tensors, changed in place between syncs (seed 7's weights, then seed 0's
    again, ...): from the third sync of a stable source the FP8 walk writes each bucket into the
    sender's slot itself (`sources/fp8_fill.py`); every sync still lands the disk load's bytes."""
    seeds = {0: {n: t.to(TRAINER) for n, t in bf16_weights(tmp_path / "seed0", 0).items()},
             7: {n: t.to(TRAINER) for n, t in bf16_weights(tmp_path / "seed7", 7).items()}}
    wire = Fp8WireSource(trainer)
    config = CheckpointEngineConfig(backend=BACKEND, timeout_s=60.0, wire_dtype="fp8")
    filled = []
    for seed in (7, 0, 7, 0, 7):
        for n, t in trainer.weights.items():
            t.copy_(seeds[seed][n])
        report = sync_rollout_weights(wire, [handle], config=config)
        assert report is not None and handle.held_version() == report.version
        filled.append(wire.last_walk.filled)
        got = digests(llm)
        expected = seed7 if seed == 7 else want
        assert [n for n in expected if got[n] != expected[n]] == [], (seed, filled)
    assert filled[-1] > 0, f"no sync filled the sender's slots: {filled}"
    print(f"fp8 fills: buckets filled by the walk per sync {filled}")


def test_block_fp8_engine_takes_the_fp8_wire_exactly(tmp_path: Path) -> None:
    refit(tmp_path, True, {}, "fp8", None)


def test_online_fp8_engine_requantizes_a_bf16_sync_exactly(tmp_path: Path) -> None:
    refit(tmp_path, False, {"quantization": "fp8"}, None, "fp8")
