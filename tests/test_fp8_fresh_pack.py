"""A fresh source's bucket is packed in one batched copy (`WeightSource.fresh_tensors`).

The FP8 wire's codes and scales are new memory of the walk that nothing writes again, so the sender
holds a bucket's pieces and packs them in one `_foreach_copy_` instead of a copy launch per piece
(~37k launches for a 30B-A3B). Real processes and a gloo group: one sender, one receiver; the
receiver's bytes are compared with the reference quantize of the same weights, with and without
the batched path, and the sender counts its batched copies (0 when the walk is not fresh).
"""

from __future__ import annotations

from itertools import chain
from typing import Any

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from ckpt_engine.engine import Rendezvous
from ckpt_engine.registry import CheckpointEngineRegistry
from ckpt_engine.sources.base import StateDictSource, WatchedWeights, WeightSource
from ckpt_engine.sources.fp8 import Fp8WireSource, ShardedFp8WireSource
from ckpt_engine.benchmark.sharded_source import ShardedStateDictSource
from ranks import run_ranks

def _model() -> dict[str, torch.Tensor]:
    """Many small projections (several a bucket), one larger than a bucket (chunks), unquantized ones."""
    g = torch.Generator().manual_seed(7)
    sd = {f"model.layers.0.mlp.experts.{i}.up_proj.weight": (torch.randn(64, 160, generator=g) * 0.02).bfloat16() for i in range(24)}
    sd["model.layers.0.self_attn.q_proj.weight"] = (torch.randn(300, 200, generator=g) * 0.02).bfloat16()
    sd["model.norm.weight"] = torch.randn(160, generator=g).bfloat16()
    sd["lm_head.weight"] = (torch.randn(96, 160, generator=g) * 0.02).bfloat16()
    return sd


def _rank(rank: int, rdzv: Rendezvous, *, fresh: bool, grouped: bool) -> dict[str, Any]:
    extra = {"group_max_tensors": 64} if grouped else {}  # per-tensor messages in one coalesced group (NCCL's default)
    engine = CheckpointEngineRegistry.new(rdzv.backend, bucket_size_bytes=24 * 1024, timeout_s=rdzv.timeout_s, **extra)
    engine.init_process_group(rdzv, rank)
    source = Fp8WireSource(StateDictSource(_model()))
    manifest = engine.plan(source.metadata())
    try:
        if rank == 0:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                engine.send_weights(manifest, WatchedWeights(source.iter_weights(), fresh=fresh), stable=False)
            batched = sum(1 for ev in prof.events() if ev.name == "aten::_foreach_copy_")
            dtypes = sum(len({e.dtype for e in b.entries if e.chunk_size}) for b in manifest.buckets)
            return {"batched": batched, "buckets": len(manifest.buckets), "dtype_groups": dtypes}
        expected = dict(source.iter_weights())
        bad = []
        seen = set()
        for name, t in chain.from_iterable(engine.receive_buckets(manifest)):
            seen.add(name)
            want = expected[name]
            if t.dtype != want.dtype or t.shape != want.shape or not torch.equal(t.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)):
                bad.append(name)
        bad += sorted(set(expected) - seen)
        return {"bad": bad, "n": len(seen)}
    finally:
        engine.finalize()


@pytest.mark.parametrize("fresh, grouped", [(True, False), (True, True), (False, False)])
def test_a_fresh_walk_packs_each_bucket_in_one_batched_copy_with_the_same_bytes(fresh: bool, grouped: bool) -> None:
    sender, receiver = run_ranks(_rank, 2, fresh=fresh, grouped=grouped)
    assert receiver["bad"] == [] and receiver["n"] > 0
    assert sender["buckets"] > 3
    # One batched copy a bucket and dtype on the fresh walk (before: a copy per piece, no batched
    # one): CUDA's `_foreach_copy_` batches only tensors of one dtype (codes, scales, bf16 norms).
    assert sender["dtype_groups"] > sender["buckets"]  # the model mixes dtypes within buckets
    assert sender["batched"] == (sender["dtype_groups"] if fresh else 0)


class _Reused(WeightSource):
    """A source that promises nothing of its tensors (neither stable nor fresh), as one reusing a
    staging buffer would."""

    def __init__(self, sd: dict[str, torch.Tensor]) -> None:
        self.inner = StateDictSource(sd)

    def metadata(self) -> list:
        return self.inner.metadata()

    def iter_weights(self):  # type: ignore[no-untyped-def]
        return self.inner.iter_weights()


def test_the_fp8_wire_is_fresh_only_where_its_unquantized_tensors_stay_valid() -> None:
    sd = _model()
    assert Fp8WireSource(StateDictSource(sd)).fresh_tensors
    assert not Fp8WireSource(StateDictSource(sd)).stable_tensors
    assert not Fp8WireSource(_Reused(sd)).fresh_tensors  # its norms and head pass through as the source yields them
    assert ShardedFp8WireSource(ShardedStateDictSource(sd, 0, 1)).fresh_tensors
