"""Region delivery through WeightSyncSession into reference engines in their own processes: TP=2
ranks (and an EP=2 engine) hold exactly their slices bit for bit after a dense and two patch syncs,
a whole-tensor engine beside them still gets every tensor, the report shows each rank's bytes, and
two trainer ranks send their rows of each region, and bad plans (one that covers only part of what
the rank holds too, issue 45) or a wrong count of them are refused by engine, rank and tensor
before any engine pauses. The syncs are staged (issue 28): a corrupt region patch or a sender
killed mid-stream leaves every rank its old slices bit for bit, unpaused and not stale."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from _region_trainer import region_trainer_main
from ckpt_engine import CheckpointEngineConfig, SyncError, WeightSyncSession
from ckpt_engine.benchmark.processes import run_processes
from ckpt_engine.planning.receive_sets import cut_region
from ckpt_engine.planning.regions import ReceivePlan, Region
from ckpt_engine.rollout_adapters.base import ManifestRejectedError
from ckpt_engine.rollout_adapters.torch_ref import TorchRefRollout, write_spec_file
from ckpt_engine.sources.base import StateDictSource
from ckpt_engine.registry import CheckpointEngineRegistry
from helpers_procs import free_port
from ranks import forkserver_context
from refengines import same_bits, spawn_engine
from tamper import FlipOnce
from regionranks import KV_HEADS, moe_specs, qwen2_specs, weights

CFG = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.0625, timeout_s=30, delta="on")


def _spawn(name: str, path: str, layout: dict[str, int] | None, staging_budget_bytes: int | None = None) -> TorchRefRollout:
    return spawn_engine(name, spec_file=path, timeout_s=60, layout=layout, staging_budget_bytes=staging_budget_bytes)


@pytest.fixture(scope="module")
def qwen2_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("regions") / "qwen2.msgpack"
    write_spec_file(path, qwen2_specs())
    return str(path)


@pytest.fixture(scope="module")
def tp_engines(qwen2_file: str) -> Iterator[list[TorchRefRollout]]:
    # Room for 0.6 of the model: a TP rank's dense staging copy is only its slices (~half).
    room = int(0.6 * sum(s.nbytes for s in qwen2_specs()))
    rs = [_spawn(f"tp{r}", qwen2_file, {"tp_size": 2, "tp_rank": r, "num_kv_heads": KV_HEADS}, room) for r in range(2)]
    rs.append(_spawn("whole", qwen2_file, None))
    yield rs
    for r in rs:
        r.close()


def _wrong(engine: TorchRefRollout, w: dict[str, torch.Tensor], plan: ReceivePlan | None) -> list[str]:
    """Names whose slice in `engine` differs from `w` ([] = bit-exact)."""
    holds = plan.holds if plan is not None else dict.fromkeys(w)
    bad = []
    for name, regions in holds.items():
        want = cut_region(w[name], regions[0] if regions is not None else None)
        if not same_bits(engine.get_tensor(name), want.contiguous()):
            bad.append(name)
    return bad


def test_tp_ranks_hold_their_slices_after_dense_and_patch_syncs(tp_engines: list[TorchRefRollout]) -> None:
    specs = qwen2_specs()
    model = sum(s.nbytes for s in specs)
    session = WeightSyncSession(tp_engines, CFG)
    try:
        kinds, staged = [], []
        for v in range(3):
            w = weights(specs, v)
            report = session.sync(StateDictSource(w))
            kinds.append(report.delta)
            staged.append(report.staged)
            for e in tp_engines:
                (plan,) = e.receive_plans()
                assert _wrong(e, w, plan) == [], e.name
        assert kinds == ["seed", "patch", "patch"]
        assert staged == ["full", "patches", "patches"]  # issue 28: a full staging copy of each rank's slices, then patches
        got = report.received_bytes
        assert got["whole"] == [model]
        assert all(got[f"tp{r}"][0] <= 0.55 * model for r in range(2)), got
        assert report.receivers["tp0"]["bytes"] == got["tp0"][0]
        assert 0 < report.changed_fraction < 0.2
        k = "model.layers.0.self_attn.k_proj.weight"
        assert tuple(tp_engines[0].get_tensor(k).shape) == (16, 64) == tuple(tp_engines[1].get_tensor(k).shape)
    finally:
        session.close()


def test_two_trainer_ranks_send_their_rows_of_each_region(tp_engines: list[TorchRefRollout], tmp_path: Path) -> None:
    info = [{"name": e.name, "host": e.rpc.host, "port": e.rpc.port, "token": e.token} for e in tp_engines]
    port = free_port()
    ctx = forkserver_context()  # the ranks fork from the preloaded server (tests/ranks.py)
    procs = [ctx.Process(target=region_trainer_main, args=(r, 2, port, info, str(tmp_path), 3)) for r in range(2)]
    run_processes(procs, 240)
    logs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [e["ok"] for e in logs[1]] == [True] * 3, logs[1]
    lead = logs[0]
    assert [e["ok"] for e in lead] == [True] * 3, lead
    assert [e["delta"] for e in lead] == ["seed", "patch", "patch"] and lead[0]["senders"] == 2
    model = sum(s.nbytes for s in qwen2_specs())
    assert lead[-1]["received"]["whole"] == [model] and lead[-1]["received"]["tp1"][0] <= 0.55 * model
    w = weights(qwen2_specs(), 2)
    for e in tp_engines:
        (plan,) = e.receive_plans()
        assert _wrong(e, w, plan) == [], e.name


class _Claims(TorchRefRollout):
    """A reference engine whose adapter states a plan of the test's choosing."""

    plan: ReceivePlan

    def receive_plans(self) -> list[ReceivePlan | None]:
        return [self.plan]


