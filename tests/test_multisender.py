"""Several senders over real gloo groups: every sender streams the shards it owns, receivers
reassemble bit-exact tensors without learning how the trainer was sharded."""

from __future__ import annotations

import pytest

from ckpt_engine.planning.buckets import plan_buckets
from ckpt_engine.manifest import ManifestError, TensorSpec, decode_manifest, encode_manifest
from ckpt_engine.planning.ownership import Shard, row_shards
from multisender import even_rows, shard_rank
from ranks import run_ranks


@pytest.mark.parametrize(("senders", "receivers", "verify"), [(2, 1, True), (3, 2, False)])
def test_shards_from_every_sender_reassemble_bit_exact(senders: int, receivers: int, verify: bool) -> None:
    """Uneven dim-0 shards (37 rows over 2 or 3 senders; 3 rows over 3: one sender owns none),
    tensors larger than a bucket, replicated small tensors balanced over senders, bf16 wire with
    an fp32 router; three versions over the same group and buffers; with `verify`, every bucket's
    checksum travels with it and is checked before loading."""
    results = run_ranks(shard_rank, senders + receivers, num_senders=senders, engine_kwargs={"verify": verify})
    for r in results[senders:]:
        assert r["bad"] == [] and r["errors"] == []
    sent = [sum(s["bytes"] for s in r["stats"]) for r in results[:senders]]
    assert min(sent) > 0.5 * max(sent), f"bytes per sender are unbalanced: {sent}"


def test_planner_balances_and_splits_per_sender() -> None:
    specs = [TensorSpec(f"w{i}", "bfloat16", (64, 32)) for i in range(6)] + [TensorSpec(f"b{i}", "float32", (32,)) for i in range(8)]
    owners = {s.name: row_shards(s, even_rows(64, 2)) for s in specs if len(s.shape) == 2}
    m = plan_buckets(specs, 4096, num_senders=2, owners=owners)
    assert m.num_senders == 2 and decode_manifest(encode_manifest(m)) == m
    per = m.bytes_per_sender()
    assert per[0] == per[1]  # halves of every matrix, and the vectors split 4 / 4
    assert [b.sender for b in m.buckets[:4]] == [0, 1, 0, 1]  # interleaved round-robin
    with pytest.raises(ManifestError, match="cover"):
        plan_buckets(specs[:1], 4096, num_senders=2, owners={"w0": [Shard(0, 0, 100), Shard(1, 200, 4096)]})
    with pytest.raises(ManifestError, match="shard sender 2 is not in"):
        plan_buckets(specs[:1], 4096, num_senders=2, owners={"w0": [Shard(2, 0, 4096)]})
