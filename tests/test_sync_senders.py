"""Every trainer rank sends its own shards through `sync_rollout_weights` (senders=all), into
reference engines in their own processes: delta chains bit-exact, and a sender killed mid-sync is
named on every other rank within the timeout while the engines keep their old weights."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from _sender_trainer import trainer_main
from ckpt_engine.benchmark.processes import run_processes
from ckpt_engine.rollout_adapters.torch_ref import TorchRefRollout, write_spec_file
from ckpt_engine.sources.base import StateDictSource
from helpers_procs import free_port
from multisender import model_state, wire
from ranks import forkserver_context
from refengines import holds, spawn_engine


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[TorchRefRollout]]:
    spec = tmp_path_factory.mktemp("spec") / "spec.msgpack"
    write_spec_file(spec, StateDictSource(wire(model_state(0))).metadata())
    rs = [spawn_engine(f"ms{i}", spec_file=str(spec), timeout_s=60) for i in range(2)]
    yield rs
    for r in rs:
        r.close()


def _run(
    engines: list[TorchRefRollout], tmp_path: Path, world: int, versions: int, kill: dict[str, int] | None = None,
    delta_modes: list[str] | None = None, timeout_s: float = 8,
) -> list[Any]:
    info = [{"name": e.name, "host": e.rpc.host, "port": e.rpc.port, "token": e.token} for e in engines]
    ctx = forkserver_context()
    port = free_port()
    procs = [ctx.Process(target=trainer_main, args=(r, world, port, info, str(tmp_path), versions, kill, delta_modes, timeout_s)) for r in range(world)]
    run_processes(procs, 150)
    out = []
    for r in range(world):
        path = tmp_path / f"rank{r}.json"
        out.append(json.loads(path.read_text()) if path.exists() else None)
    return out


def test_every_rank_sends_its_shards_with_delta(engines: list[TorchRefRollout], tmp_path: Path) -> None:
    logs = _run(engines, tmp_path, world=2, versions=4, timeout_s=30)  # a loaded box is slow
    lead = logs[0]
    assert [e["ok"] for e in lead] == [True] * 4, lead
    assert [e["delta"] for e in lead] == ["seed", "patch", "patch", "patch"]
    assert [e["staged"] for e in lead] == ["full", "patches", "patches", "patches"]  # issue 28: staged by default
    assert all(e["senders"] == 2 for e in lead)
    assert all(e["wire"] < 0.6 * e["dense"] for e in lead[1:])
    assert [e["ok"] for e in logs[1]] == [True] * 4
    last = wire(model_state(3, lr=1e-5))
    for e in engines:
        assert holds(e, last) == []


def test_reports_count_every_sender(engines: list[TorchRefRollout], tmp_path: Path) -> None:
    """Two sending processes: a dense sync, a delta seed and a patch sync each report the wire
    bytes of both senders (the sum of the per-sender shares, and what every engine received), and
    the dense ones the model's bytes, not sender 0's share."""
    logs = _run(engines, tmp_path, world=2, versions=3, delta_modes=["off", "on", "on"], timeout_s=60)
    lead = logs[0]
    assert [e["ok"] for e in lead] == [True] * 3, lead
    assert [e["delta"] for e in lead] == ["off", "seed", "patch"]
    model = sum(t.nbytes for t in wire(model_state(0)).values())
    dense, seed, patch = lead
    for e in lead:
        assert e["bytes"] == model
        assert len(e["per_sender"]) == 2 and min(e["per_sender"]) > 0, e
        assert e["wire"] == sum(e["per_sender"]), e
    assert dense["wire"] == dense["dense"] == model
    assert seed["wire"] == seed["dense"] >= model and seed["dense"] - model < 4096 * len(wire(model_state(0))), seed
    assert patch["dense"] == seed["dense"] and patch["wire"] < patch["dense"], patch
    for e in (seed, patch):
        assert set(e["received"].values()) == {e["wire"]}, e  # every engine took in what the senders together put out


def test_a_sender_killed_mid_sync_is_named_and_engines_keep_old_weights(engines: list[TorchRefRollout], tmp_path: Path) -> None:
    """Three senders; rank 1 SIGKILLs itself while producing its pieces of the third sync (a
    patch sync): rank 0 gets a SyncError naming sender 1 within the timeout plus grace, rank 2
    an error too, and every engine still holds the second version bit for bit. The patch sync
    was staged (issue 28): the engines never paused and are not stale."""
    logs = _run(engines, tmp_path, world=3, versions=3, kill={"rank": 1, "version": 2, "piece": 3})
    lead, survivor = logs[0], logs[2]
    assert logs[1] is None or len(logs[1]) == 2  # killed before it could write its log
    assert [e["ok"] for e in lead] == [True, True, False]
    failed = lead[2]
    assert "SyncError" in failed["error"] and ("sender 1" in failed["error"] or "trainer rank" in failed["error"])
    assert failed["seconds"] < 8 * 2 + 10  # timeout_s plus the receivers' grace and the report round
    assert survivor is not None and survivor[-1]["ok"] is False
    before = wire(model_state(1, lr=1e-5))
    for e in engines:
        assert holds(e, before) == []
        h = e.health()
        assert not h["stale"] and not h["paused"] and not h["staged"] and h["version"] is not None, h
