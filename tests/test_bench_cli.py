"""`ckpt-engine bench` end to end on CPU: real processes, figures printed, correctness checked.
(Bad flags and an unknown preset: tests/test_bad_input.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_bench_tiny_gloo_table_and_json(tmp_path: Path) -> None:
    """One run prints the table and writes the JSON summary (`--json FILE` does both)."""
    path = tmp_path / "bench.json"
    out = subprocess.run(
        [sys.executable, "-m", "ckpt_engine.cli", "bench", "--preset", "tiny", "--backend", "gloo", "--iters", "1",
         "--bucket-mb", "4", "--receivers", "2", "--json", str(path)],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ckpt-engine sync" in out.stdout and "vs raw" in out.stdout and "equal the sender's" in out.stdout
    summary = json.loads(path.read_text())
    assert summary["correct"] is True and summary["tensors"] == 51 and summary["receivers"] == 2
    assert set(summary["modes"]) == {"raw", "naive", "ours"}
    assert summary["modes"]["raw"]["ratio_to_raw"] == 1.0 and summary["modes"]["ours"]["gbps"] > 0
    assert summary["buckets"] > 1
