"""Which one setting would make this sync faster: try each single change, rank by the gain.

Each candidate is a flag the user can pass to the planner; the planner predicts the changed
set-up and keeps the ones that help. Each one says whether ckpt-engine runs it and, when it does,
which `checkpoint_engine` setting turns it on, so the advice maps onto a config.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ckpt_engine.plan.cost import predict
from ckpt_engine.plan.params import Calibration
from ckpt_engine.plan.scenario import Scenario

__all__ = ["STATUS", "Advice", "advise"]

STATUS: dict[str, str] = {
    "single": "runs today: checkpoint_engine.senders=rank0",
    "all-senders": (
        "runs today: checkpoint_engine.senders=all (or auto, the default, with a sharded source: FSDP2, Megatron-FSDP2, "
        "Megatron); nccl, gloo, hccl and nccl_handoff; into vLLM and the reference receiver, not SGLang"
    ),
    "delta": (
        "runs today: checkpoint_engine.delta=on, or auto (patches only while the last syncs on that transport show they "
        "beat a dense sync); nccl, gloo, hccl; into vLLM and the reference receiver, not SGLang"
    ),
    "bucket_mb": "runs today: checkpoint_engine.bucket_size_mb",
    "buffers": "runs today: checkpoint_engine.num_buffers",
    "fused_experts": (
        "runs today: FusedExpertSource (one sender) into engines that hold experts stacked (the reference receiver with "
        "fused_experts=1); vLLM and SGLang take per-expert names"
    ),
    "receive_shard": (
        "runs today: engines state receive plans (vLLM records them from its loader, the reference receiver from its TP/EP "
        "layout), 8 receiver sets side by side (more with checkpoint_engine.region_slot_memory_mb); SGLang receives whole "
        "tensors"
    ),
    "fp8": (
        "runs today: checkpoint_engine.wire_dtype=fp8 (block-FP8 quantized on the trainer's GPU, 128 x 128 blocks, float32 "
        "scales) into engines holding an FP8 checkpoint's layout; tested on the reference receiver (docs/fp8.md)"
    ),
    "parallel_sets": (
        "runs today: checkpoint_engine.region_slot_memory_mb, the sender's slot memory for receiver sets side by side "
        "(sets = budget // (num_buffers x bucket), at least 1; unset: 8)"
    ),
}
"""What ckpt-engine does with each planner setting; `bench/plan/kimi_k2_goal.py` prints the same."""


@dataclass(frozen=True)
class Advice:
    """One single-setting change and the total it predicts."""

    flag: str
    total_s: float
    speedup: float
    status: str


def _candidates(sc: Scenario) -> list[tuple[str, dict[str, Any], str]]:
    """(flag, scenario changes, what ckpt-engine runs of it) for each single change."""
    out: list[tuple[str, dict[str, Any], str]] = []
    if sc.strategy == "single":
        out.append(("--strategy all-senders", {"strategy": "all-senders"}, STATUS["all-senders"]))
    for mb in (sc.bucket_mb / 4, sc.bucket_mb * 4):
        if mb >= 1:
            out.append((f"--bucket-mb {mb:g}", {"bucket_mb": mb}, STATUS["bucket_mb"]))
    if sc.buffers < 3:
        out.append(("--buffers 3", {"buffers": 3}, STATUS["buffers"]))
    if sc.delta is None:
        out.append(("--delta 0.02", {"delta": 0.02}, STATUS["delta"]))
    if not sc.fused_experts:
        out.append(("--fused-experts", {"fused_experts": True}, STATUS["fused_experts"]))
    if sc.receive == "full":
        out.append(("--receive shard", {"receive": "shard"}, STATUS["receive_shard"]))
    gpus = sc.setup().rollout.gpus_per_engine
    if sc.receive == "shard" and gpus > sc.parallel_sets:
        budget = gpus * sc.buffers * sc.bucket_mb
        out.append((f"--parallel-sets {gpus}", {"parallel_sets": gpus}, f"{STATUS['parallel_sets']}; here region_slot_memory_mb={budget:g}"))
    if sc.dtype != "fp8":
        out.append(("--dtype fp8", {"dtype": "fp8"}, STATUS["fp8"]))
    return out


def advise(sc: Scenario, cal: Calibration, top: int = 3) -> list[Advice]:
    """The ``top`` single changes that shorten the predicted sync most (at least 2 %)."""
    base = predict(sc.setup(), cal).total_s
    found = []
    for flag, changes, status in _candidates(sc):
        try:
            total = predict(replace(sc, **changes).setup(), cal).total_s
        except ValueError:
            continue  # a change that does not apply to this set-up
        if total < base * 0.98:
            found.append(Advice(flag, total, base / total, status))
    return sorted(found, key=lambda a: a.total_s)[:top]
