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
