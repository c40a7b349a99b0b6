"""Name and layout rules between trainer-side parameters and Hugging Face checkpoint names.

Pure functions and tables: a new model family is a new table, not a new code path. Three kinds:
wrapper prefixes torch inserts (`_fsdp_wrapped_module.`, `_orig_mod.`, ...) that must never reach
the wire; transformers-5 fused MoE experts (`mlp.experts.gate_up_proj`, 3-D) -> one tensor per
expert, as HF checkpoints and the engines' loaders name them; Megatron-core `GPTModel` names and
fused layouts (`linear_qkv` per query group, `linear_fc1` = [gate; up]) <-> HF names, one
`MegatronFamily` table per family.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

__all__ = [
    "FusedExpertRule",
    "MegatronFamily",
    "MEGATRON_FAMILIES",
    "FUSED_EXPERT_RULES",
    "clean_name",
    "megatron_family",
    "split_gate_up",
    "split_qkv",
    "unfuse_expert_specs",
    "unfuse_experts",
]

WRAPPER_SEGMENTS: tuple[str, ...] = ("_fsdp_wrapped_module.", "_orig_mod.", "_checkpoint_wrapped_module.")


def clean_name(name: str) -> str:
    """Drop every wrapper segment torch wrappers put into a parameter's name."""
    for seg in WRAPPER_SEGMENTS:
        name = name.replace(seg, "")
    return name


# --- transformers-5 fused experts -> checkpoint names ---------------------------------------------


@dataclass(frozen=True)
class FusedExpertRule:
    """One fused 3-D expert parameter [num_experts, rows, cols] and its per-expert checkpoint names.

    `outputs` split each expert's [rows, cols] slice into equal parts along dim 0, in order
    (transformers' `gate_up_proj` is `chunk(2)` of the output rows: gate first, then up).
    `module_rename` maps the in-memory module path to the checkpoint one (Mixtral keeps
    `block_sparse_moe` in its checkpoints while transformers 5 calls it `mlp`).
    """

    param_suffix: str
    outputs: tuple[str, ...]
    module_rename: tuple[str, str] | None = None


# model_type -> fused expert rules. Qwen MoE checkpoints: experts.{e}.{gate,up,down}_proj.weight;
# Mixtral: block_sparse_moe.experts.{e}.{w1,w3,w2}.weight.
_QWEN_MOE = (
    FusedExpertRule("mlp.experts.gate_up_proj", ("gate_proj.weight", "up_proj.weight")),
    FusedExpertRule("mlp.experts.down_proj", ("down_proj.weight",)),
)
FUSED_EXPERT_RULES: dict[str, tuple[FusedExpertRule, ...]] = {
    "qwen2_moe": _QWEN_MOE,
    "qwen3_moe": _QWEN_MOE,
    "mixtral": (
        FusedExpertRule("mlp.experts.gate_up_proj", ("w1.weight", "w3.weight"), (".mlp.", ".block_sparse_moe.")),
        FusedExpertRule("mlp.experts.down_proj", ("w2.weight",), (".mlp.", ".block_sparse_moe.")),
    ),
}


def _expert_rule(model_type: str, name: str) -> FusedExpertRule | None:
    for rule in FUSED_EXPERT_RULES.get(model_type, ()):
        if name.endswith("." + rule.param_suffix):
            return rule
    return None


def _expert_names(rule: FusedExpertRule, name: str, num_experts: int) -> list[str]:
    base = name[: -len(rule.param_suffix.rsplit(".", 1)[1])]  # "...mlp.experts."
    if rule.module_rename is not None:
        base = base.replace(*rule.module_rename)
    return [f"{base}{e}.{out}" for e in range(num_experts) for out in rule.outputs]


def unfuse_expert_specs(model_type: str, name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]] | None:
    """Checkpoint (name, shape) pairs a fused expert parameter becomes; None if not a fused expert.

    Raises ValueError for a fused expert parameter whose layout the rule cannot split.
    """
    rule = _expert_rule(model_type, name)
    if rule is None:
        return None
    if len(shape) != 3 or shape[1] % len(rule.outputs):
        raise ValueError(
            f"{name}: cannot export fused experts of shape {shape} for model_type {model_type!r}; "
            f"expected [num_experts, {len(rule.outputs)}*rows, cols]"
        )
    part = (shape[1] // len(rule.outputs), shape[2])
    return [(n, part) for n in _expert_names(rule, name, shape[0])]


def unfuse_experts(model_type: str, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]] | None:
    """Per-expert views of a full fused expert tensor, in `unfuse_expert_specs` order."""
    rule = _expert_rule(model_type, name)
    if rule is None:
        return None
    names = iter(_expert_names(rule, name, tensor.shape[0]))

    def gen() -> Iterator[tuple[str, torch.Tensor]]:
        for e in range(tensor.shape[0]):
            for part in tensor[e].chunk(len(rule.outputs), dim=0):
                yield next(names), part

    return gen()


