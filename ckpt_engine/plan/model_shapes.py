"""Bytes a sync moves, from an HF ``config.json`` alone (no torch, no weights).

The wire carries Hugging Face *checkpoint* names (one tensor per MoE expert), so the planner
counts tensors the way a ``model.safetensors.index.json`` lists them: that count drives the
per-tensor costs (packing, the engine's loader) and the byte total drives the links.
Multi-token-prediction layers (DeepSeek-V3's layer 61) are left out: RL syncs do not send them.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

__all__ = [
    "DTYPE_BYTES",
    "MODEL_PRESETS",
    "ModelBytes",
    "TensorShape",
    "checkpoint_tensors",
    "load_model_config",
    "model_bytes",
]

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}

#: preset name -> (package holding it, file name)
MODEL_PRESETS = {
    "qwen2.5-7b": ("ckpt_engine.benchmark", "presets/qwen2.5-7b.json"),
    "qwen3-30b-a3b": ("ckpt_engine.benchmark", "presets/qwen3-30b-a3b.json"),
    "qwen3-235b-a22b": ("ckpt_engine.plan", "presets/qwen3-235b-a22b.json"),
    "deepseek-v3": ("ckpt_engine.plan", "presets/deepseek-v3.json"),
    "kimi-k2": ("ckpt_engine.plan", "presets/kimi-k2.json"),
}

_QWEN_LIKE = ("qwen2", "llama", "mistral", "qwen3", "qwen3_moe")
_MLA_LIKE = ("deepseek_v3", "kimi_k2")
FP8_BLOCK = 128  # DeepSeek-style block-wise FP8: one float32 scale per 128 x 128 block


@dataclass(frozen=True)
class TensorShape:
    """One checkpoint tensor: name, shape, dtype; ``expert`` marks routed-expert weights."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    expert: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class ModelBytes:
    """What the planner needs from a model: totals, not the tensor list."""

    name: str
    total_bytes: int
    num_tensors: int
    num_params: int
    expert_bytes: int
    largest_tensor_bytes: int
    dtype: str
    itemsize: int
    num_layers: int


_REQUIRED_SIZES = ("hidden_size", "vocab_size", "num_hidden_layers")
"""The sizes every model's config.json names."""
_SIZES = (*_REQUIRED_SIZES, "num_attention_heads", "num_key_value_heads", "intermediate_size", "moe_intermediate_size", "head_dim")
"""The sizes a user's config.json may give, each checked where it is given."""


def load_model_config(model: str) -> dict[str, Any]:
    """A preset name (``ckpt-engine plan --model``) or a path to an HF config.json."""
    if model in MODEL_PRESETS:
        package, name = MODEL_PRESETS[model]
        return json.loads(resources.files(package).joinpath(name).read_text())
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"--model {model!r}: use one of {', '.join(MODEL_PRESETS)} or a path to an HF config.json")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"--model {model!r}: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"--model {model!r}: an HF config.json holds one JSON object, not a {type(config).__name__}")
    for key in _SIZES:
        value = config.get(key)
        if key in config and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"--model {model!r}: {key} must be a whole number >= 1, got {value!r}")
    missing = [k for k in _REQUIRED_SIZES if k not in config]
    if missing:
        raise ValueError(f"--model {model!r}: the config lacks {', '.join(missing)} (an HF config.json names every size)")
    return config


def _linear(name: str, out_f: int, in_f: int, dtype: str, fp8: bool, expert: bool = False) -> list[TensorShape]:
    """A Linear weight; in block-FP8 checkpoints it comes with its ``weight_scale_inv``."""
    if not fp8:
        return [TensorShape(name, (out_f, in_f), dtype, expert)]
    scale = (math.ceil(out_f / FP8_BLOCK), math.ceil(in_f / FP8_BLOCK))
    return [
        TensorShape(name, (out_f, in_f), "float8_e4m3fn", expert),
        TensorShape(name.removesuffix(".weight") + ".weight_scale_inv", scale, "float32", expert),
    ]


def _mlp(prefix: str, inter: int, h: int, dtype: str, fp8: bool, expert: bool = False) -> list[TensorShape]:
    out = _linear(f"{prefix}.gate_proj.weight", inter, h, dtype, fp8, expert)
    out += _linear(f"{prefix}.up_proj.weight", inter, h, dtype, fp8, expert)
    out += _linear(f"{prefix}.down_proj.weight", h, inter, dtype, fp8, expert)
    return out


