"""Copy plans kept across syncs (`backends/copy_plan.py`): replayed while the tensors stay where they
were, rebuilt the moment a sender's source tensor or a receiver's destination is replaced.

A stale plan would be silent corruption (the old memory's bytes sent, or new bytes written where
the loader no longer looks), so every test here checks the receiver bit for bit against what the
senders hold at that sync, and checks the plan was really replayed when nothing moved (else the
invalidation tests would pass vacuously). Real processes and gloo groups: 2 senders with dim-0 row
shards and whole tensors, 1 receiver; through `nccl_handoff` with sender 1 handing over in memory.
"""

from __future__ import annotations

from itertools import chain
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

from ckpt_engine.engine import Rendezvous
from ckpt_engine.registry import CheckpointEngineRegistry
from ckpt_engine.benchmark.sharded_source import ShardedStateDictSource
from ckpt_engine.sources.sharded import iter_pieces
from ckpt_engine.sources.base import WatchedWeights
from ranks import run_ranks
from roundtrip import same_bits

SENDERS = 2


def _state(version: int, moved: bool) -> dict[str, torch.Tensor]:
    """Many small matrices and an uneven one (each sender sends its dim-0 rows), a tensor larger than
    a bucket, a replicated 1-D one; `moved` builds every tensor in new memory."""
    g = torch.Generator().manual_seed(version)
    sd = {f"experts.{i}.w": torch.randn(8, 16, generator=g).bfloat16() for i in range(40)}
    sd["attn.q"] = torch.randn(37, 24, generator=g).bfloat16()  # rows split unevenly over 2 senders
    sd["big"] = torch.randn(64, 300, generator=g)  # fp32, larger than a 16 KiB bucket: chunks
    sd["norm"] = torch.randn(24, generator=g)  # 1-D: replicated, the planner picks a sender
    if moved:
        sd = {k: v.clone() for k, v in sd.items()}
    return sd


def _plan_rank(rank: int, rdzv: Rendezvous, *, local_senders: list[int] | None, move_destination: bool, watched: bool = False) -> dict[str, Any]:
    kwargs: dict[str, Any] = {} if local_senders is None else {"local_senders": local_senders}
    engine = CheckpointEngineRegistry.new(rdzv.backend, bucket_size_bytes=16 * 1024, timeout_s=rdzv.timeout_s, **kwargs)
    engine.init_process_group(rdzv, rank)
    out: dict[str, Any] = {"bad": [], "builds": []}
    # Sync 0 records; sync 1 changes values in place (replayed); sync 2 moves every tensor (rebuilt);
    # sync 3 replays the rebuilt plan.
    sd = _state(0, moved=False)
    source = ShardedStateDictSource(sd, rank, SENDERS) if rank < SENDERS else None
    dst: dict[str, torch.Tensor] | None = None
    for sync in range(4):
        if sync == 1:
            for t in sd.values():
                t.mul_(-2)  # same memory, new values
        if sync == 2:
            sd = _state(2, moved=True)
            if rank < SENDERS:
                source = ShardedStateDictSource(sd, rank, SENDERS)
        specs = ShardedStateDictSource(sd, 0, SENDERS).metadata()
        owners = ShardedStateDictSource(sd, 0, SENDERS).owners()
        manifest = engine.plan(specs, num_senders=SENDERS, owners=owners)
        if rank < SENDERS:
            assert source is not None
            walk = iter_pieces(source, manifest)
            engine.send_weights(manifest, WatchedWeights(walk) if watched else walk, stable=True)
            out["builds"].append(engine.send_plan_builds)
            continue
        if dst is None or (move_destination and sync == 2):
            dst = {k: torch.zeros_like(v) for k, v in sd.items()}  # the loader's own tensors, new memory
        got: dict[str, torch.Tensor] = {}
        for name, t in chain.from_iterable(engine.receive_buckets(manifest, dst)):
            if sd[name].dim() >= 2 and t.data_ptr() != dst[name].data_ptr():  # rows from both senders: reassembled in place
                out["bad"].append(f"sync {sync}: {name} was not reassembled in the loader's current destination")
            got[name] = t.clone()
        out["bad"] += [f"sync {sync}: {k}" for k, v in sd.items() if k not in got or not same_bits(got[k], v)]
        out["bad"] += [f"sync {sync}: destination {k}" for k, v in sd.items() if v.dim() >= 2 and not same_bits(dst[k], v)]
        out["builds"].append(engine.receive_plan_builds)
    engine.finalize()
    return out


@pytest.mark.parametrize("local_senders,watched", [(None, False), ([1], False), (None, True)], ids=["broadcast", "handoff", "watched"])
def test_moved_source_tensors_rebuild_the_send_plan(local_senders: list[int] | None, watched: bool) -> None:
    """`watched`: the walk wrapped as `sync_rollout_weights` wraps a many-sender rank's pieces
    (WatchedWeights), which passes the walk's anchors through."""
    backend = "gloo" if local_senders is None else "nccl_handoff"
    results = run_ranks(
        _plan_rank, SENDERS + 1, backend=backend, num_senders=SENDERS, local_senders=local_senders, move_destination=False, watched=watched
    )
    receiver = results[SENDERS]
    assert receiver["bad"] == []
    for sender in results[:SENDERS]:
        # Recorded at sync 0, replayed at 1 (values changed in place), rebuilt at 2 (moved), replayed at 3.
        assert sender["builds"] == [1, 1, 2, 2]


def test_replaced_destinations_rebuild_the_receive_plan() -> None:
    results = run_ranks(_plan_rank, SENDERS + 1, backend="gloo", num_senders=SENDERS, local_senders=None, move_destination=True)
    receiver = results[SENDERS]
    assert receiver["bad"] == []
    # The loader's destinations are replaced at sync 2 (sources moved too): rebuilt there, replayed after.
    assert receiver["builds"] == [1, 1, 2, 2]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from(["bf16", "fp32", "gap", "strided"]), min_size=1, max_size=12), st.integers(0, 2**31 - 1))
def test_coalesced_copies_write_what_the_pairs_write(kinds: list[str], seed: int) -> None:
    """`coalesce` merges only pairs back to back on both sides and drops pairs already in place:
    one batched copy of its result leaves every destination equal to its source."""
    from ckpt_engine.pipeline.copy_plan import coalesce

    g = torch.Generator().manual_seed(seed)
    src_store = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=g)
    dst_store = torch.zeros(4096, dtype=torch.uint8)
    dsts, srcs, s_off, d_off = [], [], 0, 0
    for kind in kinds:
        dtype = torch.float32 if kind == "fp32" else torch.bfloat16
        n = 6 * dtype.itemsize
        d_off += 4 if kind == "gap" else 0  # not back to back in the destination: no merge across it
        src, dst = src_store[s_off : s_off + n].view(dtype), dst_store[d_off : d_off + n].view(dtype)
        if kind == "strided":
            src, dst = src.view(2, 3).t(), dst.view(3, 2)
        dsts.append(dst)
        srcs.append(src)
        s_off, d_off = s_off + n, d_off + n
    dsts.append(dsts[0])  # a pair already in place is dropped
    srcs.append(dsts[0])
    merged_d, merged_s = coalesce(dsts, srcs)
    assert len(merged_d) <= len(kinds)
    torch._foreach_copy_(merged_d, merged_s)
    assert all(same_bits(d, s) for d, s in zip(dsts, srcs))
    if len(set(kinds)) == 1 and kinds[0] in ("bf16", "fp32"):
        assert len(merged_d) == 1  # one dtype, back to back on both sides: a single byte copy
