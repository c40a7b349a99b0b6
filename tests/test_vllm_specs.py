"""`VllmSpecs`: what a vLLM model accepts, without an engine (the vLLM tests read it from real models)."""

from __future__ import annotations

import torch

from ckpt_engine.manifest import BucketManifest, TensorSpec
from ckpt_engine.planning.buckets import plan_buckets
from ckpt_engine.planning.fused_experts import fuse_specs
from ckpt_engine.rollout_adapters.vllm.specs import VllmSpecs
from regionranks import EXPERTS, moe_specs


def moe_model_specs() -> VllmSpecs:
    """Qwen3-MoE shapes as vLLM stacks them: q/k/v fill one parameter, gate/up of an expert too."""
    specs = {s.name: s for s in moe_specs(1)}
    qkv = [f"model.layers.0.self_attn.{p}_proj.weight" for p in ("q", "k", "v")]
    groups = [qkv] + [[n] for n in specs if n not in qkv]
    return VllmSpecs.from_specs(specs, groups, {})


def manifest_of(names: list[str], accepts: dict[str, TensorSpec]) -> BucketManifest:
    return plan_buckets([accepts[n] for n in names], bucket_size_bytes=1 << 20)


def test_stacks_are_accepted_beside_the_per_expert_names() -> None:
    vs = moe_model_specs()
    stacked, _ = fuse_specs(list(vs.specs.values()))
    assert set(vs.accepts) == set(vs.specs) | {s.name for s in stacked}
    stack = vs.accepts["model.layers.0.mlp.experts.down_proj.weight"]
    assert stack.shape == (EXPERTS, *vs.specs["model.layers.0.mlp.experts.0.down_proj.weight"].shape)


def test_unstack_gives_each_expert_its_row_as_a_view_and_only_the_held_ones() -> None:
    vs = moe_model_specs()
    name = "model.layers.0.mlp.experts.gate_proj.weight"
    stack = torch.randn(vs.accepts[name].shape)
    out = vs.unstack([(name, stack), ("model.norm.weight", torch.ones(1))])
    assert [n for n, _ in out] == [f"model.layers.0.mlp.experts.{e}.gate_proj.weight" for e in range(EXPERTS)] + ["model.norm.weight"]
    assert all(t.data_ptr() == stack[e].data_ptr() and torch.equal(t, stack[e]) for e, (_, t) in enumerate(out[:EXPERTS]))
    held = {"model.layers.0.mlp.experts.1.gate_proj.weight"}
    assert [n for n, _ in vs.unstack([(name, stack)], held)] == sorted(held)


def test_a_stack_beside_its_expert_or_half_a_stacked_group_is_named() -> None:
    vs = moe_model_specs()
    both = manifest_of(["model.layers.0.mlp.experts.up_proj.weight", "model.layers.0.mlp.experts.2.up_proj.weight"], vs.accepts)
    assert vs.stacked_whole(both) == [
        "model.layers.0.mlp.experts.up_proj.weight: sent both stacked and as expert 'model.layers.0.mlp.experts.2.up_proj.weight'; send one or the other"
    ]
    half = manifest_of(["model.layers.0.self_attn.q_proj.weight"], vs.accepts)
    assert vs.stacked_whole(half) == [
        "model.layers.0.self_attn.k_proj.weight, model.layers.0.self_attn.v_proj.weight: vLLM stacks these with "
        "model.layers.0.self_attn.q_proj.weight; send all of them or none"
    ]
    assert vs.stacked_whole(manifest_of(list(vs.specs), vs.accepts)) == []


def test_needed_is_the_untied_specs_made_once() -> None:
    """`needed` drops a tied head and is built once per model: a peer pull's offer check asked for
    it per tensor, and rebuilding it each time made that check quadratic (~5 s at 9,435 tensors)."""
    specs = {s.name: s for s in moe_specs(1)}
    head = TensorSpec("lm_head.weight", "bfloat16", (8, 4))
    vs = VllmSpecs.from_specs({**specs, head.name: head}, [], {head.name: "model.embed_tokens.weight"})
    assert set(vs.needed) == set(specs) - {head.name}
    assert vs.needed is vs.needed
