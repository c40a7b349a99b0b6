"""Fused experts on the wire: a layer's routed experts as one stacked tensor per projection.

A MoE checkpoint names every expert's matrices apart (`...mlp.experts.7.gate_proj.weight`); an
engine that holds them fused (vLLM's `w13_weight` / `w2_weight`, the reference receiver with
`fused_experts`) keeps one tensor per layer and projection with the experts along dim 0. Sending
the stack (`...mlp.experts.gate_proj.weight`, shape [experts, *expert shape]) makes a Kimi-K2 sync
~1,000 tensors instead of ~70,000: fewer, larger copies when packing and loading, fewer entries in
the manifest and the receive plans. The stack is an ordinary tensor to everything below (buckets,
regions along any of its dims, delta patches, checksums): an EP rank holds a dim-0 range of it,
a TP rank a range of each expert's rows (dim 1) or columns (dim 2).

Per-expert names stay the contract: only a sync whose source is wrapped in `FusedExpertSource`
(`sources/fused_experts.py`) sends stacks, and only engines that hold them accept that manifest.

A pure function of the specs: sender and receivers fuse alike.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from ckpt_engine.manifest import TensorSpec

__all__ = ["FusedExperts", "FusedGroup", "fuse_specs", "fused_name"]

_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<index>\d+)\.(?P<leaf>.+)$")


def fused_name(prefix: str, leaf: str) -> str:
    """The stacked tensor's name: the per-expert name without the expert index."""
    return f"{prefix}.{leaf}"


@dataclass(frozen=True)
class FusedGroup:
    """One stacked tensor: `members[e]` is expert e's HF name."""

    spec: TensorSpec
    members: tuple[str, ...]


@dataclass(frozen=True)
class FusedExperts:
    """Every stacked tensor of one model, and where each per-expert name goes."""

    groups: dict[str, FusedGroup]
    """Stacked name -> its group."""
    member_of: dict[str, tuple[str, int]]
    """Per-expert name -> (stacked name, expert index)."""

    def __bool__(self) -> bool:
        return bool(self.groups)


def fuse_specs(specs: Sequence[TensorSpec]) -> tuple[list[TensorSpec], FusedExperts]:
    """`specs` with each layer's experts of one projection stacked, and the mapping.

    A group is stacked when its experts are numbered 0..E-1 (E >= 2) with one dtype and shape and
    its stacked name is free; any other group keeps per-expert tensors. A stack takes the place of
    its last member, so a source that yields per-expert tensors in `specs` order yields each
    stack as soon as it is complete."""
    found: dict[str, dict[int, TensorSpec]] = {}
    for s in specs:
        m = _EXPERT.match(s.name)
        if m is not None:
            found.setdefault(fused_name(m["prefix"], m["leaf"]), {})[int(m["index"])] = s
    names = {s.name for s in specs}
    groups: dict[str, FusedGroup] = {}
    member_of: dict[str, tuple[str, int]] = {}
    for name, experts in found.items():
        first = experts.get(0)
        if (
            len(experts) < 2 or name in names or first is None or sorted(experts) != list(range(len(experts)))
            or any((e.dtype, e.shape) != (first.dtype, first.shape) for e in experts.values())
        ):
            continue
        members = tuple(experts[e].name for e in range(len(experts)))
        groups[name] = FusedGroup(TensorSpec(name, first.dtype, (len(members), *first.shape)), members)
        member_of.update({m: (name, e) for e, m in enumerate(members)})
    out: list[TensorSpec] = []
    last = {g.members[-1]: g for g in groups.values()}
    for s in specs:
        if s.name not in member_of:
            out.append(s)
        elif s.name in last:
            out.append(last[s.name].spec)
    return out, FusedExperts(groups, member_of)
