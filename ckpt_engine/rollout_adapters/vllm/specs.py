"""What a vLLM model takes from a checkpoint: names, global shapes, stacking groups, tied head, and
the stacked experts it accepts in place of per-expert tensors.

Read once per model from vLLM's own modules (`VllmSpecs.of`) and kept as one frozen object, so the
validate and receive paths of a worker never rebuild it per sync.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, cast

import torch

from ckpt_engine.manifest import BucketManifest, TensorSpec
from ckpt_engine.planning.fused_experts import FusedExperts, fuse_specs

__all__ = ["Specs", "VllmSpecs", "load_weights_of", "vllm_checkpoint_specs"]

Specs = tuple[dict[str, TensorSpec], list[list[str]], dict[str, str]]
Pairs = list[tuple[str, torch.Tensor]]
_NAME = operator.itemgetter(0)


def load_weights_of(model: torch.nn.Module) -> Callable[[Iterable[tuple[str, torch.Tensor]]], object]:
    """`model.load_weights`: every vLLM model has one (vLLM's classes are not read by the type checker)."""
    return cast(Any, model).load_weights


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def vllm_checkpoint_specs(model: torch.nn.Module) -> Specs:
    """Checkpoint-format (HF) names and global shapes of every tensor `model.load_weights` takes.

    Fused expert layers (`w13` / `w2`) take one tensor per expert, named by the layer's own
    expert mapping; all of a layer's experts form one group. Applies vLLM's stacking rules (`packed_modules_mapping`: q/k/v -> qkv_proj, gate/up ->
    gate_up_proj), undoes tensor-parallel sharding and vocab padding. With tied embeddings
    `lm_head.weight` is accepted but optional. Returns (specs, groups, tied): each group lists the
    checkpoint names that fill one vLLM parameter (a manifest must send all or none of a group, or
    layerwise reload would process a half-filled parameter); `tied` maps `lm_head.weight` to the
    embedding it shares, because layerwise reload must see the tied head loaded too.
    """
    from vllm.model_executor.layers.linear import LinearBase, QKVParallelLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", {}) or {})
    specs: dict[str, TensorSpec] = {}
    groups: list[list[str]] = []
    tied: dict[str, str] = {}
    seen: set[int] = set()
    embed_name: str | None = None
    experts_cls = _routed_experts_class()
    for mod_name, module in model.named_modules():
        if experts_cls is not None and isinstance(module, experts_cls):
            group = _expert_specs(module, specs)
            if group:
                groups.append(group)
                seen.update(id(p) for p in module.parameters(recurse=False))
                continue
        for p_name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            dtype = _dtype_name(param.dtype)
            linear = isinstance(module, LinearBase) and p_name in _LINEAR_TAKES
            block = _scale_block(module) if linear and p_name == SCALES else None
            if isinstance(module, LinearBase) and _quantizes_on_load(module):
                if p_name != "weight" and p_name != "bias":
                    continue  # scales an online-quantizing layer computes itself at the end of each load
                dtype = _dtype_name(module.orig_dtype)  # it takes the checkpoint's own (bf16) weight
            if isinstance(module, VocabParallelEmbedding):
                shape: tuple[int, ...] = (module.org_vocab_size, module.embedding_dim)
                if embed_name is None:
                    embed_name = full
            elif linear:
                shape = (module.output_size, module.input_size) if p_name != "bias" else (module.output_size,)
                if block is not None:
                    shape = (-(-module.output_size // block[0]), -(-module.input_size // block[1]))  # scales: never a bias
            else:
                shape = tuple(param.shape)
            leaf = mod_name.rsplit(".", 1)[-1]
            parent = mod_name[: -len(leaf)]
            if leaf in packed and linear:
                if isinstance(module, QKVParallelLinear):
                    sizes = [
                        module.total_num_heads * module.head_size,
                        module.total_num_kv_heads * module.head_size,
                        module.total_num_kv_heads * module.v_head_size,
                    ]
                else:
                    sizes = list(module.output_sizes)
                names = []
                for sub, rows in zip(packed[leaf], sizes):
                    name = f"{parent}{sub}.{p_name}"
                    specs[name] = TensorSpec(name, dtype, (rows if block is None else -(-rows // block[0]), *shape[1:]))
                    names.append(name)
                groups.append(names)
            else:
                specs[full] = TensorSpec(full, dtype, shape)
                groups.append([full])
    lm_head = getattr(model, "lm_head", None)
    if embed_name is not None and lm_head is not None and "lm_head.weight" not in specs:
        e = specs[embed_name]
        specs["lm_head.weight"] = TensorSpec("lm_head.weight", e.dtype, e.shape)
        tied["lm_head.weight"] = embed_name
    return specs, groups, tied


SCALES = "weight_scale_inv"
"""A block-FP8 layer's inverse scales (vLLM's `Fp8LinearMethod` with `weight_block_size`): the
checkpoint holds one per sub-weight (`q_proj.weight_scale_inv`, ...), [ceil(rows / bn), ceil(cols / bk)]."""
_LINEAR_TAKES = ("weight", "bias", SCALES)


def _scale_block(module: torch.nn.Module) -> tuple[int, int]:
    """The [bn, bk] block of a block-FP8 layer's scales (vLLM keeps it on the layer's quant method)."""
    block = cast(Any, module.quant_method).weight_block_size
    return int(block[0]), int(block[1])


def _quantizes_on_load(module: torch.nn.Module) -> bool:
    """Whether vLLM quantizes this layer on load (online FP8 of a bf16 checkpoint): its weights
    are created on the meta device and its `orig_dtype` is the checkpoint's."""
    return bool(getattr(module.quant_method, "uses_meta_device", False)) and hasattr(module, "orig_dtype")


def _routed_experts_class() -> type[torch.nn.Module] | None:
    try:
        from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    except ImportError:  # a vLLM without it: fused experts are not recognised
        return None
    return RoutedExperts


def _expert_specs(module: torch.nn.Module, specs: dict[str, TensorSpec]) -> list[str]:
    """Per-expert checkpoint names and global shapes of one fused expert layer (`w13` / `w2`),
    from the layer's own expert mapping; [] when its layout is not the plain one."""
    weights = {"w1": "w13_weight", "w3": "w13_weight", "w2": "w2_weight"}
    layer_name = getattr(module, "layer_name", "")
    base = layer_name.rpartition(".")[0]
    params = dict(module.named_parameters(recurse=False))
    if not layer_name.endswith("experts") or not {"w13_weight", "w2_weight"} <= set(params):
        return []
    experts: Any = module  # vLLM's RoutedExperts
    inter, hidden = int(experts.moe_config.intermediate_size), int(experts.hidden_size)
    names: list[str] = []
    for _, weight_name, _, shard_id in experts.get_expert_mapping():
        if shard_id not in weights or not weight_name.startswith("experts."):
            return []
        name = f"{base}.{weight_name}weight" if base else f"{weight_name}weight"
        if name in specs:
            continue  # a redundant (EPLB) copy of a logical expert
        shape = (hidden, inter) if shard_id == "w2" else (inter, hidden)
        specs[name] = TensorSpec(name, _dtype_name(params[weights[shard_id]].dtype), shape)
        names.append(name)
    return names


@dataclass(frozen=True)
class VllmSpecs:
    """One model's checkpoint contract (see `vllm_checkpoint_specs`), built once per model.

    `stacks`: the stacked expert tensors a sync from `FusedExpertSource` may send in place of each
    layer's per-expert tensors (`planning/fused_experts.py`); each loads as its experts. `accepts`:
    every name a manifest may carry (the per-expert names and the stacks)."""

    specs: dict[str, TensorSpec]
    groups: list[list[str]]
    tied: dict[str, str]
    stacks: FusedExperts
    accepts: dict[str, TensorSpec]

    @classmethod
    def of(cls, model: torch.nn.Module) -> VllmSpecs:
        return cls.from_specs(*vllm_checkpoint_specs(model))

    @classmethod
    def from_specs(cls, specs: dict[str, TensorSpec], groups: list[list[str]], tied: dict[str, str]) -> VllmSpecs:
        stacks = fuse_specs(list(specs.values()))[1]
        return cls(specs, groups, tied, stacks, {**specs, **{n: g.spec for n, g in stacks.groups.items()}})

    @functools.cached_property
    def needed(self) -> dict[str, TensorSpec]:
        """The specs a trainer must send: a tied head is the embedding's parameter. Made once: a
        loop that asked for it per tensor rebuilt it per tensor (~5 s of a 9,435-tensor peer pull)."""
        return {n: s for n, s in self.specs.items() if n not in self.tied}

    def unstack(self, pairs: Iterable[tuple[str, torch.Tensor]], held: Any = None) -> Pairs:
        """A stack's experts as the loader takes them: expert e's tensor is the stack's row e (a
        view). `held`: the per-expert names this rank's plan holds (None: every expert)."""
        groups = self.stacks.groups
        if isinstance(pairs, list) and groups.keys().isdisjoint(map(_NAME, pairs)):
            return pairs  # nothing stacked: the very list (a colocated sender's kept bucket stays itself)
        out: Pairs = []
        for name, tensor in pairs:
            g = groups.get(name)
            if g is None:
                out.append((name, tensor))
            else:
                out.extend((m, tensor[e]) for e, m in enumerate(g.members) if held is None or m in held)
        return out

    def stacked_whole(self, manifest: BucketManifest) -> list[str]:
        """Problems with `manifest` that vLLM's stacking makes: a stack sent beside its experts, or
        part of a group whose names fill one vLLM parameter."""
        stacks = self.stacks.groups
        sent = {s.name for s in manifest.specs}
        problems = [
            f"{n}: sent both stacked and as expert {m!r}; send one or the other"
            for n in sent & set(stacks) for m in stacks[n].members if m in sent
        ]
        sent |= {m for n in sent & set(stacks) for m in stacks[n].members}
        for group in self.groups:
            present = [n for n in group if n in sent]
            if present and len(present) != len(group):
                missing = [n for n in group if n not in sent]
                problems.append(f"{', '.join(missing)}: vLLM stacks these with {', '.join(present)}; send all of them or none")
        return problems
