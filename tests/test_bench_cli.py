"""`ckpt-engine bench` end to end on CPU: real processes, figures printed, correctness checked."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_tiny_gloo_json() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "ckpt_engine.cli", "bench", "--preset", "tiny", "--backend", "gloo", "--iters", "1",
         "--bucket-mb", "4", "--receivers", "2", "--json", "-"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads(out.stdout)
    assert summary["correct"] is True and summary["tensors"] == 51 and summary["receivers"] == 2
    assert set(summary["modes"]) == {"raw", "naive", "ours"}
    assert summary["modes"]["raw"]["ratio_to_raw"] == 1.0 and summary["modes"]["ours"]["gbps"] > 0
    assert summary["buckets"] > 1


def test_bench_table_and_bad_preset() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "ckpt_engine.cli", "bench", "--preset", "tiny", "--backend", "gloo", "--iters", "1", "--modes", "raw,ours"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ckpt-engine sync" in out.stdout and "vs raw" in out.stdout and "equal the sender's" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "ckpt_engine.cli", "bench", "--preset", "gpt-17"], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "unknown preset 'gpt-17'" in bad.stderr
