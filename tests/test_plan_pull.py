"""The planner's pull transport (`--backend nixl`) and a late joiner's time to serve from a peer."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from ckpt_engine.plan.cli import main
from ckpt_engine.plan.cost import predict
from ckpt_engine.plan.params import Calibration, load_calibration
from ckpt_engine.plan.peer_join import ISSUE_SLACK_S, MAX_WINDOW, predict_join
from ckpt_engine.plan.pull import first_sync_s, pull_transfer
from ckpt_engine.plan.scenario import Scenario
from ckpt_engine.plan.validate import PULL_MODELS, pull_rows, to_markdown

CAL = load_calibration()
KIMI = Scenario(model="kimi-k2", trainer="256xH800", rollout="8x32xH800", nic_gbps=400, strategy="all-senders", backend="nixl")


def test_a_pull_grows_with_the_bytes_per_rank() -> None:
    setup = replace(KIMI, receive="shard").setup()
    r, links = setup.rollout, setup.links
    rate = links.nic_gbs * CAL.nic_eff * 1e9
    for wire in (1e9, 4e9, 64e9):
        got = pull_transfer(wire, 256, 10, "shard", r, links, 8, CAL)
        waves = math.ceil(32 / 8)
        assert got.ingress_s == pytest.approx(waves * wire / 32 / rate)
        per_bucket = CAL.nixl_bucket_s + 8 * CAL.nixl_store_op_s  # a bucket of one set is read by 8 engines
        assert got.seconds == pytest.approx(max(got.ingress_s, got.egress_s) + (10 + waves) * per_bucket)
    small, big = (pull_transfer(w, 256, 10, "shard", r, links, 8, CAL) for w in (1e9, 2e9))
    assert big.ingress_s == pytest.approx(2 * small.ingress_s)


def test_a_pulls_bandwidth_does_not_grow_with_receivers_only_its_store_round_trips_do() -> None:
    # 256 senders: up to 32 engines of 8 GPUs, no sender's link carries more than a receiver's
    pulls, rings = [], []
    for engines in (2, 4, 8, 16):
        sc = replace(KIMI, rollout=f"{engines}x8xH800")
        p = predict(sc.setup(), CAL)
        pulls.append((engines, p.stages["transfer"], p.receiver_ingress_s, p.num_buckets))
        rings.append(predict(replace(sc, backend="nccl").setup(), CAL).stages["transfer"])
    assert {ingress for _, _, ingress, _ in pulls} == {pulls[0][2]}
    for engines, transfer, ingress, buckets in pulls:  # every rollout GPU reads each bucket and frees it
        assert transfer == pytest.approx(ingress + (buckets + 1) * (CAL.nixl_bucket_s + engines * 8 * CAL.nixl_store_op_s))
    assert rings == sorted(rings) and rings[-1] > rings[0]  # a hop of ring fill per node


def test_one_sender_serving_many_readers_is_bound_by_its_own_link() -> None:
    # no broadcast tree: each reader takes the sender's bytes over the sender's link again
    base = Scenario(model="qwen2.5-7b", trainer="8xH100", rollout="1x8xH100", nic_gbps=400, loader="copy", backend="nixl", strategy="single")
    one, four = (predict(replace(base, rollout=f"{e}x8xH100").setup(), CAL) for e in (1, 4))
    assert four.detail["pull_egress_s"] == pytest.approx(4 * one.detail["pull_egress_s"])
    assert four.stages["transfer"] > 3.5 * one.stages["transfer"]
    assert any("bound by the senders' links" in n for n in four.notes)
    ring_one, ring_four = (predict(replace(base, backend="nccl", rollout=f"{e}x8xH100").setup(), CAL) for e in (1, 4))
    assert ring_four.stages["transfer"] < 1.1 * ring_one.stages["transfer"]


def test_every_bucket_is_packed_and_the_first_sync_pays_the_set_up() -> None:
    sc = Scenario(model="qwen2.5-7b", trainer="1xH100", rollout="1x1xH100", loader="inplace", export="none", bucket_mb=64)
    assert predict(sc.setup(), CAL).detail["packed"] == 0.0
    pulled = predict(replace(sc, backend="nixl").setup(), CAL)
    assert pulled.detail["packed"] == 1.0 and pulled.stages["encode"] > 0
    assert pulled.detail["first_sync_extra_s"] == pytest.approx(CAL.nixl_plan_s + CAL.nixl_agent_start_s)
    assert first_sync_s(CAL, fresh_process=False) == pytest.approx(CAL.nixl_plan_s)


def test_a_joiners_time_to_serve_is_its_bytes_over_the_link_plus_checksums_plus_fixed_costs() -> None:
    setup = Scenario(model="qwen3-235b-a22b", rollout="8x8xH20", nic_gbps=400).setup()
    j = predict_join(setup.model, setup.rollout, setup.links, CAL)
    per_rank = setup.model.total_bytes / 8
    link = 50e9 * CAL.nic_eff
    checks = setup.model.num_tensors * CAL.checksum_tensor_s + per_rank / (CAL.checksum_gbs * 1e9)
    fixed = CAL.nixl_agent_start_s + CAL.join_rpc_s + math.ceil(setup.model.num_tensors / MAX_WINDOW) * CAL.msg_latency_s
    assert j.link == "NIC" and j.bytes_per_rank == per_rank
    assert j.total_s == pytest.approx(per_rank / link + 2 * checks + fixed)
    assert j.without_checksums_s == pytest.approx(per_rank / link + fixed)
    assert j.bar_s == pytest.approx(per_rank / link + ISSUE_SLACK_S)
    cached = predict_join(setup.model, setup.rollout, setup.links, CAL, peer_checksums_cached=True)
    assert cached.total_s == pytest.approx(j.total_s - checks)
    wider = predict_join(setup.model, replace(setup.rollout, gpus_per_engine=16), setup.links, CAL)
    assert wider.read_s == pytest.approx(j.read_s / 2)  # bytes per rank halve; the fixed costs do not


def test_two_engines_of_one_node_join_over_nvlink() -> None:
    setup = Scenario(model="qwen2.5-7b", rollout="2x1xH200").setup()
    j = predict_join(setup.model, setup.rollout, setup.links, CAL)
    assert j.link == "NVLink" and j.link_gbs == pytest.approx(setup.links.nvlink_gbs * CAL.nvlink_eff)


def test_the_joiners_window_is_the_elastic_pulls() -> None:
    pytest.importorskip("torch")
    from ckpt_engine.elastic.pull import MAX_WINDOW as PULL_MAX_WINDOW

    assert MAX_WINDOW == PULL_MAX_WINDOW


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: Scenario(backend="gloo").setup(), "--backend 'gloo': use one of nccl, nixl"),
        (lambda: Scenario(backend="nixl", delta=0.02).setup(), "--delta with --backend nixl"),
        (lambda: Calibration(checksum_gbs=0.0), "checksum_gbs must be > 0"),
        (lambda: Calibration(nixl_agent_start_s=-1.0), "nixl_agent_start_s must be >= 0"),
    ],
)
def test_bad_input_to_the_pull_model_is_refused_by_name(call, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize(("args", "words"), [(["--backend", "ucx"], "--backend"), (["--backend", "nixl", "--delta", "0.02"], "--backend nixl")])
def test_cli_refuses_bad_backend_input_in_one_line(args: list[str], words: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        raise SystemExit(main(args))
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err and "nixl" in err


def test_cli_prints_the_pull_rate_and_the_joiners_time(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--model", "qwen3-235b-a22b", "--trainer", "64xH20:tp=4,pp=4,ep=4", "--rollout", "8x8xH20", "--nic-gbps", "400", "--backend", "nixl"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "each read should reach 40.0 GB/s per link" in out and "a late joiner serves in" in out and "modelled; measured runs of nixl" in out
    assert main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    join = data["join"]
    assert join["total_s"] == pytest.approx(join["read_s"] + join["check_s"] + join["peer_check_s"] + join["window_s"] + join["fixed_s"])
    assert data["scenario"]["backend"] == "nixl" and data["detail"]["pull_link_gbs"] == pytest.approx(40.0)


def test_the_235b_and_kimi_rows_say_what_the_pull_gives() -> None:
    rows = pull_rows(CAL)
    assert [r.label for r in rows] == [
        "verl, Qwen3-235B-A22B, 64+64 H20", "Moonshot checkpoint-engine, Qwen3-235B-A22B, 8xH800 TP8", "Moonshot checkpoint-engine, Kimi-K2 (FP8), 256xH20 TP16",
    ]
    assert PULL_MODELS == ("qwen3-235b-a22b", "kimi-k2")
    verl = rows[0]
    assert verl.pull_s > 10 * verl.broadcast_s  # one sender, 64 readers over its one NIC
    assert verl.pull_shard_s < verl.broadcast_s
    for r in rows:
        assert r.join.total_s > r.join.without_checksums_s > r.join.read_s > 0
    text = to_markdown([], [], "test", rows)
    assert "### The pull transport on the same set-ups" in text and text.count("\n| Moonshot") == 2 and "Kimi-K2" in text
