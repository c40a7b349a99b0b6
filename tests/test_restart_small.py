"""The smaller faults of issue 26, each refused or named: a manifest shaped to fit the global
budget, a refused receive that marked a serving engine stale, rank 1 silent about a dead rank 0,
get_tensor on a registered handle, "incomplete: None" in the log, duplicate YAML keys, engine
options refused only at the first sync. (A report that would freeze the job's versions:
tests/test_reliability_daemon.py, test_versions_are_bounded_and_monotone_at_the_edges.)"""

from __future__ import annotations

import json
import logging
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch

from ckpt_engine.config import CheckpointEngineConfig, ConfigError, load_config
from ckpt_engine.control.wire import RpcError
from ckpt_engine.daemon import DaemonConfig, WeightSyncDaemon
from ckpt_engine.rollout_adapters.receiver import WeightReceiver
from ckpt_engine.rollout_adapters.torch_ref import TorchRefRollout, write_spec_file
from ckpt_engine.sources.base import StateDictSource, spec_of
from ckpt_engine.sync.session import WeightSyncSession
from refengines import spawn_engine

pytestmark = pytest.mark.timeout(240)

TOKEN = "small-faults-job-token"
TIMEOUT_S = 20.0
SEEDS = [0, 1, 2]


def weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}.weight": torch.randn(64, 256, generator=g) for i in range(4)}


def config() -> CheckpointEngineConfig:
    return CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.25, timeout_s=TIMEOUT_S)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TorchRefRollout]:
    path = tmp_path_factory.mktemp("small") / "spec.msgpack"
    write_spec_file(path, StateDictSource(weights(0)).metadata())
    r = spawn_engine("e", spec_file=str(path), timeout_s=TIMEOUT_S, token=TOKEN)
    yield r
    r.close()


def descriptor(r: TorchRefRollout) -> dict[str, object]:
    return {"kind": "torch_ref", "host": r.rpc.host, "port": r.rpc.port}


# --- a manifest shaped to fit the decoder's global budget --------------------------------------
def _shaped(entries: int, seed: int) -> bytes:
    """A well-formed manifest of `entries` tiny valid entries, just under the global limits."""
    name = f"layer{seed % 4}.weight"
    entry = [name, "float32", [64, 256], 0, 4, 0]
    return msgpack.packb({"format": 2, "bucket_size": 4096, "alignment": 256, "num_senders": 1,
                          "buckets": [[0, [entry] * entries]], "digest": "0" * 64}, use_bin_type=True)


READS_BOUND = 32
"""The msgpack reads (`manifest._Reader.value`/`array`) a refusal from the header may take: the
header's fields and the first bucket's array headers (8 and 21 today). Walking the entries reads
about nine per entry: 45,000 for the smaller manifest below, 18 million for the hostile one. The
work is counted, not timed: the refusal's milliseconds grow several-fold on a loaded CI box."""


