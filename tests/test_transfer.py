"""The pipelined broadcast over real gloo process groups: bit-exact round trips in every shape."""

from __future__ import annotations

import pytest

from ranks import run_ranks
from roundtrip import roundtrip_rank

from ckpt_engine.engine import Rendezvous, TransferError
from ckpt_engine.registry import CheckpointEngineRegistry


@pytest.mark.parametrize("verify", [False, True])
def test_gloo_mixed_dtypes_two_receivers_two_syncs(verify: bool) -> None:
    """fp32/bf16/fp16/fp8/int/bool, empty, 0-d, non-contiguous, larger than a bucket, 2000 small
    tensors; two syncs in a row with different values over the same group and buffers."""
    results = run_ranks(roundtrip_rank, 3, backend="gloo", verify=verify, num_small=2000)
    assert [r["bad"] for r in results[1:]] == [[], []]
    assert results[1]["tensors"] == results[0]["tensors"] > 2000


def test_chunked_tensors_reassemble_in_the_loaders_destination() -> None:
    results = run_ranks(roundtrip_rank, 2, backend="gloo", num_small=10, destinations=True)
    assert results[1]["bad"] == []


def test_lone_tensors_travel_from_the_source_into_the_destination() -> None:
    """solo_bytes gives larger tensors a bucket each: a stable sender broadcasts them from their own
    memory and the receiver takes them straight into its destinations; the rest still packs."""
    results = run_ranks(
        roundtrip_rank, 2, backend="gloo", num_small=50, destinations=True, stable=True, engine_kwargs={"solo_bytes": 1024}
    )
    assert results[1]["bad"] == []
    assert {"fp32", "bf16", "big", "int64"} <= set(results[1]["alone"])


@pytest.mark.parametrize("stable", [False, True])
def test_grouped_buckets_travel_per_tensor_into_destinations(stable: bool) -> None:
    """group_max_tensors sends buckets of a few tensors as one message per tensor (coalesced on NCCL,
    in order on gloo): every rank must split the same buckets alike and the bytes must match."""
    results = run_ranks(
        roundtrip_rank, 3, backend="gloo", num_small=50, destinations=True, stable=stable,
        engine_kwargs={"group_max_tensors": 8},
    )
    assert [r["bad"] for r in results[1:]] == [[], []]
    assert results[1]["grouped"] > 0 and results[1]["landed_grouped"] > 0


def test_gloo_three_buffers() -> None:
    results = run_ranks(roundtrip_rank, 2, backend="gloo", num_small=50, engine_kwargs={"num_buffers": 3})
    assert results[1]["bad"] == []


def test_colocated_shared_memory_hand_off() -> None:
    results = run_ranks(roundtrip_rank, 2, backend="colocated", num_small=100)
    assert results[1]["bad"] == []


def test_a_colocated_receiver_that_starts_after_the_sync_timeout_still_joins() -> None:
    """The colocated join waits for its peer within the rendezvous's timeout, not the engines' (3 s
    here): the receiver starts 5 s after the sender, and both join and sync."""
    results = run_ranks(roundtrip_rank, 2, backend="colocated", num_small=10, syncs=1, engine_timeout_s=3, late=(1, 5.0), timeout_s=60)
    assert results[1]["bad"] == []


def _join_only(rank: int, rdzv: Rendezvous, *, num_buffers: dict[int, int]) -> str:
    """Join with this rank's own buffer count; the join's error (type and text) is the answer."""
    engine = CheckpointEngineRegistry.new(rdzv.backend, bucket_size_bytes=64 * 1024, num_buffers=num_buffers[rank], timeout_s=rdzv.timeout_s)
    try:
        engine.init_process_group(rdzv, rank)
    except (ValueError, TransferError) as exc:
        return f"{type(exc).__name__}: {exc}"
    engine.finalize()
    return "joined"


def test_a_colocated_receiver_that_cannot_map_the_buffers_tells_the_sender_at_join() -> None:
    """The receiver refuses the sender's 3 shared buffers (it expects 2): its join fails by name, and
    the sender's join fails at once with the receiver's reason (it waited out the join's bound)."""
    sender, receiver = run_ranks(_join_only, 2, backend="colocated", num_buffers={0: 3, 1: 2}, timeout_s=120)
    assert receiver.startswith("ValueError") and "expects 2" in receiver, receiver
    assert sender.startswith("TransferError") and "could not map its shared buffers" in sender and "expects 2" in sender, sender
