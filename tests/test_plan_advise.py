"""Advice: the single changes that make a predicted sync faster, ranked, each really faster."""

from __future__ import annotations

from dataclasses import replace

from ckpt_engine.plan.advise import STATUS, advise
from ckpt_engine.plan.cost import predict
from ckpt_engine.plan.params import load_calibration
from ckpt_engine.plan.scenario import Scenario

CAL = load_calibration()


def test_nic_bound_single_sender_is_told_to_use_all_senders() -> None:
    sc = Scenario(model="qwen3-235b-a22b", trainer="64xH20:tp=4,pp=4,ep=4", rollout="8x8xH20", nic_gbps=400)
    hints = advise(sc, CAL, top=10)
    assert hints[0].flag == "--strategy all-senders" and hints[0].status == STATUS["all-senders"]
    assert "senders=all" in hints[0].status
    base = predict(sc.setup(), CAL).total_s
    assert [h.total_s for h in hints] == sorted(h.total_s for h in hints)
    assert all(h.total_s < base * 0.98 for h in hints)
    assert hints[0].total_s == predict(replace(sc, strategy="all-senders").setup(), CAL).total_s


def test_loader_bound_moe_sync_is_told_to_fuse_experts() -> None:
    sc = Scenario(model="kimi-k2", dtype="fp8", trainer="256xH20", rollout="16x16xH20", nic_gbps=400, strategy="all-senders", export="host")
    assert predict(sc.setup(), CAL).bottleneck == "load"
    flags = [h.flag for h in advise(sc, CAL)]
    assert flags[0] == "--fused-experts"


def test_shard_receive_into_wide_engines_is_told_the_slot_memory_for_all_sets() -> None:
    sc = Scenario(model="kimi-k2", trainer="256xH800", rollout="8x32xH800", nic_gbps=400, strategy="all-senders", fused_experts=True, receive="shard")
    hint = next(h for h in advise(sc, CAL, top=10) if h.flag.startswith("--parallel-sets"))
    assert hint.flag == "--parallel-sets 32" and hint.speedup > 2
    assert hint.status.startswith("runs today: checkpoint_engine.region_slot_memory_mb")
    assert hint.status.endswith("here region_slot_memory_mb=65536")  # 32 sets x 2 buffers x 1 GiB
    assert not any(h.flag.startswith("--parallel-sets") for h in advise(replace(sc, parallel_sets=32), CAL, top=10))
