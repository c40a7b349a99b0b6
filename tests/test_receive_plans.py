"""Receive plans as pure functions: TP/EP plans from HF names, the receiver-set layout, the pieces'
owners, a receiver's assembly of its regions, and plans refused by name."""

from __future__ import annotations

import pytest
import torch

from ckpt_engine.manifest import TensorSpec
from ckpt_engine.pipeline.region_assembly import RegionAssembly
from ckpt_engine.planning.ownership import row_shards
from ckpt_engine.planning.receive_sets import RegionLayout, cut_region
from ckpt_engine.planning.regions import ReceivePlan, ReceivePlanError, Region
from ckpt_engine.planning.tp_ep import tp_ep_plan
from regionranks import moe_specs, qwen2_specs

Q = "model.layers.0.self_attn.q_proj.weight"
K = "model.layers.0.self_attn.k_proj.weight"
O_PROJ = "model.layers.0.self_attn.o_proj.weight"


def test_tp_plan_cuts_columns_rows_and_repeats_kv_heads() -> None:
    specs = qwen2_specs()
    p0, p1 = (tp_ep_plan(specs, tp_size=2, tp_rank=r, num_kv_heads=1) for r in range(2))
    assert p0 is not None and p1 is not None
    assert p0.holds[Q] == (Region(0, 0, 32),) and p1.holds[Q] == (Region(0, 32, 32),)
    assert p0.holds["model.layers.0.self_attn.q_proj.bias"] == (Region(0, 0, 32),)
    assert p0.holds[K] == p1.holds[K] == (Region(0, 0, 16),)  # one KV head, held by both
    assert p1.holds[O_PROJ] == (Region(1, 32, 32),)
    assert p1.holds["model.layers.0.mlp.down_proj.weight"] == (Region(1, 48, 48),)
    assert p0.holds["model.norm.weight"] is None and p0.holds["model.layers.0.input_layernorm.weight"] is None
    assert p1.holds["lm_head.weight"] == (Region(0, 80, 80),)
    # 2 KV heads over 4 ranks: ranks 0, 1 hold head 0; ranks 2, 3 head 1
    kv = [tp_ep_plan([TensorSpec(K, "float32", (32, 64))], tp_size=4, tp_rank=r, num_kv_heads=2).holds[K] for r in range(4)]  # type: ignore[union-attr]
    assert kv == [(Region(0, 0, 16),)] * 2 + [(Region(0, 16, 16),)] * 2
    assert tp_ep_plan(specs) is None
    with pytest.raises(ValueError, match="tp_rank in"):
        tp_ep_plan(specs, tp_size=2, tp_rank=2)


def test_ep_plan_holds_own_experts_whole_and_nothing_else() -> None:
    specs = moe_specs()
    p1 = tp_ep_plan(specs, ep_size=2, ep_rank=1)
    assert p1 is not None
    assert "model.layers.0.mlp.experts.0.up_proj.weight" not in p1.holds
    assert p1.holds["model.layers.0.mlp.experts.3.down_proj.weight"] is None
    assert p1.holds["model.layers.0.mlp.gate.weight"] is None and p1.holds[Q] is None
    both = tp_ep_plan(specs, tp_size=2, tp_rank=1, ep_size=2, ep_rank=0, num_kv_heads=2)
    assert both is not None and both.holds[Q] == (Region(0, 32, 32),) and both.holds["model.layers.0.mlp.experts.1.up_proj.weight"] is None
    with pytest.raises(ValueError, match="must divide the number of experts"):
        tp_ep_plan(specs, ep_size=3, ep_rank=0)


def test_layout_sends_each_region_once_to_its_holders() -> None:
    specs = qwen2_specs()
    plans = [tp_ep_plan(specs, tp_size=2, tp_rank=r, num_kv_heads=1) for r in range(2)]
    lay = RegionLayout.build(specs, plans)
    assert [s.members for s in lay.sets] == [(0,), (1,), (0, 1)]
    shared = {p.spec.name for p in lay.sets[2].pieces}
    assert K in shared and "model.norm.weight" in shared and "model.layers.0.self_attn.o_proj.bias" not in shared
    assert f"{Q}@0:0:32" in {p.spec.name for p in lay.sets[0].pieces}
    model = sum(s.nbytes for s in specs)
    assert all(lay.bytes_for(r) <= 0.55 * model for r in range(2))
    assert lay.bytes_for(0) + lay.bytes_for(1) - lay.sets[2].nbytes == model  # every byte travels once
    assert RegionLayout.build(specs, plans).digest == lay.digest


