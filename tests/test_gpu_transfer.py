"""NCCL and colocated (CUDA IPC) round trips on real GPUs; run on the GPU machine with -m gpu."""

from __future__ import annotations

import concurrent.futures as cf
import uuid

import pytest
import torch

from ckpt_engine.engine import Rendezvous

from ranks import run_ranks
from roundtrip import roundtrip_rank
from ckpt_engine.store import serve_store

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("verify", [False, True])
def test_nccl_roundtrip_bit_exact(verify: bool) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs: one NCCL communicator cannot hold two ranks of one GPU")
    results = run_ranks(roundtrip_rank, 2, backend="nccl", device="cuda", verify=verify, num_small=2000)
    assert results[1]["bad"] == []


@pytest.mark.parametrize(
    ("engine_kwargs", "stable"),
    [({"solo_bytes": 1024}, True), ({"group_max_tensors": 10_000}, False), ({"group_max_tensors": 10_000}, True)],
    ids=["solo-stable", "grouped", "grouped-stable"],
)
def test_nccl_tensors_land_in_their_destinations(engine_kwargs: dict, stable: bool) -> None:
    """Lone tensors, and every bucket of up to 10,000 tensors as one coalesced NCCL group, received
    straight into the loader's destinations, bit for bit."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    results = run_ranks(
        roundtrip_rank, 2, backend="nccl", device="cuda", num_small=300, destinations=True, stable=stable,
        engine_kwargs=engine_kwargs,
    )
    assert results[1]["bad"] == []
    if "group_max_tensors" in engine_kwargs:
        assert results[1]["grouped"] > 0 and results[1]["landed_grouped"] > 0


def test_colocated_cuda_ipc_bit_exact() -> None:
    results = run_ranks(roundtrip_rank, 2, backend="colocated", device="cuda:0", timeout_s=30)
    assert results[1]["bad"] == []


def test_colocated_sender_and_receiver_in_one_process() -> None:
    """Both ends in one process (vLLM's engine core inside the trainer's process,
    VLLM_ENABLE_V1_MULTIPROCESSING=0): CUDA IPC cannot open a handle where it was made ("invalid
    device context" at join, seen on one H200 with vLLM 0.26), so the receiver takes the sender's
    buffers and tensors themselves; bit-exact over two syncs, with and without the sender's own
    tensors read in place."""
    for stable in (True, False):  # the sender's tensors offered, or packed into the shared buffers
        master = serve_store("127.0.0.1", 30)
        rdzv = Rendezvous("127.0.0.1", master.port, uuid.uuid4().hex, 2, "colocated", 30.0, 1)
        with cf.ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(roundtrip_rank, r, rdzv, device="cuda:0", stable=stable) for r in (0, 1)]
            results = [f.result(timeout=120) for f in futures]
        assert results[1]["bad"] == []


def test_nccl_delta_chain_and_corrupt_patch() -> None:
    """Delta syncs over NCCL: a seed, then patches of real AdamW steps, bit-exact; then a chain
    whose third sync carries a corrupted patch, caught by the checksum before any load."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    from multisender import shard_rank

    results = run_ranks(shard_rank, 2, backend="nccl", versions=5, lr=1e-5, delta="on")
    assert results[1]["bad"] == [] and results[1]["errors"] == []
    assert all(s["patch_buckets"] > 0 for s in results[1]["stats"][1:])
    results = run_ranks(shard_rank, 2, backend="nccl", versions=3, lr=1e-5, delta="on", corrupt=2)
    assert len(results[1]["errors"]) == 1 and "checksum mismatch" in results[1]["errors"][0] or "malformed" in results[1]["errors"][0]
    assert results[1]["bad"] == []


@pytest.mark.parametrize("in_place", [False, True])
def test_nccl_delta_one_pass_diff_and_in_place_receivers(in_place: bool) -> None:
    """At lr 1e-6 the senders' calm buckets go through the one-pass Triton diff (no pack) and,
    with `in_place`, receivers check and patch their own tensors through the scattered-image
    kernel: bit-exact over NCCL after every sync; then a corrupted patch leaves them on the old
    version."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    from multisender import shard_rank

    results = run_ranks(shard_rank, 2, backend="nccl", versions=5, lr=1e-6, delta="on", in_place=in_place)
    assert results[1]["bad"] == [] and results[1]["errors"] == []
    assert all(s["direct_buckets"] > 0 for s in results[0]["stats"][2:])
    assert all(s.get("in_place", 0.0) == float(in_place) for s in results[1]["stats"])
    results = run_ranks(shard_rank, 2, backend="nccl", versions=4, lr=1e-6, delta="on", corrupt=3, in_place=in_place)
    assert len(results[1]["errors"]) == 1 and "v3:" in results[1]["errors"][0]
    assert results[1]["bad"] == [] and results[1].get("kept", []) == []
