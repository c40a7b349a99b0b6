"""Shared pieces of the region-delivery tests: tiny Qwen2 (GQA) and Qwen3-MoE shapes, versions of
their weights, and one rank of an engine-level region sync (senders + TP/EP receivers over gloo)."""

from __future__ import annotations

from typing import Any

import torch

from ckpt_engine.manifest import TensorSpec
from ckpt_engine.planning.ownership import row_shards
from ckpt_engine.planning.receive_sets import RegionLayout
from ckpt_engine.planning.tp_ep import tp_ep_plan

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB, EXPERTS = 64, 4, 1, 16, 96, 160, 4


def qwen2_specs(layers: int = 2) -> list[TensorSpec]:
    """GQA with one KV head: under TP=2 both ranks hold all of K and V (the KV slice repeats)."""
    out = [TensorSpec("model.embed_tokens.weight", "float32", (VOCAB, HIDDEN))]
    for i in range(layers):
        p = f"model.layers.{i}"
        out.append(TensorSpec(f"{p}.input_layernorm.weight", "float32", (HIDDEN,)))
        for proj, rows in (("q_proj", HEADS * HEAD_DIM), ("k_proj", KV_HEADS * HEAD_DIM), ("v_proj", KV_HEADS * HEAD_DIM)):
            out += [TensorSpec(f"{p}.self_attn.{proj}.weight", "float32", (rows, HIDDEN)), TensorSpec(f"{p}.self_attn.{proj}.bias", "float32", (rows,))]
        out.append(TensorSpec(f"{p}.self_attn.o_proj.weight", "float32", (HIDDEN, HEADS * HEAD_DIM)))
        out.append(TensorSpec(f"{p}.post_attention_layernorm.weight", "float32", (HIDDEN,)))
        out += [TensorSpec(f"{p}.mlp.{m}_proj.weight", "float32", (INTER, HIDDEN)) for m in ("gate", "up")]
        out.append(TensorSpec(f"{p}.mlp.down_proj.weight", "float32", (HIDDEN, INTER)))
    out += [TensorSpec("model.norm.weight", "float32", (HIDDEN,)), TensorSpec("lm_head.weight", "float32", (VOCAB, HIDDEN))]
    return out


def moe_specs(layers: int = 2) -> list[TensorSpec]:
    out = [TensorSpec("model.embed_tokens.weight", "float32", (VOCAB, HIDDEN))]
    for i in range(layers):
        p = f"model.layers.{i}"
        out.append(TensorSpec(f"{p}.input_layernorm.weight", "float32", (HIDDEN,)))
        for proj, rows in (("q_proj", HEADS * HEAD_DIM), ("k_proj", 2 * HEAD_DIM), ("v_proj", 2 * HEAD_DIM)):
            out.append(TensorSpec(f"{p}.self_attn.{proj}.weight", "float32", (rows, HIDDEN)))
        out.append(TensorSpec(f"{p}.self_attn.o_proj.weight", "float32", (HIDDEN, HEADS * HEAD_DIM)))
        out += [TensorSpec(f"{p}.self_attn.{n}_norm.weight", "float32", (HEAD_DIM,)) for n in ("q", "k")]
        out.append(TensorSpec(f"{p}.post_attention_layernorm.weight", "float32", (HIDDEN,)))
        out.append(TensorSpec(f"{p}.mlp.gate.weight", "float32", (EXPERTS, HIDDEN)))
        for e in range(EXPERTS):
            q = f"{p}.mlp.experts.{e}"
            out += [TensorSpec(f"{q}.{m}_proj.weight", "float32", (INTER // 2, HIDDEN)) for m in ("gate", "up")]
            out.append(TensorSpec(f"{q}.down_proj.weight", "float32", (HIDDEN, INTER // 2)))
    out += [TensorSpec("model.norm.weight", "float32", (HIDDEN,)), TensorSpec("lm_head.weight", "float32", (VOCAB, HIDDEN))]
    return out


def weights(specs: list[TensorSpec], version: int) -> dict[str, torch.Tensor]:
    """Version 0 random; each later version changes ~3 % of the elements of the one before."""
    g = torch.Generator().manual_seed(1234)
    out = {s.name: torch.randn(s.shape, generator=g) * 0.02 for s in specs}
    for v in range(1, version + 1):
        gv = torch.Generator().manual_seed(v)
        for t in out.values():
            mask = torch.rand(t.shape, generator=gv) < 0.03
            t[mask] += 0.001
    return out


def plans(kind: str, specs: list[TensorSpec], receivers: int) -> list[Any]:
    if kind == "tp":
        return [tp_ep_plan(specs, tp_size=receivers, tp_rank=r, num_kv_heads=KV_HEADS) for r in range(receivers)]
    return [tp_ep_plan(specs, ep_size=receivers, ep_rank=r) for r in range(receivers)]


def owners(specs: list[TensorSpec], senders: int) -> dict[str, Any] | None:
    """Every tensor of at least `senders` rows cut in dim-0 row blocks (an FSDP2-like trainer)."""
    if senders == 1:
        return None
    out = {}
    for s in specs:
        rows = s.shape[0]
        if rows >= senders:
            per = [rows // senders + (1 if i < rows % senders else 0) for i in range(senders)]
            out[s.name] = row_shards(s, per)
    return out


def layout(kind: str, specs: list[TensorSpec], receivers: int) -> RegionLayout:
    return RegionLayout.build(specs, plans(kind, specs, receivers))
