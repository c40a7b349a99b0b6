"""FSDP2 senders replay their copy plan across dense hand-off syncs, and rebuild it when the shards move.

Three real processes: FSDP2 trainer ranks 0 and 1 (a tiny bf16 Qwen2-MoE whose router travels as
fp32, so the pieces are stable views plus a few kept casts) and one receiver; `nccl_handoff` on
gloo with trainer rank 1 handing its buckets over in shared memory. Four dense syncs: the first
records each sender's plan; between the first and the second every shard changes in place (the
plan is replayed and must carry the new values, router casts included); before the third the
model is materialized again (every shard in new memory: the plan must be rebuilt, never replayed
into the old memory); the fourth replays the rebuilt plan. The receiver must equal what
`iter_weights()` gathers on trainer rank 0 at every sync, bit for bit.
"""

from __future__ import annotations

import datetime
import uuid
from itertools import chain
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests._trainer_mp import run_ranks
from tests.test_fsdp2_shards import tiny_moe
from ckpt_engine.store import serve_store

pytestmark = pytest.mark.timeout(240)

TRAINERS = 2
SYNCS = 4


def _change(engine: Any, sync: int) -> None:
    """Before sync 1: every other word of every shard scaled in place. Before sync 2: every shard in
    new memory with new values."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        if sync == 1:
            for p in engine.model.parameters():
                local = p.to_local() if isinstance(p, DTensor) else p
                local.view(-1)[::2].mul_(1.5)
        elif sync == 2:
            engine.materialize(init=lambda name, local: local.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(len(name))))
            for b in engine.model.buffers():  # materialize leaves buffers uninitialized: the same on every rank
                b.fill_(0.25)


def _trainer(rank: int, rdzv: Any) -> dict[str, Any]:
    from ckpt_engine.registry import CheckpointEngineRegistry
    from ckpt_engine.sources.sharded import iter_pieces
    from ckpt_engine.trainer.engines.fsdp2 import FSDP2Config, FSDP2TrainEngine

    group = dist.new_group(list(range(TRAINERS)))
    engine = FSDP2TrainEngine(tiny_moe(False).to(torch.bfloat16), config=FSDP2Config(wire_dtype="bfloat16"), process_group=group)
    sync = CheckpointEngineRegistry.new("nccl_handoff", bucket_size_bytes=8192, timeout_s=60, local_senders=[1])
    manifest = sync.plan(engine.source.metadata(), num_senders=TRAINERS, owners=engine.source.owners())
    if rank == 0:
        from ckpt_engine.manifest import encode_manifest

        rdzv.connect_store().set("manifest", encode_manifest(manifest))
    sync.init_process_group(rdzv, rank)
    out: dict[str, Any] = {"builds": [], "stable": engine.source.stable_pieces, "tensors": {}}
    for i in range(SYNCS):
        _change(engine, i)
        expected = {n: t.clone() for n, t in engine.source.iter_weights()}  # gathers: collective on both trainer ranks
        sync.send_weights(manifest, iter_pieces(engine.source, manifest), stable=engine.source.stable_pieces)
        out["builds"].append(sync.send_plan_builds)
        if rank == 0:
            out["tensors"].update({f"s{i}/{n}": t for n, t in expected.items()})
    sync.finalize()
    return out


def _receiver(rank: int, rdzv: Any) -> dict[str, Any]:
    from ckpt_engine.manifest import decode_manifest
    from ckpt_engine.registry import CheckpointEngineRegistry

    dist.new_group(list(range(TRAINERS)))  # new_group is collective over every process
    store = rdzv.connect_store()
    store.wait(["manifest"], datetime.timedelta(seconds=rdzv.timeout_s))
    manifest = decode_manifest(store.get("manifest"))
    sync = CheckpointEngineRegistry.new("nccl_handoff", bucket_size_bytes=8192, timeout_s=60, local_senders=[1])
    sync.init_process_group(rdzv, rank)
    got: dict[str, torch.Tensor] = {}
    for i in range(SYNCS):
        got.update({f"s{i}/{n}": t.clone() for n, t in chain.from_iterable(sync.receive_buckets(manifest))})
    sync.finalize()
    return {"tensors": got}


def _worker(rank: int, world_size: int, rdzv: dict[str, Any]) -> dict[str, Any]:
    from ckpt_engine.engine import Rendezvous

    r = Rendezvous.from_dict(rdzv)
    return _trainer(rank, r) if rank < TRAINERS else _receiver(rank, r)


def test_fsdp2_senders_replay_their_plan_and_rebuild_it_when_shards_move() -> None:
    from ckpt_engine.engine import Rendezvous

    store = serve_store("127.0.0.1", 120)
    rdzv = Rendezvous("127.0.0.1", store.port, uuid.uuid4().hex, TRAINERS + 1, "nccl_handoff", 60.0, TRAINERS).to_dict()
    preload = ("torch.distributed.fsdp", "transformers.models.qwen2_moe.modeling_qwen2_moe", "ckpt_engine.trainer.engines.fsdp2")
    results = run_ranks(_worker, TRAINERS + 1, timeout_s=180, preload=preload, rdzv=rdzv)
    del store
    expected, got = results[0]["tensors"], results[TRAINERS]["tensors"]
    assert results[0]["stable"], "a bf16 model with an fp32 router must give stable pieces (the replayed path)"
    assert set(got) == set(expected)
    bad = [k for k in expected if not torch.equal(got[k].view(-1).view(torch.uint8), expected[k].contiguous().view(-1).view(torch.uint8))]
    assert bad == []
    assert any(not torch.equal(expected[f"s0/{k[3:]}"], expected[k]) for k in expected if k.startswith("s1/"))  # sync 1 did change
    for trainer in results[:TRAINERS]:
        # Recorded at sync 0, replayed at 1 (changed in place), rebuilt at 2 (moved), replayed at 3.
        assert trainer["builds"] == [1, 1, 2, 2]