@pytest.fixture
def manifest_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many values and array headers the manifest decoder reads (the real reads, counted)."""
    from ckpt_engine import manifest

    reads = [0]
    for name in ("value", "array"):
        real = getattr(manifest._Reader, name)

        def counted(self: Any, *args: Any, _real: Any = real, **kwargs: Any) -> Any:
            reads[0] += 1
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(manifest._Reader, name, counted)
    return reads


@pytest.mark.parametrize("seed", SEEDS)
def test_a_manifest_shaped_to_fit_costs_a_few_reads_and_a_few_mb(seed: int, manifest_reads: list[int]) -> None:
    receiver = WeightReceiver()
    expected = {n: spec_of(n, t) for n, t in weights(0).items()}
    hostile = _shaped(2_000_000 - seed, seed)
    assert len(hostile) < 64 * 1024 * 1024
    tracemalloc.start()
    reply = receiver.validate(hostile, "0" * 64, expected)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert not reply["accepted"] and "could need" in reply["problems"][0], reply
    assert 0 < manifest_reads[0] <= READS_BOUND, f"refusing read {manifest_reads[0]} msgpack values"
    assert peak < 4 * 1024 * 1024, f"refusing took {peak / 2**20:.1f} MiB"
    # Just within the bytes a receiver's tensors could need, the entry count is still bounded.
    small = _shaped(5000 + seed, seed)  # within the bytes its tensors could need, over the entries
    manifest_reads[0] = 0
    reply = receiver.validate(small, "0" * 64, expected)
    assert not reply["accepted"] and "more than the" in reply["problems"][0], reply
    assert 0 < manifest_reads[0] <= READS_BOUND, f"refusing read {manifest_reads[0]} msgpack values"


# --- the reference engine: a refused receive, get_tensor on a registered handle ----------------
def test_a_refused_receive_leaves_a_serving_engine_serving_and_get_tensor_works(engine: TorchRefRollout) -> None:
    d = WeightSyncDaemon(config(), DaemonConfig(heartbeat_timeout_s=0), token=TOKEN)
    try:
        d.register("e", engine)  # registered in process: the handle now acts for the job's group
        for seed in SEEDS:
            sd = weights(seed)
            outcome = d.sync(StateDictSource(sd))
            assert outcome.ok
            for name, t in sd.items():
                assert torch.equal(engine.get_tensor(name), t)
            with pytest.raises(RpcError, match="was not validated on this receiver"):
                engine.rpc.call("receive", owner=d.group, digest=f"{seed}" * 64)
            h = engine.health()
            assert (h["version"], h["stale"], h["paused"]) == (outcome.version, False, False), h
    finally:
        d.close()


# --- "incomplete: None" -------------------------------------------------------------------------
def test_a_sync_refused_for_another_trainers_version_says_and_logs_why(engine: TorchRefRollout, caplog: pytest.LogCaptureFixture) -> None:
    d = WeightSyncDaemon(config(), DaemonConfig(heartbeat_timeout_s=0), token=TOKEN)
    try:
        d.register("e", descriptor(engine))
        assert d.sync(StateDictSource(weights(9))).ok
        for seed in SEEDS:
            handle = TorchRefRollout("e", engine.rpc.host, engine.rpc.port, None, TIMEOUT_S, token=TOKEN)
            handle.owner = d.group  # another trainer of the same job
            other = WeightSyncSession([handle], config())
            held = other.sync(StateDictSource(weights(seed))).version  # another trainer, behind the daemon's back
            other.close()
            handle.close()
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="ckpt_engine.daemon.coordinator"):
                refused = d.sync(StateDictSource(weights(seed)))  # an outcome saying why, not a traceback
            assert not refused.ok and f"e: v{held}" in refused.error and "another trainer" in refused.error, refused
            lines = [r.getMessage() for r in caplog.records if "incomplete" in r.getMessage()]
            assert lines and "incomplete: None" not in lines[-1] and "another trainer" in lines[-1], lines
            d.check_health()  # the daemon learns what the engine holds, and carries on past it
            outcome = d.sync(StateDictSource(weights(seed)))
            assert outcome.ok and outcome.version == held + 1, outcome
    finally:
        d.close()


# --- config: duplicate keys, options refused at load -------------------------------------------
@pytest.mark.parametrize("seed", SEEDS)
def test_duplicate_yaml_keys_are_refused_by_name(tmp_path: Path, seed: int) -> None:
    keys = ["backend: gloo", "timeout_s: 5", "verify: true"]
    dup = keys[seed].split(":")[0]
    path = tmp_path / "job.yaml"
    path.write_text("checkpoint_engine:\n" + "".join(f"  {k}\n" for k in keys) + f"  {keys[seed]}\n")
    with pytest.raises(ConfigError, match=rf"duplicate key '{dup}' \(first at line {seed + 2}\)"):
        load_config(path)
    path.write_text("daemon:\n  port: 1\ndaemon:\n  port: 2\n")
    with pytest.raises(ConfigError, match="duplicate key 'daemon'"):
        load_config(path)


BAD_OPTIONS = [
    ("solo_bytes", -1), ("group_max_tensors", 1.5), ("delta_scatter_below", 0.9), ("device", "cuda:0"),
]


@pytest.mark.parametrize("option,value", BAD_OPTIONS)
def test_backend_option_values_are_refused_at_load(option: str, value: object, tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("checkpoint_engine:\n  backend: gloo\n  engine_kwargs:\n    gloo:\n      group_max_tensors: 0\n")
    load_config(path)  # (imports the backends once)
    path.write_text("checkpoint_engine:\n  backend: gloo\n  engine_kwargs:\n    gloo:\n      " + f"{option}: {json.dumps(value)}\n")
    with pytest.raises(ConfigError, match=rf"checkpoint_engine.engine_kwargs.gloo.{option}"):
        load_config(path)  # refused by the load itself: no engine is made, no sync started (nothing to time)


# --- many senders: rank 0 dies, rank 1 says so -------------------------------------------------
@pytest.fixture(scope="module")
def ms_engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[TorchRefRollout]]:
    from multisender import model_state, wire

    spec = tmp_path_factory.mktemp("ms") / "spec.msgpack"
    write_spec_file(spec, StateDictSource(wire(model_state(0))).metadata())
    rs = [spawn_engine(f"ms{i}", spec_file=str(spec), timeout_s=60) for i in range(2)]
    yield rs
    for r in rs:
        r.close()


@pytest.mark.parametrize("piece", [2, 3, 4])
def test_rank_1_names_a_dead_rank_0(ms_engines: list[TorchRefRollout], tmp_path: Path, piece: int) -> None:
    from _sender_trainer import trainer_main
    from ranks import forkserver_context
    from ckpt_engine.benchmark.processes import run_processes
    from ckpt_engine.trainer.ports import free_port

    port = free_port()
    info = [{"name": e.name, "host": e.rpc.host, "port": e.rpc.port, "token": e.token} for e in ms_engines]
    ctx = forkserver_context()
    kill = {"rank": 0, "version": 1, "piece": piece}
    procs = [ctx.Process(target=trainer_main, args=(r, 2, port, info, str(tmp_path), 2, kill, None, 4.0)) for r in range(2)]
    run_processes(procs, 150)
    assert not (tmp_path / "rank0.json").exists()  # killed
    follower = json.loads((tmp_path / "rank1.json").read_text())
    assert [e["ok"] for e in follower] == [True, False], follower
    assert "trainer rank 0 (the controller)" in follower[1]["error"], follower[1]["error"]


# --- issue 45, items 4-5: versions and owners from a caller that claims no group ----------------
def test_an_unclaimed_caller_cannot_freeze_the_versions_or_claim_with_a_non_string_owner(tmp_path: Path) -> None:
    path = tmp_path / "spec.msgpack"
    write_spec_file(path, StateDictSource(weights(0)).metadata())
    engine = spawn_engine("unclaimed", spec_file=str(path), timeout_s=TIMEOUT_S, token=TOKEN)
    try:  # a version change from a caller that names no group moves at most 2**32 past what the engine held
        for method in ("swap", "finalize"):
            extra = {"pause_mode": "none"} if method == "swap" else {}
            with pytest.raises(RpcError, match="jumps more than 2\\*\\*32 past the current version"):
                engine.rpc.call(method, version=2**63 - 1, **extra)
        for owner in (5, b"group", ["g"], ""):  # refused, and the engine is not claimed by it
            with pytest.raises(RpcError, match="owner must be a non-empty string"):
                engine.rpc.call("pause", owner=owner, mode="none")
        engine.rpc.call("pause", mode="none")  # a caller naming no group still gets in: nobody owns it
        assert not engine.health()["owned"]
    finally:
        engine.close()
