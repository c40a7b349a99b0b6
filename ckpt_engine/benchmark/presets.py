"""Model shape presets: the HF checkpoint tensor list of a model, computed from its config.json.

No transformers import and no weights: the list of (name, dtype, shape) that a
`model.safetensors.index.json` of that model would hold (one tensor per MoE expert).
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from ckpt_engine.manifest import TensorSpec

__all__ = ["PRESETS", "load_preset_config", "checkpoint_specs"]

PRESETS = ("tiny", "qwen2.5-7b", "qwen3-30b-a3b")


def load_preset_config(preset: str, layers: int | None = None) -> dict[str, Any]:
    """A preset name shipped with the package, or a path to an HF config.json; `layers`: the decoder
    cut to that many layers (`layer_types` too: transformers checks one entry per layer)."""
    if preset in PRESETS:
        config = json.loads(resources.files("ckpt_engine.benchmark").joinpath(f"presets/{preset}.json").read_text())
    else:
        path = Path(preset)
        if not path.is_file():
            raise ValueError(f"unknown preset {preset!r}: use one of {', '.join(PRESETS)} or a path to an HF config.json")
        config = json.loads(path.read_text())
    if layers:
        config["num_hidden_layers"] = layers
        if "layer_types" in config:
            config["layer_types"] = config["layer_types"][:layers]
    return config


def checkpoint_specs(config: dict[str, Any], dtype: str = "bfloat16", num_layers: int | None = None) -> list[TensorSpec]:
    """HF checkpoint tensors of a Qwen2/Llama/Qwen3(-MoE)-style decoder, in checkpoint order."""
    model_type = config.get("model_type", "")
    if model_type not in ("qwen2", "llama", "qwen3", "qwen3_moe", "mistral"):
        raise ValueError(f"no shape rules for model_type {model_type!r}; known: qwen2, qwen3, qwen3_moe, llama, mistral")
    h, v = config["hidden_size"], config["vocab_size"]
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    hd = config.get("head_dim") or h // heads
    layers = num_layers if num_layers is not None else config["num_hidden_layers"]
    qkv_bias = model_type == "qwen2" or bool(config.get("attention_bias", False))
    qk_norm = model_type in ("qwen3", "qwen3_moe")
    experts = config.get("num_experts", config.get("num_local_experts", 0)) if model_type == "qwen3_moe" else 0
    specs: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (v, h))]
    for i in range(layers):
        p = f"model.layers.{i}"
        specs.append((f"{p}.input_layernorm.weight", (h,)))
        for proj, out in (("q_proj", heads * hd), ("k_proj", kv * hd), ("v_proj", kv * hd)):
            specs.append((f"{p}.self_attn.{proj}.weight", (out, h)))
            if qkv_bias:
                specs.append((f"{p}.self_attn.{proj}.bias", (out,)))
        specs.append((f"{p}.self_attn.o_proj.weight", (h, heads * hd)))
        if qk_norm:
            specs += [(f"{p}.self_attn.q_norm.weight", (hd,)), (f"{p}.self_attn.k_norm.weight", (hd,))]
        specs.append((f"{p}.post_attention_layernorm.weight", (h,)))
        if experts:
            inter = config["moe_intermediate_size"]
            specs.append((f"{p}.mlp.gate.weight", (experts, h)))
            for e in range(experts):
                q = f"{p}.mlp.experts.{e}"
                specs += [(f"{q}.gate_proj.weight", (inter, h)), (f"{q}.up_proj.weight", (inter, h)), (f"{q}.down_proj.weight", (h, inter))]
        else:
            inter = config["intermediate_size"]
            specs += [(f"{p}.mlp.gate_proj.weight", (inter, h)), (f"{p}.mlp.up_proj.weight", (inter, h)), (f"{p}.mlp.down_proj.weight", (h, inter))]
    specs.append(("model.norm.weight", (h,)))
    if not config.get("tie_word_embeddings", False):
        specs.append(("lm_head.weight", (v, h)))
    return [TensorSpec(n, dtype, s) for n, s in specs]
