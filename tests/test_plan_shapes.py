"""Bytes from a config.json equal the bytes of the real model's tensors (transformers, meta device)."""

from __future__ import annotations

import pytest

from ckpt_engine.manifest import TensorSpec
from ckpt_engine.plan.model_shapes import checkpoint_tensors, load_model_config, model_bytes
from ckpt_engine.planning.fused_experts import fuse_specs

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _meta_state(config: dict) -> dict[str, tuple[int, ...]]:
    cfg = {k: v for k, v in config.items() if not k.startswith("_")}
    hf = transformers.AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _shapes(tensors) -> dict[str, tuple[int, ...]]:
    return {t.name: t.shape for t in tensors}


def test_dense_qwen2_matches_transformers_tensor_for_tensor() -> None:
    config = load_model_config("qwen2.5-7b")
    real = _meta_state(config)
    ours = checkpoint_tensors(config)
    assert _shapes(ours) == real
    assert sum(t.nbytes for t in ours) == sum(2 * _numel(s) for s in real.values()) == 15_231_233_024


def _stacked(tensors) -> dict[str, tuple[int, ...]]:
    """The per-expert tensors as `planning/fused_experts.py` stacks them for the wire."""
    fused, _ = fuse_specs([TensorSpec(t.name, t.dtype, t.shape) for t in tensors])
    return {s.name: s.shape for s in fused}


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def test_moe_qwen3_matches_fused_model_and_checkpoint_names() -> None:
    config = load_model_config("qwen3-30b-a3b")
    real = _meta_state(config)  # transformers 5 fuses experts in memory (gate and up in one)
    per_expert = checkpoint_tensors(config)  # the wire: one tensor per expert
    assert _shapes(checkpoint_tensors(config, fused_experts=True)) == _stacked(per_expert)  # what FusedExpertSource sends
    assert sum(t.numel for t in checkpoint_tensors(config, fused_experts=True)) == sum(_numel(s) for s in real.values())
    assert len(per_expert) == 18_867
    assert sum(t.numel for t in per_expert) == sum(_numel(s) for s in real.values())
    assert "model.layers.47.mlp.experts.127.down_proj.weight" in {t.name for t in per_expert}
    assert model_bytes("qwen3-30b-a3b").total_bytes == 61_064_245_248  # the bench's measured bytes


@pytest.mark.parametrize("preset", ["deepseek-v3", "kimi-k2"])
def test_mla_moe_rules_match_transformers_deepseek_v3(preset: str) -> None:
    config = load_model_config(preset)
    small = {**config, "num_hidden_layers": 3, "n_routed_experts": 4, "first_k_dense_replace": 1}
    real = _meta_state(small)
    apart = {n: s for n, s in _shapes(checkpoint_tensors(small)).items() if ".experts." not in n}
    assert apart == {n: s for n, s in real.items() if ".experts." not in n}
    fused = checkpoint_tensors(small, fused_experts=True)
    assert _shapes(fused) == _stacked(checkpoint_tensors(small))
    assert sum(t.numel for t in fused) == sum(_numel(s) for s in real.values())


@pytest.mark.parametrize(
    ("preset", "low", "high"),
    [("qwen3-235b-a22b", 234e9, 236e9), ("deepseek-v3", 670e9, 672e9), ("kimi-k2", 1.00e12, 1.05e12)],
)
def test_presets_have_their_published_parameter_counts(preset: str, low: float, high: float) -> None:
    assert low < model_bytes(preset).num_params < high


def test_fp8_adds_one_float32_scale_per_128x128_block() -> None:
    bf16, fp8 = model_bytes("kimi-k2"), model_bytes("kimi-k2", dtype="fp8")
    assert fp8.num_params == bf16.num_params
    assert 0.5 * bf16.total_bytes < fp8.total_bytes < 0.51 * bf16.total_bytes
    names = {t.name for t in checkpoint_tensors(load_model_config("kimi-k2"), dtype="fp8", num_layers=2)}
    assert "model.layers.1.mlp.experts.0.up_proj.weight_scale_inv" in names
    assert "model.embed_tokens.weight_scale_inv" not in names


def test_unknown_model_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="--model 'nope'"):
        model_bytes("nope")
    with pytest.raises(ValueError, match="no shape rules for model_type 'gpt2'"):
        checkpoint_tensors({"model_type": "gpt2"})
