"""The sync-time arithmetic: monotone in bytes and links, bounded by receiver ingress, delta sizes."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt_engine.plan.cluster import parse_rollout, parse_trainer
from ckpt_engine.plan.cost import SyncSetup, predict
from ckpt_engine.plan.delta import delta_wire_bytes
from ckpt_engine.plan.params import Calibration, load_calibration
from ckpt_engine.plan.scenario import Scenario

CAL = load_calibration()

scenarios = st.builds(
    Scenario,
    model=st.sampled_from(["qwen2.5-7b", "qwen3-30b-a3b", "kimi-k2"]),
    trainer=st.sampled_from(["8xH100", "64xH800", "16xH20:tp=2,ep=8"]),
    rollout=st.sampled_from(["1x8xH100", "4x4xH20", "16x16xH800", "2x1xH200"]),
    nic_gbps=st.floats(25, 800),
    strategy=st.sampled_from(["single", "all-senders"]),
    delta=st.one_of(st.none(), st.floats(0.0, 1.0)),
    bucket_mb=st.sampled_from([64.0, 256.0, 1024.0, 4096.0]),
    loader=st.sampled_from(["inplace", "copy", "ref", "vllm"]),
    receive=st.sampled_from(["full", "shard"]),
    same_node=st.booleans(),
)


@settings(max_examples=60, deadline=None)
@given(scenarios, st.floats(1.01, 4.0))
def test_more_bytes_never_sync_faster(sc: Scenario, factor: float) -> None:
    # Same bucket count on both sides: crossing into a second bucket may legitimately be faster
    # (one bucket cannot overlap its stages, two can), which is not what this property is about.
    setup = sc.setup()
    bigger = replace(setup, model=replace(setup.model, total_bytes=int(setup.model.total_bytes * factor)))
    buckets = predict(bigger, CAL).num_buckets
    small_t = predict(replace(setup, num_buckets=buckets), CAL).total_s
    assert predict(replace(bigger, num_buckets=buckets), CAL).total_s >= small_t


@settings(max_examples=60, deadline=None)
@given(scenarios, st.floats(1.01, 8.0))
def test_faster_links_never_sync_slower(sc: Scenario, factor: float) -> None:
    setup = sc.setup()
    links = setup.links
    faster = replace(setup, links=replace(links, nic_gbs=links.nic_gbs * factor, nvlink_gbs=links.nvlink_gbs * factor, pcie_gbs=links.pcie_gbs * factor))
    assert predict(faster, CAL).total_s <= predict(setup, CAL).total_s * (1 + 1e-12)


@settings(max_examples=60, deadline=None)
@given(scenarios, st.integers(1, 4096))
def test_no_number_of_senders_beats_receiver_ingress(sc: Scenario, senders: int) -> None:
    setup = replace(sc.setup(), strategy="all-senders")
    setup = replace(setup, senders=min(senders, setup.trainer.num_shards))
    p = predict(setup, CAL)
    assert p.stages["transfer"] >= p.receiver_ingress_s
    assert p.total_s >= p.receiver_ingress_s
    # the bound is a property of the receivers: the single sender faces the same one
    assert predict(replace(setup, strategy="single", senders=None), CAL).receiver_ingress_s == p.receiver_ingress_s


def test_all_senders_approach_receiver_ingress_and_single_sender_is_nic_bound() -> None:
    sc = Scenario(model="kimi-k2", dtype="fp8", trainer="256xH800", rollout="16x16xH800", nic_gbps=400, loader="inplace")
    single = predict(replace(sc, strategy="single").setup(), CAL)
    many = predict(replace(sc, strategy="all-senders").setup(), CAL)
    nic = 400 / 8 * 1e9 * CAL.nic_eff
    assert single.stages["transfer"] >= single.wire_bytes / nic  # one sender's NIC carries every byte
    assert many.stages["transfer"] < single.stages["transfer"] / 4  # here NVLink fan-out, not the NIC, binds
    assert many.stages["transfer"] <= many.receiver_ingress_s * 1.01


def test_delta_bytes_follow_the_formula_and_go_dense_where_a_patch_would_not_be_smaller() -> None:
    dense, itemsize, tensors = 2_000_000_000, 2, 100
    d = delta_wire_bytes(dense, itemsize, 0.02, tensors)
    numel = dense // itemsize
    assert d.encoding == "positions"
    assert d.wire_bytes == round(numel * 0.02) * (itemsize + 4) + 16 * tensors
    assert d.ratio(dense) == pytest.approx(0.02 * (itemsize + 4) / itemsize, rel=1e-4)
    # bf16 value + int32 position: 6 bytes per change, so from 1/3 changed the bucket goes dense
    assert delta_wire_bytes(dense, itemsize, 1 / 3 - 1e-3, tensors).encoding == "positions"
    dense_delta = delta_wire_bytes(dense, itemsize, 1 / 3 + 1e-3, tensors)
    assert dense_delta.encoding == "dense" and dense_delta.wire_bytes == dense
    sizes = [delta_wire_bytes(dense, itemsize, f, tensors).wire_bytes for f in (0.0, 0.01, 0.03, 0.1, 0.5, 1.0)]
    assert sizes == sorted(sizes)


def test_delta_shrinks_the_transfer() -> None:
    sc = Scenario(model="qwen3-30b-a3b", trainer="16xH100", rollout="8x2xH100", nic_gbps=400, strategy="all-senders", loader="inplace")
    dense, delta = predict(sc.setup(), CAL), predict(replace(sc, delta=0.01).setup(), CAL)
    assert delta.wire_bytes < 0.04 * dense.wire_bytes
    assert delta.stages["transfer"] < 0.1 * dense.stages["transfer"]


def test_one_buffer_serialises_the_stages() -> None:
    sc = Scenario(model="qwen2.5-7b", trainer="8xH100", rollout="2x4xH100", nic_gbps=400, loader="copy")
    two, one = predict(sc.setup(), CAL), predict(replace(sc, buffers=1).setup(), CAL)
    piped = sum(one.stages[k] for k in ("export", "encode", "transfer", "load"))
    assert one.total_s == pytest.approx(piped + one.stages["overhead"])
    assert two.total_s < one.total_s


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: parse_trainer("8H100"), "--trainer '8H100'"),
        (lambda: parse_trainer("8xH100:tp=0"), "tp=N"),
        (lambda: parse_trainer("6xH100:tp=4"), "not a multiple"),
        (lambda: parse_rollout("4xX9"), "unknown GPU 'X9'"),
        (lambda: Scenario(strategy="all").setup(), "--strategy 'all'"),
        (lambda: Scenario(trainer="8xH100", strategy="all-senders", senders=9).setup(), r"--senders must be in \[1, 8\]"),
        (lambda: Scenario(delta=1.5).setup(), r"--delta must be a changed fraction in \[0, 1\]"),
        (lambda: Scenario(loader="sglang").setup(), "--loader 'sglang'"),
        (lambda: Scenario(nic_gbps=0).setup(), "--nic-gbps must be > 0"),
        (lambda: Calibration(nvlink_eff=1.5), r"nvlink_eff must be in \(0, 1\]"),
        (lambda: Scenario.from_dict({"bucket": 1}), "unknown setting"),
    ],
)
def test_bad_input_names_what_was_wrong(call, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()


def test_setup_rejects_tiny_buckets() -> None:
    setup = Scenario().setup()
    with pytest.raises(ValueError, match="--bucket-mb must be >= 1"):
        SyncSetup(setup.model, setup.trainer, setup.rollout, setup.links, bucket_bytes=1000)


def test_shard_receive_takes_one_shard_per_gpu_in_waves_of_parallel_sets() -> None:
    cal = load_calibration()
    base = Scenario(model="kimi-k2", trainer="256xH800", rollout="8x32xH800", nic_gbps=400, strategy="all-senders", fused_experts=True)
    full = predict(base.setup(), cal)
    shard = predict(replace(base, receive="shard").setup(), cal)
    wide = predict(replace(base, receive="shard", parallel_sets=32).setup(), cal)
    gpu_bytes = full.wire_bytes / 32
    nic = 50e9 * cal.nic_eff
    assert wide.receiver_ingress_s == pytest.approx(gpu_bytes / nic)  # every GPU at once: one shard's time
    assert shard.receiver_ingress_s == pytest.approx(4 * gpu_bytes / nic)  # 8 sets side by side: 4 waves
    assert wide.total_s < shard.total_s < full.total_s
    single = predict(replace(base, strategy="single", receive="shard", parallel_sets=32).setup(), cal)
    assert single.stages["transfer"] >= full.wire_bytes / nic  # one sender's egress bounds it whatever the receivers hold
