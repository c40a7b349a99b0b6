"""Megatron with tensor parallelism as a multi-sender source: TP rank 0 of each stage sends, the
other TP ranks help with the within-stage gathers (they join no weight-sync group).

A spawn of 4 real megatron-core trainer processes (gloo, CPU) runs a tiny Qwen3-MoE as TP=2 x PP=2
(expert TP 1): through the engine path into a receiver thread of this process, then through
`sync_rollout_weights(senders="all")` into a reference engine process, including a sync a helper
cannot take part in (it must fail on every rank, by name, at once) and one that heals. Receivers
must hold, bit for bit, what the single-sender `iter_weights()` export yields on trainer rank 0;
a counter shows the pieces and the send issue no collective beyond the TP group's all-gathers.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
import torch
from ckpt_engine.store import serve_store


pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install megatron-core==0.16.1)")
pytestmark = pytest.mark.timeout(240)

from test_megatron_shards import BUCKET, _bits, _run_into_reference, _trained_state  # noqa: E402  (after the skip)


# --- TP=2 x PP=2: TP rank 0 of each stage sends, the other TP rank helps with the gathers ----------

TP_RANKS = 4  # global rank = tp_rank + 2 * pp_rank (Megatron's order): senders 0 and 2, helpers 1 and 3


def _helper_walk(manifest: Any, sender: int) -> list[str]:
    """The names a sender's pieces walk (iter_pieces' order): what its TP helper assists with."""
    names: list[str] = []
    for bucket in manifest.sender_buckets(sender):
        names += [e.name for e in bucket.entries if not names or e.name != names[-1]]
    return names


def _tp_engine_path(rank: int, engine: Any, rdzv: Any) -> dict[str, Any]:
    """Senders send their stage's TP-gathered tensors into the receiver thread; helpers walk the
    same gathers (`assist_piece`). Counters on the TP group around the pieces and the send."""
    from ckpt_engine.manifest import encode_manifest
    from ckpt_engine.registry import CheckpointEngineRegistry
    from ckpt_engine.sync.sender_follower import finish_walk
    from ckpt_engine.sources.sharded import iter_pieces
    from tests.test_fsdp2_shards import GatherCounter

    g = engine.groups
    sync = CheckpointEngineRegistry.new("gloo", bucket_size_bytes=BUCKET, timeout_s=60)
    manifest = sync.plan(engine.source.metadata(), num_senders=engine.source.num_senders, owners=engine.source.owners())
    walk = _helper_walk(manifest, engine.source.sender_index)
    out: dict[str, Any] = {"sender": [engine.source.sender_index, engine.source.num_senders, engine.source.sends, g.pp_rank, g.tp_rank]}
    with GatherCounter(g.tp) as pieces:
        if engine.source.sends:
            produced = {n: t.clone() for n, t in iter_pieces(engine.source, manifest)}
        else:
            for name in walk:
                engine.source.assist_piece(name)
    with GatherCounter(g.tp) as exporting:
        expected = {n: t.clone() for n, t in engine.source.iter_weights()}
    if rank == 0:
        rdzv.connect_store().set("manifest/tp2pp2", encode_manifest(manifest))
        out["tensors"] = {f"tp2pp2/{n}": t for n, t in expected.items()}
        out["pieces_differ"] = [n for n, t in produced.items() if not torch.equal(_bits(t), _bits(expected[n]))]
    with GatherCounter(g.tp) as sending:
        if engine.source.sends:
            sync.init_process_group(rdzv, engine.source.sender_index)
            sync.send_weights(manifest, iter_pieces(engine.source, manifest), stable=engine.source.stable_pieces)
            sync.finalize()
        else:
            for name in walk:
                engine.source.assist_piece(name)
    if engine.source.sends:  # a send that dies after two pieces: finish_walk takes the sender through the rest
        rest = iter_pieces(engine.source, manifest)
        next(rest), next(rest)
        finish_walk(engine.source, rest)
    else:  # else its helper would wait in the third piece's gather until this run's timeout
        for name in walk:
            engine.source.assist_piece(name)
    out["counts"] = {"pieces": pieces.summary(), "iter_weights": exporting.summary(), "send": sending.summary()}
    out["walk"], out["specs"] = walk, {s.name: [s.dtype, list(s.shape)] for s in engine.source.metadata()}
    return out


def _tp_session_path(rank: int, engine: Any, info: dict[str, Any]) -> dict[str, Any]:
    """`sync_rollout_weights(senders="all")`: a sync, every parameter moved, a sync that trainer
    rank 1 (rank 0's TP helper) cannot take part in (its metadata disagrees), a sync that heals."""
    from ckpt_engine import CheckpointEngineConfig, sync_rollout_weights
    from ckpt_engine.rollout_adapters.torch_ref import TorchRefRollout
    from ckpt_engine.sync.api import close_sessions

    handles = [TorchRefRollout(info["name"], info["host"], info["port"], None, 60, token=info["token"])] if rank == 0 else None
    config = CheckpointEngineConfig(backend="gloo", bucket_size_mb=BUCKET / 2**20, timeout_s=60, senders="all")
    reports = [sync_rollout_weights(engine.source, handles, config=config)]
    first = {n: t.clone() for n, t in engine.source.iter_weights()}
    out: dict[str, Any] = {"first_synced": [n for n, t in first.items() if rank == 0 and not torch.equal(_bits(handles[0].get_tensor(n)), _bits(t))]}
    with torch.no_grad():  # a stand-in for an optimizer step: every parameter moves
        for i, p in enumerate(engine.model.parameters()):
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * rank + i)) * 0.01)
    if rank == 1:  # a test-only hook on this rank's source: its plan's digest differs from rank 0's
        listed = engine.source.metadata()
        engine.source.metadata = lambda: list(reversed(listed))
    t0 = time.perf_counter()
    try:
        sync_rollout_weights(engine.source, handles, config=config)
        out["failure"] = None
    except Exception as exc:
        out["failure"] = f"{type(exc).__name__}: {exc}"
    out["failure_s"] = time.perf_counter() - t0
    if rank == 1:
        del engine.source.metadata
    reports.append(sync_rollout_weights(engine.source, handles, config=config))  # healed: a new group, every rank again
    out["reports"] = [None if r is None else {"senders": r.senders, "tensors": r.tensors, "version": r.version} for r in reports]
    moved = {f"moved/{n}": t.clone() for n, t in engine.source.iter_weights()}
    if rank == 0:
        out["tensors"] = moved
        out["moved"] = [n for n, t in first.items() if not torch.equal(t, moved[f"moved/{n}"])]
    close_sessions()
    return out


