"""`ckpt-engine bench --receiver-tp 2` end to end on CPU: real processes, region delivery against
whole-tensor receive in one run, bytes per receiver rank reported, every slice checked.

Three bench runs: one sender with slot memory for one receiver set at a time; two senders with the
sets side by side (unset slot memory) over paced links, whose JSON is checked in full there; and
the in-memory handoff."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
import torch


def _bench(*extra: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "ckpt_engine.cli", "bench", "--preset", "tiny", "--iters", "1", "--bucket-mb", "4", "--receivers", "2",
         "--receiver-tp", "2", "--json", "-", *extra],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads(out.stdout)
    assert summary["correct"] is True and summary["receiver_tp"] == 2
    model = summary["model_bytes"]
    assert all(b <= 0.55 * model for b in summary["modes"]["regions"]["received_bytes"])
    return summary


def _check_sets(summary: dict[str, Any], senders: int, parallel_sets: int) -> None:
    assert summary["senders"] == senders and summary["sets"] == 3 and summary["parallel_sets"] == parallel_sets
    model = summary["model_bytes"]
    assert summary["modes"]["full"]["received_bytes"] == [model, model]
    assert summary["speedup"] > 0


def test_region_bench_one_sender_one_set_at_a_time() -> None:
    # 8 MiB: one set's 2 x 4 MiB slots.
    summary = _bench("--backend", "gloo", "--senders", "1", "--region-slot-memory-mb", "8")
    _check_sets(summary, senders=1, parallel_sets=1)


def test_region_bench_two_senders_paced_links_sets_side_by_side() -> None:
    # Unset slot memory: 8 sets, at most the sets (3). Emulated links (tiny has no experts: nothing
    # to stack with --fused-experts, which must still run).
    summary = _bench("--backend", "gloo", "--senders", "2", "--link-mb-s", "400", "--fused-experts")
    _check_sets(summary, senders=2, parallel_sets=3)
    assert summary["link_mb_s"] == 400 and summary["modes"]["full"]["best_s"] >= summary["model_bytes"] / 400e6  # the link bounds it


def test_region_bench_handoff_one_receiver_per_set() -> None:
    # One receiver per set, senders hand over in memory.
    summary = _bench("--backend", "nccl_handoff", "--device", "cpu", "--senders", "2")
    assert summary["one_receiver_per_set"] is True and summary["backend"] == "nccl_handoff"


def test_region_bench_fp8_wire_packs_fresh_temporaries() -> None:
    # The FP8 wire (TP=1: tiny's k_proj has fewer rows than a block): the sender quantizes inside
    # every timed send and hands the walk over as fresh (each bucket packed in one batched copy);
    # the receiver's tensors equal the reference quantize of the same seeded weights.
    out = subprocess.run(
        [sys.executable, "-m", "ckpt_engine.cli", "bench", "--preset", "tiny", "--iters", "1", "--bucket-mb", "1", "--receivers", "1",
         "--receiver-tp", "1", "--backend", "gloo", "--senders", "1", "--wire-dtype", "fp8", "--json", "-"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads(out.stdout)
    assert summary["correct"] is True and summary["wire_dtype"] == "fp8", summary["problems"]
    assert summary["modes"]["full"]["received_bytes"] == [summary["model_bytes"]]
    assert all(m["first_s"] > 0 for m in summary["modes"].values())  # the round after the join, reported beside the timed ones
    # where the time goes: the sender's own walk (quantize included) and pack inside its whole send,
    # the receiver's slice copies, and the walk's quantize paths (on a CPU every weight alone, eager)
    sender, full = summary["sender_full"], summary["modes"]["full"]
    assert 0 < sender["export_s"] <= sender["total_s"] and 0 <= sender["pack_s"] <= sender["total_s"]
    assert len(full["rank_median_s"]) == 2 and len(full["keep_s"]) == 1 and full["keep_s"][0] > 0
    assert summary["fp8_walk"] == {"launches": 0, "grouped": 0, "alone": 28, "filled": 0, "lent": 0}  # tiny: 4 layers x 7 projections, none filled (no grouped launch on a CPU)
    assert summary["sender_full_first"]["total_s"] > 0 and summary["allocs"] is None  # pool counts: CUDA only


@pytest.mark.gpu
def test_region_bench_fills_weights_on_the_device_the_same_on_every_gpu() -> None:
    # Every rank draws the bench weights itself and the receivers compare against their own draw:
    # on CUDA the seeded draw must give the same bytes on each GPU, and again on a second call.
    from ckpt_engine.benchmark.regions import _fill
    from ckpt_engine.manifest import TensorSpec

    spec = TensorSpec("model.layers.0.mlp.up_proj.weight", "bfloat16", (1000, 384))
    first = _fill(spec, 3, torch.device("cuda", 0))
    assert first.is_cuda and first.dtype == torch.bfloat16 and first.shape == (1000, 384) and first.float().std() > 0.5
    for index in range(torch.cuda.device_count()):
        again = _fill(spec, 3, torch.device("cuda", index)).cpu()
        assert torch.equal(again.view(torch.int16), first.cpu().view(torch.int16))
    assert not torch.equal(_fill(spec, 4, torch.device("cuda", 0)).cpu(), first.cpu())


@pytest.mark.gpu
def test_region_bench_counts_what_the_memory_pools_get_from_cuda() -> None:
    # The bench's `allocs` (why a first sync is slower than the next): a new device segment and a
    # new pinned host block each show up in the counts this torch reports.
    from ckpt_engine.benchmark.regions import _pool_counts

    device = torch.device("cuda", 0)
    before = _pool_counts(device)
    assert before["device_allocs"] >= 0 and before["host_allocs"] >= 0 and before["host_alloc_ms"] >= 0
    kept = [torch.empty(3 << 30, dtype=torch.uint8, device=device), torch.empty(7 << 20, dtype=torch.uint8).pin_memory()]
    after = _pool_counts(device)
    assert after["device_allocs"] > before["device_allocs"] and after["host_allocs"] > before["host_allocs"], (before, after)
    del kept
