"""The export plan of a Hugging Face causal LM sharded per decoder layer (FSDP2, Megatron-FSDP2).

Both engines shard the same way (one unit per decoder layer, the root holding embeddings, final
norm and head) and export the same thing: every tensor the rollout needs, in HF state-dict order,
under its checkpoint name, fused MoE experts unfused into one wire tensor per expert. One plan, so
the two engines cannot drift apart in naming, order or wire dtypes. Pure: no collective.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from ckpt_engine.manifest import TensorSpec
from ckpt_engine.sources.hf_names import clean_name, has_unhandled_fused_experts, unfuse_expert_specs, unfuse_experts
from ckpt_engine.sources.wire import WirePolicy, dtype_name, torch_dtype

__all__ = ["ExportEntry", "emit_entry", "plan_export"]


@dataclass
class ExportEntry:
    """One exported parameter or buffer: where it lives and what it becomes on the wire."""

    unit: int  # index into the engine's units (0: the root, i + 1: decoder layer i)
    module: nn.Module
    attr: str
    is_buffer: bool
    name: str  # HF name before expert unfusing
    shape: tuple[int, ...]
    dtype: torch.dtype  # master dtype
    specs: list[TensorSpec] = field(default_factory=list)  # what goes on the wire (1, or one per expert part)
    expert_outputs: int = 0  # fused experts: wire tensors per expert (0: not a fused expert)


def plan_export(
    model: nn.Module, layers: list[nn.Module], *, model_type: str, wire: WirePolicy, buffers: bool, tied_head: bool, who: str,
) -> list[ExportEntry]:
    """Every tensor the rollout needs, in HF state-dict order, with its owning unit.

    `buffers`: export persistent buffers too (else a model that has one is refused, naming it and
    `who`, the engine that cannot export it). A parameter shared under two names is exported under
    the first (HF checkpoints hold the first name only); `tied_head` drops `lm_head.weight`.
    """
    unit_of = {id(m): i + 1 for i, m in enumerate(layers)}
    entries: list[ExportEntry] = []
    persistent: list[str] = []
    seen: set[int] = set()

    def walk(module: nn.Module, prefix: str, unit: int) -> None:
        unit = unit_of.get(id(module), unit)
        for attr, p in module._parameters.items():
            if p is None or id(p) in seen:
                continue  # tied weights: HF checkpoints hold the first name only
            seen.add(id(p))
            entries.append(ExportEntry(unit, module, attr, False, clean_name(prefix + attr), tuple(p.shape), p.dtype))
        for attr, b in module._buffers.items():
            if b is None or attr in module._non_persistent_buffers_set or id(b) in seen:
                continue
            seen.add(id(b))
            if buffers:
                entries.append(ExportEntry(unit, module, attr, True, clean_name(prefix + attr), tuple(b.shape), b.dtype))
            else:
                persistent.append(prefix + attr)
        for child_name, child in module._modules.items():
            if child is not None:
                walk(child, f"{prefix}{child_name}.", unit)

    walk(model, "", 0)
    if persistent:
        raise ValueError(f"{type(model).__name__} has persistent buffers ({persistent[0]}, ...): {who} export covers parameters only")
    if tied_head:
        entries = [e for e in entries if e.name != "lm_head.weight"]
    unhandled = has_unhandled_fused_experts(model_type, [e.name for e in entries])
    if unhandled:
        raise ValueError(
            f"cannot export fused MoE experts of model_type {model_type!r} (e.g. {unhandled[0]}): "
            "add a FusedExpertRule for it in ckpt_engine/sources/hf_names.py"
        )
    for e in entries:
        parts = unfuse_expert_specs(model_type, e.name, e.shape)
        pairs = parts if parts is not None else [(e.name, e.shape)]
        e.expert_outputs = len(parts) // e.shape[0] if parts is not None and e.shape[0] else 0
        e.specs = [TensorSpec(n, dtype_name(wire.dtype_for(n, e.dtype)), s) for n, s in pairs]
    names = [s.name for e in entries for s in e.specs]
    if len(set(names)) != len(names):
        raise ValueError(f"{type(model).__name__}: exported names are not unique after removing wrapper prefixes")
    return entries


def emit_entry(model_type: str, e: ExportEntry, t: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """`e`'s full tensor `t` as its wire tensors: unfused per expert, each in its wire dtype."""
    parts = unfuse_experts(model_type, e.name, t)
    for spec, (name, part) in zip(e.specs, parts if parts is not None else [(e.specs[0].name, t)]):
        dt = torch_dtype(spec.dtype)
        yield name, part if part.dtype == dt else part.to(dt)
