"""The pipelined broadcast over real gloo process groups: bit-exact round trips in every shape."""

from __future__ import annotations

import pytest

from ranks import run_ranks
from roundtrip import roundtrip_rank


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


def test_gloo_three_buffers_and_two_lanes() -> None:
    results = run_ranks(roundtrip_rank, 2, backend="gloo", num_small=50, engine_kwargs={"num_buffers": 3, "num_lanes": 2})
    assert results[1]["bad"] == []


def test_colocated_shared_memory_hand_off() -> None:
    results = run_ranks(roundtrip_rank, 2, backend="colocated", num_small=100)
    assert results[1]["bad"] == []
