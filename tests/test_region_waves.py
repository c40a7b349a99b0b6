"""How many receiver sets a sender streams side by side: the width rule (a slot-memory budget over
one set's slots), its config key, the waves at any width, and a region sync of 10 TP receivers
(11 sets, 10 of them side by side) over real gloo groups, bit-exact with all sets at once and with
one set at a time; through the session, the budget reaches every sender."""

from __future__ import annotations

import datetime
import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt_engine import sync_rollout_weights
from ckpt_engine.config import CheckpointEngineConfig, ConfigError, load_config
from ckpt_engine.delta.request import DeltaRequest
from ckpt_engine.pipeline.region_assembly import RegionAssembly
from ckpt_engine.pipeline.region_groups import DEFAULT_PARALLEL_SETS, RegionGroups, parallel_sets, receive_regions, send_regions, waves
from ckpt_engine.planning.receive_sets import cut_region
from ckpt_engine.benchmark.processes import run_processes
from ckpt_engine.rollout_adapters.torch_ref import TorchRefRollout, write_spec_file
from ckpt_engine.benchmark.sharded_source import ShardedStateDictSource
from ckpt_engine.engine import Rendezvous
from tamper import GlooEngine
from helpers_procs import free_port
from ranks import forkserver_context, run_ranks
from refengines import same_bits, spawn_engine
from regionranks import KV_HEADS, layout, qwen2_specs, weights

BUCKET = 16 << 10
RECEIVERS = 10
"""TP=10 receivers: one set per rank (its slices) and one of all ten (what every rank holds)."""


def test_width_is_the_budget_over_one_sets_slots() -> None:
    mib = 1 << 20
    assert parallel_sets(None, 2, 64 * mib, 32) == DEFAULT_PARALLEL_SETS == 8  # unset: as before
    assert parallel_sets(None, 2, 64 * mib, 3) == 3  # never more than the sets
    assert parallel_sets(32 * 2 * 64 * mib, 2, 64 * mib, 32) == 32
    assert parallel_sets(32 * 2 * 64 * mib, 2, 64 * mib, 40) == 32
    assert parallel_sets(32 * 2 * 64 * mib - 1, 2, 64 * mib, 40) == 31
    assert parallel_sets(5 * 3 * mib, 3, mib, 40) == 5  # num_buffers x bucket per set
    assert parallel_sets(2 * mib - 1, 2, mib, 40) == 1  # below one set's slots: one at a time
    assert parallel_sets(0, 2, mib, 40) == 1
    with pytest.raises(ValueError, match="num_buffers and bucket_size_bytes"):
        parallel_sets(mib, 0, mib, 4)
    with pytest.raises(ValueError, match="budget must be >= 0"):
        parallel_sets(-1, 2, mib, 4)


def test_region_slot_memory_key() -> None:
    assert CheckpointEngineConfig().region_slot_memory_bytes is None
    cfg = load_config({}, ["checkpoint_engine.region_slot_memory_mb=4096"])
    assert cfg.region_slot_memory_mb == 4096 and cfg.region_slot_memory_bytes == 4096 << 20
    for bad in (0, -1, float("nan"), "lots", True, 2.0**31):
        with pytest.raises(ConfigError, match="checkpoint_engine.region_slot_memory_mb"):
            CheckpointEngineConfig(region_slot_memory_mb=bad)  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 11), min_size=1, max_size=4, unique=True), min_size=1, max_size=24),
    st.integers(1, 30),
)
def test_waves_keep_every_receivers_sets_in_index_order(members: list[list[int]], width: int) -> None:
    """At any width a receiver that takes its sets by index meets the senders wave by wave."""
    sets = [(k, tuple(sorted(m))) for k, m in enumerate(members)]
    out = waves(sets, width)
    assert sorted(k for w in out for k in w) == list(range(len(sets)))
    assert all(1 <= len(w) <= width for w in out)
    wave_of = {k: i for i, w in enumerate(out) for k in w}
    for w in out:  # a wave's sets share no receiver
        seen = [r for k in w for r in sets[k][1]]
        assert len(seen) == len(set(seen))
    for r in range(12):
        mine = [k for k, m in sets if r in m]
        assert [wave_of[k] for k in mine] == sorted(wave_of[k] for k in mine)


def test_ten_disjoint_sets_go_in_one_wave_when_the_width_allows() -> None:
    sets = [(s.index, s.members) for s in layout("tp", qwen2_specs(1), RECEIVERS).sets]
    assert len(sets) == RECEIVERS + 1
    assert waves(sets, RECEIVERS) == [list(range(RECEIVERS)), [RECEIVERS]]
    assert waves(sets) == [list(range(8)), [8, 9], [10]]
    assert waves(sets, 1) == [[k] for k in range(RECEIVERS + 1)]