def has_unhandled_fused_experts(model_type: str, names: list[str]) -> list[str]:
    """Parameter names that look like fused experts but have no rule for `model_type`."""
    fused = re.compile(r"\.experts\.(gate_up_proj|down_proj|gate_proj|up_proj)(_bias)?$")
    return [n for n in names if fused.search(n) and _expert_rule(model_type, n) is None]


# --- Megatron-core GPTModel <-> HF ---------------------------------------------------------------

Names = dict[str, str | tuple[str, tuple[str, ...]]]
"""Megatron suffix -> one HF suffix, or a layout kind and its HF suffixes (`MegatronFamily`)."""

@dataclass(frozen=True)
class MegatronFamily:
    """Megatron <-> HF names for one model family (dense GPT-style decoder).

    `layer` maps a Megatron per-layer suffix to one HF per-layer suffix (a plain copy) or to a
    tuple of HF suffixes with a layout kind: "qkv" (interleaved per query group -> q, k, v) or
    "gate_up" ([gate; up] along dim 0). Suffixes for both the local and the Transformer-Engine
    layer specs are listed; a model holds one or the other.
    """

    model_types: tuple[str, ...]
    globals_: dict[str, str]
    layer: Names
    expert: Names = field(default_factory=dict)
    hf_layer_prefix: str = "model.layers."


_DENSE_GLOBALS = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}
_ATTN: Names = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.weight": ("qkv", ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")),
    "self_attention.linear_qkv.bias": ("qkv", ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")),
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
}
_DENSE_MLP: Names = {
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.weight": ("gate_up", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
_QK_NORM = {
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
}
_MOE = {
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.router.weight": "mlp.gate.weight",
}
# Per-expert suffixes (after "mlp.experts.local_experts.{e}."); HF: "mlp.experts.{global e}."
_EXPERT: Names = {
    "linear_fc1.weight": ("gate_up", ("gate_proj.weight", "up_proj.weight")),
    "linear_fc2.weight": "down_proj.weight",
}

MEGATRON_FAMILIES: tuple[MegatronFamily, ...] = (
    MegatronFamily(("llama", "mistral", "qwen2"), _DENSE_GLOBALS, {**_ATTN, **_DENSE_MLP}),
    MegatronFamily(("qwen3",), _DENSE_GLOBALS, {**_ATTN, **_DENSE_MLP, **_QK_NORM}),
    MegatronFamily(("qwen3_moe",), _DENSE_GLOBALS, {**_ATTN, **_QK_NORM, **_MOE}, expert=_EXPERT),
)


def megatron_family(model_type: str) -> MegatronFamily:
    """The naming table for `model_type`; ValueError naming the supported ones otherwise."""
    for fam in MEGATRON_FAMILIES:
        if model_type in fam.model_types:
            return fam
    known = sorted(t for f in MEGATRON_FAMILIES for t in f.model_types)
    raise ValueError(f"no Megatron naming table for model_type {model_type!r}; tables exist for: {', '.join(known)}")


def split_qkv(t: torch.Tensor, num_heads: int, num_query_groups: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    """Megatron's fused QKV [groups*(q_per_group+2)*head_dim, ...] -> (q, k, v), HF row order."""
    per = num_heads // num_query_groups
    g = t.reshape(num_query_groups, (per + 2) * head_dim, *t.shape[1:])
    q, k, v = g.split([per * head_dim, head_dim, head_dim], dim=1)
    rest = t.shape[1:]
    return (
        q.reshape(num_heads * head_dim, *rest).contiguous(),
        k.reshape(num_query_groups * head_dim, *rest).contiguous(),
        v.reshape(num_query_groups * head_dim, *rest).contiguous(),
    )


def split_gate_up(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(p.contiguous() for p in t.chunk(2, dim=0))
