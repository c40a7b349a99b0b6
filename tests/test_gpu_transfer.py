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


def test_colocated_cuda_ipc_bit_exact() -> None:
    results = run_ranks(roundtrip_rank, 2, backend="colocated", device="cuda:0", timeout_s=30)
    assert results[1]["bad"] == []