def _tp_worker(rank: int, world_size: int, rdzv: dict[str, Any], engine_info: dict[str, Any]) -> dict[str, Any]:
    from megatron.core import parallel_state as ps

    from ckpt_engine.engine import Rendezvous
    from ckpt_engine.trainer.engines.megatron import MegatronConfig, MegatronTrainEngine
    from ckpt_engine.sources.megatron_groups import MegatronGroups
    from ckpt_engine.sources.megatron import sharded_refusal

    cfg, sd = _trained_state()
    result: dict[str, Any] = {}
    ps.initialize_model_parallel(tensor_model_parallel_size=2, expert_model_parallel_size=2, expert_tensor_parallel_size=1)
    result["tp_ep_refusal"] = sharded_refusal(MegatronGroups.from_megatron(), "gather_to_first", cfg.num_experts)
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, expert_tensor_parallel_size=1)
    engine = MegatronTrainEngine(cfg, config=MegatronConfig(wire_dtype="bfloat16", moe_token_dispatcher_type="allgather"))
    engine.load_hf_weights(sd)
    result["engine"] = _tp_engine_path(rank, engine, Rendezvous.from_dict(rdzv))
    result["session"] = _tp_session_path(rank, engine, engine_info)
    result["tensors"] = {**result["engine"].pop("tensors", {}), **result["session"].pop("tensors", {})}
    ps.destroy_model_parallel()
    return result


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], dict[str, torch.Tensor]]:
    from ckpt_engine.engine import Rendezvous

    store = serve_store("127.0.0.1", 120)
    rdzv = Rendezvous("127.0.0.1", store.port, uuid.uuid4().hex, 3, "gloo", 60.0, 2)  # 2 senders + the receiver
    results, got = _run_into_reference(tmp_path_factory, _tp_worker, TP_RANKS, {"tp2pp2": rdzv}, "megatron-tp-ref", 200, rdzv=rdzv.to_dict())
    del store
    return results, got