def _qwen_attention(p: str, c: dict[str, Any], dtype: str) -> list[TensorShape]:
    h, heads = c["hidden_size"], c["num_attention_heads"]
    kv = c.get("num_key_value_heads") or heads
    hd = c.get("head_dim") or h // heads
    bias = c["model_type"] == "qwen2" or bool(c.get("attention_bias", False))
    out: list[TensorShape] = []
    for proj, rows in (("q_proj", heads * hd), ("k_proj", kv * hd), ("v_proj", kv * hd)):
        out.append(TensorShape(f"{p}.self_attn.{proj}.weight", (rows, h), dtype))
        if bias:
            out.append(TensorShape(f"{p}.self_attn.{proj}.bias", (rows,), dtype))
    out.append(TensorShape(f"{p}.self_attn.o_proj.weight", (h, heads * hd), dtype))
    if c["model_type"] in ("qwen3", "qwen3_moe"):
        out += [TensorShape(f"{p}.self_attn.q_norm.weight", (hd,), dtype), TensorShape(f"{p}.self_attn.k_norm.weight", (hd,), dtype)]
    return out


def _mla_attention(p: str, c: dict[str, Any], dtype: str, fp8: bool) -> list[TensorShape]:
    """DeepSeek-V3 multi-head latent attention (also Kimi-K2)."""
    h, heads = c["hidden_size"], c["num_attention_heads"]
    nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    q_rank, kv_rank = c.get("q_lora_rank"), c["kv_lora_rank"]
    a = f"{p}.self_attn"
    out: list[TensorShape] = []
    if q_rank:
        out += _linear(f"{a}.q_a_proj.weight", q_rank, h, dtype, fp8)
        out.append(TensorShape(f"{a}.q_a_layernorm.weight", (q_rank,), dtype))
        out += _linear(f"{a}.q_b_proj.weight", heads * (nope + rope), q_rank, dtype, fp8)
    else:
        out += _linear(f"{a}.q_proj.weight", heads * (nope + rope), h, dtype, fp8)
    out += _linear(f"{a}.kv_a_proj_with_mqa.weight", kv_rank + rope, h, dtype, fp8)
    out.append(TensorShape(f"{a}.kv_a_layernorm.weight", (kv_rank,), dtype))
    out += _linear(f"{a}.kv_b_proj.weight", heads * (nope + v), kv_rank, dtype, fp8)
    out += _linear(f"{a}.o_proj.weight", h, heads * v, dtype, fp8)
    return out


def _num_experts(c: dict[str, Any]) -> int:
    for key in ("n_routed_experts", "num_experts", "num_local_experts"):
        if c.get(key):
            return int(c[key])
    return 0


def _is_moe_layer(c: dict[str, Any], i: int) -> bool:
    if _num_experts(c) == 0:
        return False
    if c["model_type"] in _MLA_LIKE:
        return i >= c.get("first_k_dense_replace", 0) and i % c.get("moe_layer_freq", 1) == 0
    step = c.get("decoder_sparse_step", 1)
    return i not in c.get("mlp_only_layers", []) and (i + 1) % step == 0


def _fused_experts(p: str, experts: int, inter: int, h: int, dtype: str, fp8: bool) -> list[TensorShape]:
    """What `FusedExpertSource` sends: each expert tensor stacked over the experts, one per layer
    and projection ([E, I, H] gate and up, [E, H, I] down; FP8 scales alike)."""
    one = _mlp(f"{p}.mlp.experts.0", inter, h, dtype, fp8, expert=True)
    return [TensorShape(t.name.replace(".experts.0.", ".experts."), (experts, *t.shape), t.dtype, True) for t in one]


