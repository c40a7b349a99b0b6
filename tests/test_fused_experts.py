"""Fused experts on the wire: each layer's experts travel as one stacked tensor per projection into
reference engines that hold them stacked (as vLLM's w13/w2), as EP=2 and TP=2 ranks: every rank
holds exactly its slice of every stack after a dense and two patch syncs; an engine that wants
per-expert names refuses the stacked manifest by name before anything pauses."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckpt_engine import CheckpointEngineConfig, WeightSyncSession
from ckpt_engine.manifest import TensorSpec
from ckpt_engine.planning.fused_experts import fuse_plan, fuse_specs
from ckpt_engine.planning.receive_sets import cut_region
from ckpt_engine.planning.regions import ReceivePlan, Region
from ckpt_engine.planning.tp_ep import tp_ep_plan
from ckpt_engine.rollout_adapters.base import ManifestRejectedError
from ckpt_engine.rollout_adapters.torch_ref import TorchRefRollout, write_spec_file
from ckpt_engine.sources.base import StateDictSource
from ckpt_engine.sources.fused_experts import FusedExpertSource
from refengines import same_bits, spawn_engine
from regionranks import EXPERTS, HIDDEN, INTER, moe_specs, weights

CFG = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.0625, timeout_s=30, delta="on")
GATE = "model.layers.1.mlp.experts.gate_proj.weight"
DOWN = "model.layers.1.mlp.experts.down_proj.weight"


def _stacked(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The weights as the wire carries them with fused experts."""
    _, fused = fuse_specs([TensorSpec(n, "float32", tuple(t.shape)) for n, t in w.items()])
    out = {n: t for n, t in w.items() if n not in fused.member_of}
    out.update({n: torch.stack([w[m] for m in g.members]) for n, g in fused.groups.items()})
    return out


