"""`ckpt-engine bench --receiver-tp 2` end to end on CPU: real processes, region delivery against
whole-tensor receive in one run, bytes per receiver rank reported, every slice checked."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.parametrize("senders", [1, 2])
def test_region_bench_tiny_json(senders: int) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "ckpt_engine.cli", "bench", "--preset", "tiny", "--backend", "gloo", "--iters", "1",
         "--bucket-mb", "4", "--receivers", "2", "--receiver-tp", "2", "--senders", str(senders), "--json", "-",
         *(["--region-slot-memory-mb", "8"] if senders == 1 else [])],  # 8 MiB: one set's 2 x 4 MiB slots
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads(out.stdout)
    assert summary["correct"] is True and summary["senders"] == senders and summary["receiver_tp"] == 2
    assert summary["sets"] == 3 and summary["parallel_sets"] == (1 if senders == 1 else 3)  # unset: 8, at most the sets; 8 MiB: one set
    model = summary["model_bytes"]
    assert summary["modes"]["full"]["received_bytes"] == [model, model]
    assert all(b <= 0.55 * model for b in summary["modes"]["regions"]["received_bytes"])
    assert summary["speedup"] > 0


@pytest.mark.parametrize(
    "extra",
    [
        ["--backend", "gloo", "--link-mb-s", "400", "--fused-experts"],  # emulated links (tiny has no experts: nothing to stack)
        ["--backend", "nccl_handoff", "--device", "cpu"],  # one receiver per set, senders hand over in memory
    ],
)
def test_region_bench_paced_links_and_handoff(extra: list[str]) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "ckpt_engine.cli", "bench", "--preset", "tiny", "--iters", "1", "--bucket-mb", "4", "--receivers", "2",
         "--receiver-tp", "2", "--senders", "2", "--json", "-", *extra],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads(out.stdout)
    assert summary["correct"] is True
    model = summary["model_bytes"]
    assert all(b <= 0.55 * model for b in summary["modes"]["regions"]["received_bytes"])
    if "--link-mb-s" in extra:
        assert summary["link_mb_s"] == 400 and summary["modes"]["full"]["best_s"] >= model / 400e6  # the link bounds it
    else:
        assert summary["one_receiver_per_set"] is True and summary["backend"] == "nccl_handoff"
