"""A tensor- and expert-parallel engine rank's receive plan, derived from HF names and shapes.

What a Megatron-style TP rank of a Qwen2 / Qwen3 / Qwen3-MoE (Qwen2-MoE, Llama) decoder keeps:
column-parallel matrices (q/k/v, gate/up, embed_tokens, lm_head, their biases) cut along dim 0,
row-parallel ones (o_proj, down_proj) along dim 1, everything else whole. Under GQA with more TP
ranks than KV heads each KV head is held by tp / kv ranks. With expert parallelism an expert is
held whole by the one EP rank owning it (contiguous blocks), else TP-sliced like a dense MLP;
stacked experts (`fused_experts.py`) follow the same rules one dimension down. A block-FP8
`_scale_inv` follows its weight (`fp8/regions.py`); unknown names are held whole.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence

from ckpt_engine.fp8.layout import weight_of
from ckpt_engine.fp8.regions import fit_scales
from ckpt_engine.manifest import TensorSpec
from ckpt_engine.planning.regions import ReceivePlan, Region

__all__ = ["tp_ep_plan"]

logger = logging.getLogger(__name__)

_EXPERT = re.compile(r"\.experts\.(\d+)\.")
_STACKED = re.compile(r"\.experts\.[^.\d][^.]*\.weight$")
_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")
_ROW = ("o_proj", "down_proj")
_KV = ("k_proj", "v_proj")


def _even(size: int, parts: int, rank: int) -> Region | None:
    """Rank's block of `size` cut into `parts` (ceil-sized blocks, the last may be short or empty)."""
    per = -(-size // parts)
    start = min(size, rank * per)
    length = min(size, start + per) - start
    return Region(0, start, length) if length > 0 else None


def _kv_region(rows: int, num_kv_heads: int, tp_size: int, tp_rank: int) -> Region:
    """K/V rows of this rank: its share of the KV heads, or (tp > heads) the one head it repeats."""
    head_dim = rows // num_kv_heads
    if tp_size >= num_kv_heads:
        head = tp_rank * num_kv_heads // tp_size
        return Region(0, head * head_dim, head_dim)
    per = num_kv_heads // tp_size
    return Region(0, tp_rank * per * head_dim, per * head_dim)


def tp_ep_plan(
    specs: Sequence[TensorSpec],
    *,
    tp_size: int = 1,
    tp_rank: int = 0,
    ep_size: int = 1,
    ep_rank: int = 0,
    num_kv_heads: int | None = None,
    num_experts: int | None = None,
) -> ReceivePlan | None:
    """The regions TP rank `tp_rank` / EP rank `ep_rank` holds of `specs` (None: everything, whole).

    `num_kv_heads`: needed when TP cuts K/V (GQA); `num_experts`: defaults to one past the highest
    expert index in the names."""
    for what, size, rank in (("tp", tp_size, tp_rank), ("ep", ep_size, ep_rank)):
        if not isinstance(size, int) or size < 1 or not isinstance(rank, int) or not 0 <= rank < size:
            raise ValueError(f"{what}_size must be an int >= 1 and {what}_rank in [0, {what}_size), got {size!r} / {rank!r}")
    if tp_size == 1 and ep_size == 1:
        return None
    if num_experts is None:
        found = [int(m.group(1)) for s in specs if (m := _EXPERT.search(s.name))]
        found += [s.shape[0] - 1 for s in specs if _STACKED.search(s.name) and len(s.shape) == 3]
        num_experts = max(found) + 1 if found else 0
    if ep_size > 1 and (num_experts < ep_size or num_experts % ep_size):
        raise ValueError(f"ep_size={ep_size} must divide the number of experts ({num_experts})")
    holds: dict[str, tuple[Region, ...] | None] = {}
    unknown: list[str] = []
    for spec in specs:
        name, shape = spec.name, spec.shape
        expert = _EXPERT.search(name)
        if expert is not None and ep_size > 1:
            if int(expert.group(1)) // (num_experts // ep_size) == ep_rank:
                holds[name] = None
            continue
        if _STACKED.search(name) and len(shape) == 3:
            stacked = _stacked_region(name, shape, tp_size, tp_rank, ep_size, ep_rank)
            if stacked is not None:
                holds[name] = stacked if stacked else None
            continue
        if tp_size == 1 or not shape:
            holds[name] = None
            continue
        parts = name.split(".")
        module, leaf = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", name)
        region: Region | None
        if module in _KV and num_kv_heads is not None and num_kv_heads % tp_size and tp_size % num_kv_heads:
            raise ValueError(f"{name}: tp_size={tp_size} and {num_kv_heads} KV heads do not divide one another")
        if module in _KV and num_kv_heads is not None and leaf in ("weight", "bias"):
            region = _kv_region(shape[0], num_kv_heads, tp_size, tp_rank)
        elif module in _COLUMN and leaf in ("weight", "bias"):
            region = _even(shape[0], tp_size, tp_rank)
        elif module in _ROW and leaf == "weight" and len(shape) == 2:
            r = _even(shape[1], tp_size, tp_rank)
            region = Region(1, r.start, r.length) if r is not None else None
        else:
            if module not in _ROW and "norm" not in name and module not in ("gate", "shared_expert_gate"):
                unknown.append(name)
            holds[name] = None
            continue
        if region is not None:
            holds[name] = (region,)
    fit_scales(specs, holds)  # a block-FP8 weight's scales follow its slice, in whole blocks
    unknown = [n for n in unknown if weight_of(n) is None]
    if unknown:
        logger.info("tp_ep_plan: %d tensor(s) no rule slices are held whole (first: %s)", len(unknown), unknown[0])
    return ReceivePlan(holds)


def _stacked_region(
    name: str, shape: tuple[int, ...], tp_size: int, tp_rank: int, ep_size: int, ep_rank: int,
) -> tuple[Region, ...] | None:
    """The regions of one stacked expert tensor ((): whole; None: not held)."""
    if ep_size > 1:
        per = shape[0] // ep_size
        return (Region(0, ep_rank * per, per),)
    if tp_size == 1:
        return ()
    module = name.split(".")[-2]
    dim = 1 if module in _COLUMN else 2 if module in _ROW else None
    if dim is None:
        return ()
    r = _even(shape[dim], tp_size, tp_rank)
    return (Region(dim, r.start, r.length),) if r is not None else None
