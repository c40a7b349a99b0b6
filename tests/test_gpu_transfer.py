"""NCCL and colocated (CUDA IPC) round trips on real GPUs; run on the GPU machine with -m gpu."""

from __future__ import annotations

import pytest
import torch

from ranks import run_ranks
from roundtrip import roundtrip_rank

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("verify", [False, True])
def test_nccl_roundtrip_bit_exact(verify: bool) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs: one NCCL communicator cannot hold two ranks of one GPU")
    results = run_ranks(roundtrip_rank, 2, backend="nccl", device="cuda", verify=verify, num_small=2000)
    assert results[1]["bad"] == []


def test_nccl_lone_tensors_land_in_their_destinations() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    results = run_ranks(
        roundtrip_rank, 2, backend="nccl", device="cuda", num_small=50, destinations=True, stable=True,
        engine_kwargs={"solo_bytes": 1024},
    )
    assert results[1]["bad"] == []


@pytest.mark.parametrize("stable", [False, True])
def test_nccl_grouped_buckets_bit_exact(stable: bool) -> None:
    """Every bucket of up to 10,000 tensors as one coalesced NCCL group, into destinations."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    results = run_ranks(
        roundtrip_rank, 2, backend="nccl", device="cuda", num_small=300, destinations=True, stable=stable,
        engine_kwargs={"group_max_tensors": 10_000},
    )
    assert results[1]["bad"] == []
    assert results[1]["grouped"] > 0 and results[1]["landed_grouped"] > 0


def test_colocated_cuda_ipc_bit_exact() -> None:
    results = run_ranks(roundtrip_rank, 2, backend="colocated", device="cuda:0", timeout_s=30)
    assert results[1]["bad"] == []
