"""Fused experts on the wire: a layer's routed experts as one stacked tensor per projection.

A MoE checkpoint names every expert's matrices apart; an engine that holds them fused (vLLM's
`w13_weight` / `w2_weight`, the reference receiver with `fused_experts`) keeps one tensor per
layer and projection, experts along dim 0. Sending the stack (`...mlp.experts.gate_proj.weight`)
makes a Kimi-K2 sync ~1,000 tensors instead of ~70,000. Below the planner the stack is an
ordinary tensor (buckets, regions along any dim, patches, checksums).

Per-expert names stay the contract: only a source wrapped in `FusedExpertSource` sends stacks, and
only engines that hold them accept that manifest. A pure function of the specs.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from ckpt_engine.manifest import TensorSpec
from ckpt_engine.planning.regions import ReceivePlan, Region

__all__ = ["FusedExperts", "FusedGroup", "fuse_plan", "fuse_specs", "fused_name"]

_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<index>\d+)\.(?P<leaf>.+)$")
_STACK = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<leaf>\D.*)$")


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


def fuse_plan(plan: ReceivePlan, specs: Sequence[TensorSpec]) -> ReceivePlan:
    """`plan`, stated in per-expert names (what an engine that loads experts apart records, vLLM),
    restated for the stacks among `specs` (a sync from `FusedExpertSource`); a plan without
    per-expert names, or specs without stacks, come back as they are. Controller and receiver both
    call it, so they cut the same pieces.

    Per stack: no expert held -> absent; every expert whole -> whole; every expert the same
    regions (tensor parallelism cuts each alike) -> those regions one dimension down; experts
    either whole or absent (expert parallelism) -> their index ranges along dim 0; anything else
    -> the whole stack (correct, more bytes: the engine's loader narrows each expert itself)."""
    holds = dict(plan.holds)
    changed = False
    for spec in specs:
        m = _STACK.match(spec.name)
        if m is None or spec.name in holds or not spec.shape:
            continue
        members = [f"{m['prefix']}.{e}.{m['leaf']}" for e in range(spec.shape[0])]
        if not any(n in holds for n in members):
            continue
        changed = True
        entries = [holds.pop(n, ()) for n in members]  # () marks an expert the rank does not hold
        if all(rs is None for rs in entries):
            holds[spec.name] = None
        elif entries[0] and all(rs == entries[0] for rs in entries):
            holds[spec.name] = tuple(Region(r.dim + 1, r.start, r.length) for r in entries[0])
        elif all(rs is None or rs == () for rs in entries):
            ranges: list[Region] = []
            for e, rs in enumerate(entries):
                if rs is None:
                    if ranges and ranges[-1].start + ranges[-1].length == e:
                        ranges[-1] = Region(0, ranges[-1].start, ranges[-1].length + 1)
                    else:
                        ranges.append(Region(0, e, 1))
            holds[spec.name] = tuple(ranges)
        else:
            holds[spec.name] = None
    return ReceivePlan(holds) if changed else plan