def test_plans_are_refused_by_name() -> None:
    specs = qwen2_specs()
    good = tp_ep_plan(specs, tp_size=2, tp_rank=0, num_kv_heads=1)
    assert good is not None
    cases = [
        ({Q: (Region(0, 48, 32),)}, f"receiver rank 1: receive plan: region \\[48, 80\\) of '{Q}' lies outside dimension 0 of size 64"),
        ({Q: (Region(0, 0, 32), Region(0, 16, 8))}, f"regions of '{Q}' overlap"),
        ({"model.layers.9.mlp.up_proj.weight": None}, "names tensor 'model.layers.9.mlp.up_proj.weight', which this sync does not carry"),
        ({Q: (Region(2, 0, 1),)}, f"'{Q}' has no dimension 2"),
    ]
    for holds, match in cases:
        with pytest.raises(ReceivePlanError, match=match):
            RegionLayout.build(specs, [good, ReceivePlan(holds)])
    with pytest.raises(ReceivePlanError, match="must be \\[dim, start, length\\] ints"):
        ReceivePlan.from_wire({Q: [[0, 1]]})
    assert ReceivePlan.from_wire(good.to_wire()) == good


def test_a_full_receiver_beside_tp_ranks_assembles_whole_tensors() -> None:
    specs = qwen2_specs()
    plans = [tp_ep_plan(specs, tp_size=2, tp_rank=r, num_kv_heads=1) for r in range(2)] + [None]
    lay = RegionLayout.build(specs, plans)
    by_name = {s.name: s for s in specs}
    w = {s.name: torch.randn(s.shape) for s in specs}
    for r in range(3):
        asm = RegionAssembly(lay.held[r], (p for s in lay.sets_of(r) for p in s.pieces), by_name)
        landing = asm.start(None)
        got = {}
        for s in lay.sets_of(r):
            for p in s.pieces:
                for name, region, t in landing.land(p.spec.name, cut_region(w[p.name], p.region).contiguous()):
                    got[(name, region)] = t
        assert set(got) == {(n, reg) for n, rs in lay.held[r].items() for reg in rs}
        assert all(torch.equal(t, cut_region(w[n], reg)) for (n, reg), t in got.items())
    assert lay.bytes_for(2) == sum(s.nbytes for s in specs)


def test_pieces_that_only_partly_cover_a_held_region_are_refused() -> None:
    """Issue 45: a region counted as covered when any piece overlapped it. A rank that holds q_proj
    whole but is sent the pieces of a plan saying rows [32, 64), or a region with a hole between
    its pieces, is refused naming the tensor and the rows no piece fills; pieces that tile a
    region exactly (two TP halves into one whole tensor) are accepted."""
    specs = qwen2_specs()
    by_name = {s.name: s for s in specs}
    whole = {s.name: (None,) for s in specs}

    def pieces(plan: ReceivePlan) -> list:  # type: ignore[type-arg]
        lay = RegionLayout.build(specs, [plan])
        return [p for s in lay.sets_of(0) for p in s.pieces]

    claimed = ReceivePlan({**dict.fromkeys(whole), Q: (Region(0, 32, 32),)})
    with pytest.raises(ReceivePlanError, match=rf"^{Q}: the pieces this receiver takes do not cover the whole tensor: rows \[0, 32\) of dim 0 \(1 gap"):
        RegionAssembly(whole, pieces(claimed), by_name)
    holed = ReceivePlan({**dict.fromkeys(whole), Q: (Region(0, 0, 16), Region(0, 48, 16))})
    with pytest.raises(ReceivePlanError, match=rf"^{Q}: .* do not cover region \[0, 64\) of dim 0: rows \[16, 48\) of dim 0"):
        RegionAssembly({**whole, Q: (Region(0, 0, 64),)}, pieces(holed), by_name)
    halves = ReceivePlan({**dict.fromkeys(whole), Q: (Region(0, 0, 32), Region(0, 32, 32))})
    asm = RegionAssembly(whole, pieces(halves), by_name)
    assert asm.count[(Q, None)] == 2