def test_tp2_senders_and_helpers_are_bit_exact_with_the_single_sender_export(tp_runs: Any) -> None:
    """TP rank 0 of each stage sends (sender = stage), TP rank 1 is its helper; the receiver holds
    exactly what iter_weights() exports (TP gathered, qkv / gate-up split, bf16 with fp32 router)."""
    ranks, got = tp_runs
    assert [r["engine"]["sender"] for r in ranks] == [[0, 2, True, 0, 0], [0, 2, False, 0, 1], [1, 2, True, 1, 0], [1, 2, False, 1, 1]]
    assert ranks[0]["engine"]["walk"] == ranks[1]["engine"]["walk"] and ranks[2]["engine"]["walk"] == ranks[3]["engine"]["walk"]
    specs = ranks[0]["engine"]["specs"]
    assert sorted(ranks[0]["engine"]["walk"] + ranks[2]["engine"]["walk"]) == sorted(specs)  # each tensor once
    assert not ranks[0]["engine"]["pieces_differ"]
    assert sorted(n.removeprefix("tp2pp2/") for n in got if n.startswith("tp2pp2/")) == sorted(specs)
    for name, (dtype, shape) in specs.items():
        rec, exp = got[f"tp2pp2/{name}"], ranks[0]["tensors"][f"tp2pp2/{name}"]
        assert str(rec.dtype) == f"torch.{dtype}" and list(rec.shape) == shape, name
        assert torch.equal(_bits(rec), _bits(exp)), f"{name} differs from the single-sender export"
    assert specs["model.layers.1.mlp.gate.weight"][0] == "float32" and "model.layers.1.self_attn.k_proj.weight" in ranks[2]["engine"]["walk"]
    assert "TP > 1 with expert parallelism 1 only (got TP=2, EP=2)" in ranks[0]["tp_ep_refusal"]


def test_tp2_pieces_gather_within_the_stage_only(tp_runs: Any) -> None:
    """Producing the pieces (senders) and assisting (helpers) issue all-gathers on the TP group
    and nothing else: no PP broadcast, no other group; iter_weights() shows the counter sees its
    PP broadcasts. The weight-sync group's own gloo broadcasts bypass the dispatcher."""
    ranks, _ = tp_runs
    for r, result in enumerate(ranks):
        counts = result["engine"]["counts"]
        for phase in ("pieces", "send"):
            c = counts[phase]
            assert c["on_group"] == c["calls"] > 0 and c["collectives"] == c["dispatched"] > 0, (r, phase, c)
        export = counts["iter_weights"]
        assert export["collectives"] > export["dispatched"] > 0, (r, export)  # the stage broadcasts


def test_tp2_syncs_through_sync_rollout_weights_and_a_helper_failure_fails_every_rank(tp_runs: Any) -> None:
    """senders="all": rank 0 controls, rank 2 follows and sends stage 1, ranks 1 and 3 help. A
    helper that cannot take part (its plan disagrees) fails the sync on every rank, named, without
    leaving its sender in a gather; the next sync heals and delivers the moved weights bit for bit."""
    ranks, got = tp_runs
    session = [r["session"] for r in ranks]
    assert not session[0]["first_synced"]  # the first sync delivered the export, every tensor
    for r, s in enumerate(session):
        assert s["failure"] is not None and "trainer rank 1" in s["failure"] and "planned" in s["failure"], (r, s["failure"])
    assert session[0]["failure"].startswith("SyncError") and all(s["failure"].startswith("SendFailed") for s in session[1:])
    assert session[0]["failure"].startswith("SyncError: weight sync failed during transfer: trainer rank 1: planned")
    assert max(s["failure_s"] for s in session) < 30, session  # stopped in the ready round, not by a timeout
    assert [s["reports"] for s in session[1:]] == [[None, None]] * 3  # followers return nothing
    reports = session[0]["reports"]
    specs = ranks[0]["engine"]["specs"]
    assert [(x["senders"], x["tensors"]) for x in reports] == [(2, len(specs))] * 2 and reports[1]["version"] > reports[0]["version"]
    want = ranks[0]["tensors"]
    assert sorted(session[0]["moved"]) == sorted(specs)  # every tensor moved, so the ref's state is the healed sync's
    for name in specs:
        assert torch.equal(_bits(got[f"ref/{name}"]), _bits(want[f"moved/{name}"])), name
