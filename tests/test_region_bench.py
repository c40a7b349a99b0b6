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
         "--bucket-mb", "4", "--receivers", "2", "--receiver-tp", "2", "--senders", str(senders), "--json", "-"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads(out.stdout)
    assert summary["correct"] is True and summary["senders"] == senders and summary["receiver_tp"] == 2
    model = summary["model_bytes"]
    assert summary["modes"]["full"]["received_bytes"] == [model, model]
    assert all(b <= 0.55 * model for b in summary["modes"]["regions"]["received_bytes"])
    assert summary["speedup"] > 0