def checkpoint_tensors(config: dict[str, Any], dtype: str | None = None, num_layers: int | None = None,
                       fused_experts: bool = False) -> list[TensorShape]:
    """The checkpoint tensor list of a Qwen2/Llama/Qwen3(-MoE) or DeepSeek-V3/Kimi-K2 decoder.

    ``dtype``: ``bfloat16`` (what trainers hold; default) or ``fp8`` (block-wise FP8 linear
    weights with float32 scales, the published DeepSeek-V3 / Kimi-K2 checkpoint format).
    ``fused_experts``: routed experts stacked, one tensor per layer and projection (same bytes,
    far fewer tensors), as `FusedExpertSource` sends them to receivers that hold them so.
    """
    model_type = config.get("model_type", "")
    if model_type not in _QWEN_LIKE + _MLA_LIKE:
        raise ValueError(f"no shape rules for model_type {model_type!r}; known: {', '.join(_QWEN_LIKE + _MLA_LIKE)}")
    want = dtype if dtype is not None else "bfloat16"
    if want not in ("bfloat16", "float16", "float32", "fp8"):
        raise ValueError(f"dtype {want!r}: use bfloat16, float16, float32 or fp8")
    fp8 = want == "fp8"
    base = "bfloat16" if fp8 else want
    h, vocab = config["hidden_size"], config["vocab_size"]
    layers = num_layers if num_layers is not None else config["num_hidden_layers"]
    experts = _num_experts(config)
    out = [TensorShape("model.embed_tokens.weight", (vocab, h), base)]
    for i in range(layers):
        p = f"model.layers.{i}"
        out.append(TensorShape(f"{p}.input_layernorm.weight", (h,), base))
        if model_type in _MLA_LIKE:
            out += _mla_attention(p, config, base, fp8)
        else:
            out += _qwen_attention(p, config, base)
        out.append(TensorShape(f"{p}.post_attention_layernorm.weight", (h,), base))
        if not _is_moe_layer(config, i):
            out += _mlp(f"{p}.mlp", config["intermediate_size"], h, base, fp8)
            continue
        inter = config["moe_intermediate_size"]
        out.append(TensorShape(f"{p}.mlp.gate.weight", (experts, h), base))
        if model_type in _MLA_LIKE and config.get("topk_method", "noaux_tc") == "noaux_tc":
            out.append(TensorShape(f"{p}.mlp.gate.e_score_correction_bias", (experts,), "float32"))
        if fused_experts:
            out += _fused_experts(p, experts, inter, h, base, fp8)
        for e in range(0 if fused_experts else experts):
            out += _mlp(f"{p}.mlp.experts.{e}", inter, h, base, fp8, expert=True)
        shared = config.get("n_shared_experts") or 0
        if shared:
            out += _mlp(f"{p}.mlp.shared_experts", inter * shared, h, base, fp8)
    out.append(TensorShape("model.norm.weight", (h,), base))
    if not config.get("tie_word_embeddings", False):
        out.append(TensorShape("lm_head.weight", (vocab, h), base))
    return out


def model_bytes(model: str | dict[str, Any], dtype: str | None = None, name: str | None = None, fused_experts: bool = False) -> ModelBytes:
    """Totals for a preset name, a config path or a config dict (names are cached: Kimi-K2 has
    70,000 checkpoint tensors and sweeps ask for it many times)."""
    if isinstance(model, str) and name is None:
        return _cached_model_bytes(model, dtype, fused_experts)
    return _model_bytes(model, dtype, name, fused_experts)


@functools.lru_cache(maxsize=32)
def _cached_model_bytes(model: str, dtype: str | None, fused_experts: bool) -> ModelBytes:
    return _model_bytes(model, dtype, None, fused_experts)


def _model_bytes(model: str | dict[str, Any], dtype: str | None, name: str | None, fused_experts: bool) -> ModelBytes:
    config = load_model_config(model) if isinstance(model, str) else model
    label = name if name is not None else (model if isinstance(model, str) else config.get("model_type", "model"))
    tensors = checkpoint_tensors(config, dtype=dtype, fused_experts=fused_experts)
    total = sum(t.nbytes for t in tensors)
    params = sum(t.numel for t in tensors if not t.name.endswith("scale_inv"))
    want = dtype if dtype is not None else "bfloat16"
    itemsize = 1 if want == "fp8" else DTYPE_BYTES[want]
    return ModelBytes(
        name=label,
        total_bytes=total,
        num_tensors=len(tensors),
        num_params=params,
        expert_bytes=sum(t.nbytes for t in tensors if t.expert),
        largest_tensor_bytes=max(t.nbytes for t in tensors),
        dtype=want,
        itemsize=itemsize,
        num_layers=config["num_hidden_layers"],
    )