def _rank(rank: int, rdzv: Rendezvous, budget: int) -> dict[str, Any]:
    specs = qwen2_specs(1)
    by_name = {s.name: s for s in specs}
    lay = layout("tp", specs, RECEIVERS)
    engines: list[GlooEngine] = []

    def make() -> GlooEngine:
        engines.append(GlooEngine(bucket_size_bytes=BUCKET, num_buffers=2, timeout_s=60, solo_bytes=0))
        return engines[-1]

    planner = GlooEngine(bucket_size_bytes=BUCKET, timeout_s=60, solo_bytes=0)
    manifests = {s.index: planner.plan([p.spec for p in s.pieces]) for s in lay.sets}
    width = parallel_sets(budget, 2, BUCKET, len(lay.sets))
    groups = RegionGroups(rdzv, rank, lay.digest, [(s.index, s.members) for s in lay.sets], make, width=width)
    groups.join()
    out: dict[str, Any] = {"width": width, "waves": groups.waves, "ok": []}
    out["slot_memories"] = len({e.transport.buffers[0].data_ptr() for e in engines})
    receiver = rank - 1
    held = lay.held[receiver] if receiver >= 0 else {}
    tensors = {n: torch.zeros(cut_region(torch.empty(by_name[n].shape, device="meta"), rs[0]).shape) for n, rs in held.items()}
    asm = RegionAssembly(held, (p for s in lay.sets_of(receiver) for p in s.pieces), by_name) if receiver >= 0 else None
    for v in range(2):
        w = weights(specs, v)
        delta = DeltaRequest(v > 0, v if v > 0 else None, v + 1)
        if rank == 0:
            send_regions(groups, lay.sets, manifests, w, {s.name: s.shape for s in specs}, delta=delta)
            continue
        assert asm is not None
        for items in receive_regions(groups, manifests, asm, tensors, delta=delta):
            for name, _region, t in items:
                tensors[name].copy_(t)
        out["ok"].append([n for n, rs in held.items() if not torch.equal(tensors[n], cut_region(w[n], rs[0]).contiguous())] == [])
    groups.close()
    return out


@pytest.mark.parametrize("sets_at_once", [RECEIVERS, 1])
def test_more_than_eight_sets_side_by_side_are_bit_exact(sets_at_once: int) -> None:
    budget = sets_at_once * 2 * BUCKET if sets_at_once > 1 else 2 * BUCKET - 1  # below one set's slots: one at a time
    res = run_ranks(_rank, 1 + RECEIVERS, timeout_s=120, budget=budget)
    sender = res[0]
    assert sender["width"] == sets_at_once
    assert max(len(w) for w in sender["waves"]) == sets_at_once
    assert sender["slot_memories"] == sets_at_once  # each set of a wave from its own slots, reused by the next wave
    for r in res[1:]:
        assert r["ok"] == [True, True]  # a dense and a delta sync, every slice bit for bit
        assert r["slot_memories"] == 1


class _Said(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _trainer(rank: int, world: int, port: int, engines: list[dict[str, Any]], out_dir: str, budget_mb: float) -> None:
    """A trainer rank of the session test: two versions of the tiny Qwen2 from both ranks (senders=all)."""
    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30)
    )
    said = _Said()
    logging.getLogger("ckpt_engine.sync.regions").addHandler(said)
    logging.getLogger("ckpt_engine.sync.regions").setLevel(logging.INFO)
    cfg = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.0625, timeout_s=20, delta="on", senders="all", region_slot_memory_mb=budget_mb)
    handles = [TorchRefRollout(e["name"], e["host"], e["port"], None, 20, token=e["token"]) for e in engines] if rank == 0 else None
    log: list[dict[str, Any]] = []
    for v in range(2):
        source = ShardedStateDictSource(weights(qwen2_specs(), v), rank, world)
        source.is_sender = rank == 0
        try:
            report = sync_rollout_weights(source, handles, config=cfg)
            log.append({"ok": True, "delta": report.delta if report else None})
        except Exception as exc:
            log.append({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
            break
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"log": log, "said": [s for s in said.lines if "side by side" in s]}, f)


def test_the_budget_reaches_every_sender_through_the_session(tmp_path: Path) -> None:
    """Two trainer ranks into two TP=2 ranks (sets {0}, {1}, {0, 1}) with a budget below one set's
    slots: rank 0 streams one set at a time and announces it; the other rank follows; bit-exact."""
    spec = tmp_path / "qwen2.msgpack"
    write_spec_file(spec, qwen2_specs())
    layouts = [{"tp_size": 2, "tp_rank": r, "num_kv_heads": KV_HEADS} for r in range(2)]
    engines = [spawn_engine(f"tp{r}", spec_file=str(spec), timeout_s=60, layout=lay) for r, lay in enumerate(layouts)]
    try:
        info = [{"name": e.name, "host": e.rpc.host, "port": e.rpc.port, "token": e.token} for e in engines]
        ctx = forkserver_context()
        port = free_port()
        procs = [ctx.Process(target=_trainer, args=(r, 2, port, info, str(tmp_path), 0.0625)) for r in range(2)]
        run_processes(procs, 240)
        out = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
        for r in range(2):
            assert [e["ok"] for e in out[r]["log"]] == [True, True], out[r]
        assert [e["delta"] for e in out[0]["log"]] == ["seed", "patch"]
        assert out[0]["said"] == ["region delivery: 1 receiver set(s) side by side (of 3)"]
        w = weights(qwen2_specs(), 1)
        for e in engines:
            (plan,) = e.receive_plans()
            assert plan is not None
            for name, regions in plan.holds.items():
                want = cut_region(w[name], regions[0] if regions is not None else None).contiguous()
                assert same_bits(e.get_tensor(name), want), (e.name, name)
    finally:
        for e in engines:
            e.close()