def test_piece_owners_follow_the_senders_rows() -> None:
    spec = TensorSpec(O_PROJ, "float32", (64, 64))
    lay = RegionLayout.build([spec], [ReceivePlan({O_PROJ: (Region(1, 0, 32),)}), ReceivePlan({O_PROJ: (Region(1, 32, 32),)})])
    owners = {O_PROJ: row_shards(spec, [40, 24])}
    mine = lay.sets[0].owners({O_PROJ: spec}, owners)
    assert mine is not None
    assert [(s.sender, s.start, s.stop) for s in mine[f"{O_PROJ}@1:0:32"]] == [(0, 0, 40 * 128), (1, 40 * 128, 64 * 128)]
    q = TensorSpec(Q, "float32", (64, 64))
    lay = RegionLayout.build([q], [ReceivePlan({Q: (Region(0, 32, 32),)})])
    mine = lay.sets[0].owners({Q: q}, {Q: row_shards(q, [40, 24])})
    assert mine is not None
    assert [(s.sender, s.start, s.stop) for s in mine[f"{Q}@0:32:32"]] == [(0, 0, 8 * 256), (1, 8 * 256, 32 * 256)]


def test_assignment_wire_is_checked_against_the_engines_tensors() -> None:
    from ckpt_engine.planning.buckets import plan_buckets
    from ckpt_engine.planning.region_wire import RegionAssignment

    specs = qwen2_specs()
    by_name = {s.name: s for s in specs}
    lay = RegionLayout.build(specs, [tp_ep_plan(specs, tp_size=2, tp_rank=r, num_kv_heads=1) for r in range(2)])
    manifests = {s.index: plan_buckets([p.spec for p in s.pieces], 1 << 16) for s in lay.sets}
    wire = RegionAssignment.of("d", "m", 1, lay.sets_of(1), manifests).to_wire()
    back = RegionAssignment.from_wire(wire, by_name)
    assert [s.index for s in back.sets] == [1, 2] and back.nbytes == lay.bytes_for(1)
    with pytest.raises(ReceivePlanError, match="names tensor 'lm_head.weight', which this engine does not have"):
        RegionAssignment.from_wire(wire, {n: s for n, s in by_name.items() if n != "lm_head.weight"})
    small = dict(by_name, **{Q: TensorSpec(Q, "float32", (32, 64))})
    with pytest.raises(ReceivePlanError, match=f"region .* of '{Q}' lies outside its shape"):
        RegionAssignment.from_wire(wire, small)
    other = RegionAssignment.of("d", "m", 1, [lay.sets[1]], {1: manifests[0]}).to_wire()
    with pytest.raises(ReceivePlanError, match="does not carry exactly its pieces"):
        RegionAssignment.from_wire(other, by_name)
    assert RegionLayout.from_wire(lay.to_wire(), by_name).digest == lay.digest


def test_sets_sharing_no_receiver_stream_side_by_side_and_each_receivers_sets_keep_index_order() -> None:
    from ckpt_engine.pipeline.region_groups import waves

    assert waves([(0, (0,)), (1, (1,)), (2, (0, 1))]) == [[0, 1], [2]]
    assert waves([(k, (k,)) for k in range(6)], width=4) == [[0, 1, 2, 3], [4, 5]]
    got = waves([(0, (0,)), (1, (0, 1)), (2, (2,)), (3, (1,)), (4, (0, 2))])
    assert got == [[0, 2], [1], [3, 4]]
    for receiver in range(3):  # one set per wave, in index order
        order = [k for wave in got for k in wave if receiver in dict([(0, (0,)), (1, (0, 1)), (2, (2,)), (3, (1,)), (4, (0, 2))])[k]]
        assert order == sorted(order)
