"""Trainer rank 0 fails a many-sender sync before the send (issue 39): the other trainer ranks
raise that error too, in step, instead of returning as if the sync had passed and then waiting
in the next sync for an announcement rank 0 never makes (on two H200s: rank 1 hung in the second
sync's "join" broadcast while rank 0, its first sync failed, had left its loop).

Two gloo trainer ranks (their own processes, `senders=all`) into two reference engines: version
1, then version 1 again (refused by rank 0's session before anything is sent), then a call on rank
0 without engines (refused before the session is even looked up), then the next version. Rank 1
raises each of rank 0's refusals at steps 2 and 3, both ranks complete step 4, and the engines hold
step 4's weights bit for bit."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from _sender_skip_trainer import skip_trainer_main
from ckpt_engine.benchmark.processes import run_processes
from ckpt_engine.rollout_adapters.torch_ref import TorchRefRollout, write_spec_file
from ckpt_engine.sources.base import StateDictSource
from helpers_procs import free_port
from multisender import model_state, wire
from ranks import forkserver_context
from refengines import holds, spawn_engine

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[TorchRefRollout]]:
    spec = tmp_path_factory.mktemp("spec") / "spec.msgpack"
    write_spec_file(spec, StateDictSource(wire(model_state(0))).metadata())
    rs = [spawn_engine(f"skip{i}", spec_file=str(spec), timeout_s=60) for i in range(2)]
    yield rs
    for r in rs:
        r.close()


def test_a_sync_rank0_fails_before_the_send_fails_on_every_rank_and_the_next_one_passes(engines: list[TorchRefRollout], tmp_path: Path) -> None:
    info = [{"name": e.name, "host": e.rpc.host, "port": e.rpc.port, "token": e.token} for e in engines]
    ctx = forkserver_context()
    args = (2, free_port(), info, str(tmp_path), [1, 1, None, None], 30.0, 2)
    procs = [ctx.Process(target=skip_trainer_main, args=(r, *args)) for r in range(2)]
    assert run_processes(procs, 300) == []
    assert [p.exitcode for p in procs] == [0, 0]
    lead, other = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert [e["ok"] for e in lead] == [True, False, False, True], lead
    assert "version 1 was completed already (by this session or one it replaced)" in lead[1]["error"], lead
    assert "must pass the rollout engines" in lead[2]["error"], lead
    assert [lead[0]["version"], lead[3]["version"]] == [1, 2], lead
    assert [e["ok"] for e in other] == [True, False, False, True], other
    for step, why in ((1, "version 1 was completed already (by this session or one it replaced)"), (2, "must pass the rollout engines")):
        assert other[step]["error"].startswith("SendFailed: trainer rank 1: trainer rank 0 (the controller) failed this sync before the send: "), other
        assert why in other[step]["error"], other
    for e in engines:
        assert holds(e, wire(model_state(3, lr=1e-5))) == []


def test_a_join_that_fails_after_rank0_announced_the_group_fails_on_every_rank(engines: list[TorchRefRollout], tmp_path: Path) -> None:
    """The 2xH200 case: rank 0 announced a new group, the join failed (here every rank's: nccl_handoff
    told of a local sender the group lacks), so rank 0 announced "skip". Rank 1 raises rank 0's join
    error (and its own) at step 1 and both ranks then sync step 2 into a rebuilt gloo group."""
    info = [{"name": e.name, "host": e.rpc.host, "port": e.rpc.port, "token": e.token} for e in engines]
    ctx = forkserver_context()
    args = (2, free_port(), info, str(tmp_path), [None, None], 30.0, None, 0)
    procs = [ctx.Process(target=skip_trainer_main, args=(r, *args)) for r in range(2)]
    assert run_processes(procs, 300) == []
    assert [p.exitcode for p in procs] == [0, 0]
    lead, other = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert [e["ok"] for e in lead] == [False, True], lead
    assert lead[0]["error"].startswith("SyncError") and "local_senders=[5]" in lead[0]["error"], lead
    assert [e["ok"] for e in other] == [False, True], other
    assert other[0]["error"].startswith("SendFailed: trainer rank 1: trainer rank 0 (the controller) failed this sync before the send: "), other
    assert "this rank's join failed" in other[0]["error"] and "local_senders=[5]" in other[0]["error"], other
    for e in engines:
        assert holds(e, wire(model_state(1, lr=1e-5))) == []
