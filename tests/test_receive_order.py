"""Receivers consume whichever sender's next bucket landed first (host work, several senders):
a slow sender no longer holds back the others, each sender's own buckets keep their order, and a
stalled sender still fails the sync with an error naming its bucket."""

from __future__ import annotations

import datetime
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ckpt_engine.pipeline.receive_order import ReadyFirst
from ckpt_engine.engine import Rendezvous
from ckpt_engine.manifest import BucketManifest
from ckpt_engine.registry import CheckpointEngineRegistry
from ckpt_engine.sources.base import spec_of
from ranks import run_ranks
from roundtrip import same_bits

BUCKET_BYTES = 4096
NUM_TENSORS = 12  # 4000 bytes each: one per bucket, six per sender, interleaved s0, s1, s0, ...
WAIT_S = 30.0
"""The slow sender's stall at most: within the engines' bound (run_ranks' 60 s), so a receiver that
waits for that sender first still ends with the order that shows it."""


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return {f"w{i}": torch.randn(1000, generator=g) for i in range(NUM_TENSORS)}


def _slow_source(
    manifest: BucketManifest, sender: int, sd: dict[str, torch.Tensor], slow_ordinal: int | None, stall: Callable[[], None]
) -> Iterator[tuple[str, torch.Tensor]]:
    """This sender's tensors in its bucket order; before the bucket at `slow_ordinal` the
    sender process really stalls (an export that stalls), while its earlier broadcasts run."""
    for ordinal, bucket in enumerate(manifest.sender_buckets(sender)):
        if ordinal == slow_ordinal:
            stall()
        for e in bucket.entries:
            yield e.name, sd[e.name]


def _order_rank(
    rank: int, rdzv: Rendezvous, *, slow: dict[int, int], sleep_s: float | None = None, engine_timeout_s: float | None = None
) -> dict[str, Any]:
    """Senders send their buckets (sender s stalls before its bucket `slow[s]`: `sleep_s`, or, where
    None, until every receiver took all of sender 1's buckets, at most `WAIT_S`); receivers record
    the manifest index of each bucket in the order it is yielded and check every tensor."""
    store = rdzv.connect_store()
    store.set(f"arrived/{rank}", b"1")  # every process is up before a short engine timeout applies
    store.wait([f"arrived/{r}" for r in range(rdzv.world_size)])
    engine = CheckpointEngineRegistry.new(
        "gloo", bucket_size_bytes=BUCKET_BYTES, timeout_s=engine_timeout_s if engine_timeout_s is not None else rdzv.timeout_s
    )
    engine.init_process_group(rdzv, rank)
    sd = _state()
    manifest = engine.plan([spec_of(n, t) for n, t in sd.items()], num_senders=rdzv.num_senders)
    index_of = {e.name: b.index for b in manifest.buckets for e in b.entries}
    out: dict[str, Any] = {"order": [], "bad": [], "error": None, "senders": [b.sender for b in manifest.buckets]}
    receivers = range(rdzv.num_senders, rdzv.world_size)
    last_of_1 = max(b.index for b in manifest.buckets if b.sender == 1)

    def stall() -> None:
        if sleep_s is not None:
            time.sleep(sleep_s)
            return
        try:  # bounded: receivers that wait for this sender's next bucket first never set these
            store.wait([f"took-1/{r}" for r in receivers], datetime.timedelta(seconds=WAIT_S))
        except Exception:  # the order the receivers recorded tells
            pass

    try:
        if rank < rdzv.num_senders:
            engine.send_weights(manifest, _slow_source(manifest, rank, sd, slow.get(rank), stall))
        else:
            got: dict[str, torch.Tensor] = {}
            for bucket in engine.receive_buckets(manifest):
                out["order"].append(index_of[bucket[0][0]])
                got.update((n, t.clone()) for n, t in bucket)
                if out["order"][-1] == last_of_1:
                    store.set(f"took-1/{rank}", b"1")
            out["bad"] = [n for n in sd if n not in got or not same_bits(got[n], sd[n])]
    except Exception as exc:  # a sender may also fail once the receivers gave up on it
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        engine.finalize()
    return out


def test_a_slow_sender_does_not_hold_back_the_other() -> None:
    """Sender 0 stalls before its second bucket until every receiver took sender 1's last bucket
    (bounded: on any box, however slow). Receivers take all of sender 1's buckets (refills
    included: more than the two buffers it has per receiver) before that slow one, keep each
    sender's own order, and end bit-exact. Consumed in manifest order, sender 1's second bucket
    would wait behind sender 0's, and the stall would end only at its bound."""
    results = run_ranks(_order_rank, 4, num_senders=2, slow={0: 1})
    senders = results[0]["senders"]
    by_sender = [[i for i, s in enumerate(senders) if s == sender] for sender in range(2)]
    slow_bucket = by_sender[0][1]
    assert len(by_sender[1]) > 2
    for r in results[2:]:
        assert r["error"] is None and r["bad"] == []
        order = r["order"]
        assert sorted(order) == list(range(NUM_TENSORS))
        for own in by_sender:
            assert [k for k in order if k in own] == own  # each sender's buckets in its own order
        later = order[order.index(slow_bucket) + 1 :]
        assert not set(by_sender[1]) & set(later), f"sender 1's buckets waited behind sender 0's slow bucket: {order}"
    for r in results[:2]:
        assert r["error"] is None


def test_stalled_senders_fail_the_sync_naming_a_bucket() -> None:
    """Both senders stall past the 2 s engine timeout: every receiver's receive fails within its
    bound with a TransferError naming a bucket and its sender, instead of hanging."""
    results = run_ranks(_order_rank, 4, num_senders=2, slow={0: 2, 1: 1}, sleep_s=4.0, engine_timeout_s=2.0)
    for r in results[2:]:
        assert r["error"] is not None and re.fullmatch(
            r"TransferError: rank \d: bucket \d+ from sender [01] failed: .*", r["error"], re.S
        ), r["error"]


def test_ready_first_picks_landed_heads_in_each_senders_order() -> None:
    """The bookkeeping alone: the earliest landed head wins, a sender's later bucket never
    overtakes its earlier one, a lone sender's head comes back without a check, and nothing
    landing within the timeout gives None and removes nothing."""
    heads = ReadyFirst([[0, 2, 4], [1, 3], []])
    landed = {3, 1, 4}
    assert heads.next_ready(landed.__contains__, 1.0) == 1
    assert heads.next_ready(landed.__contains__, 1.0) == 3  # sender 0's head (0) has not landed
    assert heads.heads() == [0]
    assert heads.next_ready(lambda k: False, 10.0) == 0  # only sender 0 left: no choice to make
    two = ReadyFirst([[0], [1]])
    t0 = time.monotonic()
    assert two.next_ready(lambda k: False, 0.05) is None
    assert time.monotonic() - t0 >= 0.05
    assert two.heads() == [0, 1]
    assert two.next_ready(lambda k: True, 1.0) == 0  # several landed: manifest order
    assert two.next_ready(lambda k: True, 1.0) == 1
    assert not two