def test_fuse_specs_stacks_each_layers_experts_in_place_of_the_last() -> None:
    specs = moe_specs()
    fused, mapping = fuse_specs(specs)
    assert len(specs) - len(fused) == 2 * 3 * (EXPERTS - 1)  # 2 layers x 3 projections
    by_name = {s.name: s for s in fused}
    assert by_name[GATE].shape == (EXPERTS, INTER // 2, HIDDEN) and by_name[DOWN].shape == (EXPERTS, HIDDEN, INTER // 2)
    assert mapping.member_of["model.layers.1.mlp.experts.3.down_proj.weight"] == (DOWN, 3)
    names = [s.name for s in fused]
    assert names.index("model.layers.1.mlp.gate.weight") < names.index(GATE) < names.index(DOWN) < names.index("model.norm.weight")
    # a gap in the expert numbers (or shapes that differ) keeps per-expert tensors
    gappy = [s for s in specs if ".experts.2." not in s.name]
    assert fuse_specs(gappy)[0] == gappy


def test_source_yields_stacks_in_metadata_order() -> None:
    w = weights(moe_specs(), 0)
    source = FusedExpertSource(StateDictSource(w))
    got = list(source.iter_weights())
    assert [n for n, _ in got] == [s.name for s in source.metadata()]
    want = _stacked(w)
    assert all(same_bits(t, want[n]) for n, t in got)


def test_stacked_plans_cut_experts_for_ep_and_rows_or_columns_for_tp() -> None:
    fused, _ = fuse_specs(moe_specs())
    ep1 = tp_ep_plan(fused, ep_size=2, ep_rank=1)
    assert ep1 is not None and ep1.holds[GATE] == (Region(0, EXPERTS // 2, EXPERTS // 2),) and ep1.holds[DOWN] == (Region(0, 2, 2),)
    tp1 = tp_ep_plan(fused, tp_size=2, tp_rank=1, num_kv_heads=2)
    assert tp1 is not None and tp1.holds[GATE] == (Region(1, INTER // 4, INTER // 4),) and tp1.holds[DOWN] == (Region(2, INTER // 4, INTER // 4),)


@pytest.mark.parametrize("layout", [{"ep_size": 2, "ep_rank": 1}, {"tp_size": 2, "tp_rank": 1, "num_kv_heads": 2}, {"tp_size": 2, "tp_rank": 0, "num_kv_heads": 2}])
def test_a_per_expert_plan_restated_for_stacks_is_the_stacked_plan(layout: dict[str, int]) -> None:
    """What vLLM records (per-expert names) meets a stacked sync: `fuse_plan` gives the plan an
    engine holding the stacks would state, so both ends cut the same pieces."""
    specs = moe_specs()
    fused, _ = fuse_specs(specs)
    apart, together = tp_ep_plan(specs, **layout), tp_ep_plan(fused, **layout)
    assert apart is not None and together is not None
    assert fuse_plan(apart, fused) == together
    assert fuse_plan(apart, specs) is apart  # no stacks in the sync: unchanged
    # experts held in pieces that are neither alike nor whole: the whole stack (the loader narrows)
    odd = dict(apart.holds)
    first = "model.layers.1.mlp.experts.0.gate_proj.weight"
    odd[first] = (Region(0, 0, 1),)
    assert fuse_plan(ReceivePlan(odd), fused).holds[GATE] is None


def _wrong(engine: TorchRefRollout, w: dict[str, torch.Tensor]) -> list[str]:
    (plan,) = engine.receive_plans()
    assert plan is not None
    return [
        n for n, rs in plan.holds.items() if not same_bits(engine.get_tensor(n), cut_region(w[n], rs[0] if rs is not None else None).contiguous())
    ]


@pytest.mark.parametrize("kind", ["ep", "tp"])
def test_stacked_experts_reach_ep_and_tp_ranks_bit_exact_dense_and_patches(kind: str, tmp_path: Path) -> None:
    specs = moe_specs()
    path = str(tmp_path / "moe.msgpack")
    write_spec_file(path, specs)
    layout = {"ep_size": 2} if kind == "ep" else {"tp_size": 2, "num_kv_heads": 2}
    engines = [
        spawn_engine(f"{kind}{r}", spec_file=path, timeout_s=60, layout={**layout, f"{kind}_rank": r, "fused_experts": 1})
        for r in range(2)
    ]
    session = WeightSyncSession(engines, CFG)
    try:
        kinds = []
        for v in range(3):
            w = weights(specs, v)
            report = session.sync(FusedExpertSource(StateDictSource(w)))
            kinds.append(report.delta)
            wire = _stacked(w)
            for e in engines:
                assert _wrong(e, wire) == [], e.name
        assert kinds == ["seed", "patch", "patch"]
        assert report.tensors == len(fuse_specs(specs)[0])
        model = sum(s.nbytes for s in specs)
        assert all(report.received_bytes[e.name][0] <= 0.75 * model for e in engines), report.received_bytes
        assert tuple(engines[1].get_tensor(GATE).shape) == ((EXPERTS // 2, INTER // 2, HIDDEN) if kind == "ep" else (EXPERTS, INTER // 4, HIDDEN))
    finally:
        session.close()
        for e in engines:
            e.close()


def test_an_engine_holding_experts_apart_refuses_stacks_before_pausing(tmp_path: Path) -> None:
    specs = moe_specs()
    path = str(tmp_path / "moe.msgpack")
    write_spec_file(path, specs)
    engine = spawn_engine("apart", spec_file=path, timeout_s=60)
    session = WeightSyncSession([engine], CFG)
    try:
        with pytest.raises(ManifestRejectedError, match="engine 'apart' rejected the manifest: .*experts.(gate|up|down)_proj.weight"):
            session.sync(FusedExpertSource(StateDictSource(weights(specs, 0))))
        h = engine.health()
        assert not h["paused"] and h["version"] is None
        assert session.sync(StateDictSource(weights(specs, 0))).tensors == len(specs)  # per-expert names as ever
    finally:
        session.close()
        engine.close()