Q = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def claimers(qwen2_file: str) -> Iterator[tuple[TorchRefRollout, _Claims]]:
    good = _spawn("good", qwen2_file, {"tp_size": 2, "tp_rank": 0, "num_kv_heads": KV_HEADS})
    bad = _Claims.spawn("bad", spec_file=qwen2_file, timeout_s=60)
    yield good, bad
    good.close()
    bad.close()


@pytest.mark.parametrize(
    ("holds", "match"),
    [
        ({Q: (Region(0, 48, 32),)}, f"engine 'bad' rejected the manifest: rank 0: receive plan: region \\[48, 80\\) of '{Q}' lies outside"),
        ({Q: (Region(0, 0, 32), Region(0, 16, 8))}, f"engine 'bad' rejected the manifest: rank 0: receive plan: regions of '{Q}' overlap"),
        ({"model.layers.7.mlp.up_proj.weight": None}, "engine 'bad' .*'model.layers.7.mlp.up_proj.weight', which this sync does not carry"),
        # Issue 45: the handle says rows [32, 64) of q_proj, the worker holds it whole; a piece that
        # only overlaps the whole tensor was accepted and q_proj ended half old, half new.
        (
            {**{s.name: None for s in qwen2_specs()}, Q: (Region(0, 32, 32),)},
            f"engine 'bad' rejected the manifest: region assignment: {Q}: the pieces this receiver takes do not cover "
            "the whole tensor: rows \\[0, 32\\) of dim 0 \\(1 gap\\(s\\)\\) would keep old or uninitialised values",
        ),
    ],
    ids=["outside", "overlap", "unknown", "partly-covered"],
)
def test_bad_plans_are_refused_by_name_before_any_engine_pauses(claimers: tuple[TorchRefRollout, _Claims], holds: dict, match: str) -> None:
    good, bad = claimers
    bad.plan = ReceivePlan(holds)
    session = WeightSyncSession([good, bad], CFG)
    try:
        with pytest.raises(ManifestRejectedError, match=match):
            session.sync(StateDictSource(weights(qwen2_specs(), 0)))
        for e in (good, bad):
            h = e.health()
            assert not h["paused"] and h["version"] is None and h["buckets_received"] == 0
    finally:
        session.close()


class _Counts(TorchRefRollout):
    """A reference engine whose adapter states two receive plans for its one rank."""

    def receive_plans(self) -> list[ReceivePlan | None]:
        return [None, None]


def test_a_wrong_count_of_receive_plans_is_refused_by_engine_and_count_at_every_sync(
    claimers: tuple[TorchRefRollout, _Claims], qwen2_file: str,
) -> None:
    """Issue 45: the sync after the join that found the wrong count failed with `not enough values
    to unpack`; now every sync of the session names the engine and the count, nothing paused."""
    good, _ = claimers
    wrong = spawn_engine("wrong", spec_file=qwen2_file, timeout_s=60, handle=_Counts)
    session = WeightSyncSession([good, wrong], CFG)
    try:
        before = {e.name: e.health() for e in (good, wrong)}
        for _ in range(2):
            with pytest.raises(ValueError, match=r"^engine 'wrong': receive_plans\(\) returned 2 plan\(s\) for its 1 rank\(s\)"):
                session.sync(StateDictSource(weights(qwen2_specs(), 0)))
        for e in (good, wrong):
            h = e.health()
            assert not h["paused"] and (h["version"], h["buckets_received"]) == (before[e.name]["version"], before[e.name]["buckets_received"])
    finally:
        session.close()
        wrong.close()


