"""What ckpt-engine plan says 1T parameters (Kimi-K2 shapes) need to sync in < 5 s dense and
< 1 s delta on 256 H800-class GPUs at 400 Gb/s per GPU. Writes bench/plan/kimi_k2_goal.md.

    python bench/plan/kimi_k2_goal.py
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ckpt_engine.plan.advise import STATUS
from ckpt_engine.plan.cost import PARALLEL_SETS, predict
from ckpt_engine.plan.params import load_calibration
from ckpt_engine.plan.scenario import Scenario

BASE = Scenario(model="kimi-k2", trainer="256xH800", rollout="8x32xH800", nic_gbps=400, bucket_mb=1024, loader="vllm")

ROWS = [
    ("dense, single sender, vLLM load_weights", {}),
    ("dense, all senders, vLLM load_weights", {"strategy": "all-senders"}),
    ("dense, all senders, fused experts", {"strategy": "all-senders", "fused_experts": True}),
    ("dense, all senders, fused experts, FP8 wire", {"strategy": "all-senders", "fused_experts": True, "dtype": "fp8", "rollout": "16x16xH800"}),
    ("dense, all senders, fused experts, shard receive", {"strategy": "all-senders", "fused_experts": True, "receive": "shard"}),
    ("dense, all senders, fused experts, shard receive, 32 sets side by side", {"strategy": "all-senders", "fused_experts": True, "receive": "shard", "parallel_sets": 32}),
    ("delta 2 %, single sender", {"delta": 0.02}),
    ("delta 2 %, all senders, vLLM load_weights", {"strategy": "all-senders", "delta": 0.02}),
    ("delta 2 %, all senders, fused experts", {"strategy": "all-senders", "delta": 0.02, "fused_experts": True}),
    ("delta 2 %, all senders, fused experts, shard receive", {"strategy": "all-senders", "delta": 0.02, "fused_experts": True, "receive": "shard"}),
    ("delta 2 %, all senders, fused experts, shard receive, 32 sets side by side", {"strategy": "all-senders", "delta": 0.02, "fused_experts": True, "receive": "shard", "parallel_sets": 32}),
    ("delta 1 %, all senders, fused experts", {"strategy": "all-senders", "delta": 0.01, "fused_experts": True}),
]


def _today(sc: Scenario) -> str:
    """What ckpt-engine runs of this row's settings (the planner's advice says the same)."""
    keys = [sc.strategy]
    keys += ["delta"] if sc.delta is not None else []
    keys += ["fused_experts"] if sc.fused_experts else []
    keys += ["fp8"] if sc.dtype == "fp8" else []
    keys += ["receive_shard"] if sc.receive == "shard" else []
    keys += ["parallel_sets"] if sc.parallel_sets != PARALLEL_SETS else []
    return "; ".join(f"{k.replace('_', ' ')}: {STATUS[k]}" for k in keys)


def main() -> None:
    cal = load_calibration()
    lines = [
        "<!-- written by `python bench/plan/kimi_k2_goal.py`; do not edit by hand -->",
        "",
        "Trainer 256xH800 (FSDP, 256 shards), NIC 400 Gb/s per GPU, NVLink 200 GB/s per direction, 1 GiB buckets, 2 buffers;",
        "rollout 8 engines x 32 H800 for bf16 (2.05 TB; 64 GiB per GPU), 16 x 16 for FP8 (1.03 TB); vLLM-style receivers.",
        "",
        "| setting | wire GB | tensors | export s | transfer s | load s | total s | bottleneck | goal | in ckpt-engine today |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, changes in ROWS:
        sc = replace(BASE, **changes)
        setup = sc.setup()
        p = predict(setup, cal)
        goal = 1.0 if sc.delta is not None else 5.0
        met = "**met**" if p.total_s < goal else "no"
        lines.append(
            f"| {label} | {p.wire_bytes / 1e9:,.0f} | {setup.model.num_tensors:,} | {p.stages['export']:.2f} | {p.stages['transfer']:.2f} | "
            f"{p.stages['load']:.2f} | {p.total_s:.2f} | {p.bottleneck} | < {goal:g} s: {met} | {_today(sc)} |"
        )
    out = Path(__file__).with_name("kimi_k2_goal.md")
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