def test_ep_ranks_hold_their_experts_only(tmp_path: object) -> None:
    specs = moe_specs()
    path = f"{tmp_path}/moe.msgpack"
    write_spec_file(path, specs)
    engines = [_spawn(f"ep{r}", path, {"ep_size": 2, "ep_rank": r}) for r in range(2)]
    session = WeightSyncSession(engines, CFG)
    try:
        for v in range(3):
            w = weights(specs, v)
            report = session.sync(StateDictSource(w))
            for e in engines:
                (plan,) = e.receive_plans()
                assert plan is not None and _wrong(e, w, plan) == []
        assert report.delta == "patch"
        experts = sum(s.nbytes for s in specs if ".experts." in s.name)
        model = sum(s.nbytes for s in specs)
        assert report.received_bytes["ep0"] == [model - experts // 2]
    finally:
        session.close()
        for e in engines:
            e.close()


class _Tampered(FlipOnce):
    """The sender's engines: flip one bit of the first patch frame sent once armed."""

    armed = False


def test_corrupt_region_patch_through_the_session_is_named_and_the_engine_keeps_old_weights(
    tp_engines: list[TorchRefRollout], monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(CheckpointEngineRegistry._classes, "gloo", _Tampered)  # this process: the sender; engines run real gloo
    specs = qwen2_specs()
    session = WeightSyncSession(tp_engines, CFG)
    try:
        w0 = weights(specs, 4)
        session.sync(StateDictSource(w0))
        _Tampered.armed = True
        with pytest.raises(SyncError) as info:
            session.sync(StateDictSource(weights(specs, 5)))
        assert info.value.stage == "transfer" and info.value.failed, str(info.value)
        for name, why in info.value.failed.items():
            assert "receiver set" in why and " holding " in why, why  # names the set and the bucket's regions
            assert "checksum mismatch" in why or "malformed patch" in why, why
            engine = next(e for e in tp_engines if e.name == name)
            (plan,) = engine.receive_plans()
            assert _wrong(engine, w0, plan) == [], name  # nothing loaded: the old weights, bit for bit
        for e in tp_engines:  # staged: every engine dropped what it staged and serves the old version
            h = e.health()
            assert not h["stale"] and not h["paused"] and not h["staged"] and h["version"] is not None, (e.name, h)
            (plan,) = e.receive_plans()
            assert _wrong(e, w0, plan) == [], e.name
        assert info.value.stale == [], str(info.value)
        w6 = weights(specs, 6)
        report = session.sync(StateDictSource(w6))
        assert report.delta == "seed"  # no base is assumed after a failure
        for e in tp_engines:
            (plan,) = e.receive_plans()
            assert _wrong(e, w6, plan) == [], e.name
    finally:
        session.close()


def test_a_sender_killed_mid_stream_of_a_staged_region_sync_leaves_every_rank_its_old_slices(tp_engines: list[TorchRefRollout]) -> None:
    """The trainer (its own process, `_region_trainer.killed_sender_main`) seeds, then SIGKILLs
    itself in a patch sync after the first receiver set was delivered and checked and while the
    second streams: no controller is left to discard, yet every rank keeps nothing staged, holds its
    old slices bit for bit, never paused, is not stale; the next sync heals every rank."""
    specs = qwen2_specs()
    tests_dir = str(Path(__file__).parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests_dir, os.environ.get("PYTHONPATH", "")])}
    info = [{"name": e.name, "host": e.rpc.host, "port": e.rpc.port, "token": e.token} for e in tp_engines]
    trainer = subprocess.Popen([sys.executable, "-m", "_region_trainer"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=tests_dir, env=env)
    try:
        assert trainer.stdin is not None and trainer.stdout is not None
        # Sets: {tp0, whole} and {tp1, whole} of 3 buckets each, then {tp0, tp1, whole}: it dies at set 1's second frame.
        trainer.stdin.write(json.dumps({"engines": info, "versions": [7, 8], "die_at": 5, "timeout_s": 10}) + "\n")
        trainer.stdin.flush()
        line = trainer.stdout.readline()
        assert line.split()[2:] == ["seed", "full"], line
        bases = {e.name: e.held_version() for e in tp_engines}
        assert trainer.wait(60) == -signal.SIGKILL
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait(10)
    deadline = time.monotonic() + 60
    while any(e.health()["receiving"] for e in tp_engines):
        assert time.monotonic() < deadline, "an engine's receive did not end after its sender died"
        time.sleep(0.05)
    w7 = weights(specs, 7)
    for e in tp_engines:
        h = e.health()
        assert (h["paused"], h["stale"], h["staged"], h["version"]) == (False, False, False, bases[e.name]), (e.name, h)
        (plan,) = e.receive_plans()
        assert _wrong(e, w7, plan) == [], e.name
    session = WeightSyncSession(tp_engines, CFG)
    try:
        w9 = weights(specs, 9)
        report = session.sync(StateDictSource(w9))
        assert (report.delta, report.staged) == ("seed", "full")
        for e in tp_engines:
            (plan,) = e.receive_plans()
            assert _wrong(e, w9, plan) == [], e.name
    finally:
        session.close()
