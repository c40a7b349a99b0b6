"""`ckpt-engine plan`: the table, --json, --sweep (PNG + JSON), --validate, and bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ckpt_engine.plan.cli import main

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ["--model", "kimi-k2", "--trainer", "256xH800", "--rollout", "16x8xH800", "--nic-gbps", "50", "--strategy", "all-senders", "--delta", "0.02"]


def test_example_prints_stages_bottleneck_and_total(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(EXAMPLE) == 0
    out = capsys.readouterr().out
    for stage in ("export", "encode", "transfer", "load", "finalize", "pause"):
        assert f"\n{stage}" in out
    total = next(line for line in out.splitlines() if line.startswith("total"))
    assert "bottleneck:" in total and float(total.split()[1]) > 0
    assert "256 senders" in out and "delta 0.02" in out


def test_json_output_is_machine_readable(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*EXAMPLE, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["num_senders"] == 256
    assert data["total_s"] >= data["receiver_ingress_s"] > 0
    assert set(data["stages_s"]) == {"export", "encode", "transfer", "load", "overhead", "finalize", "pause"}


def test_sweep_writes_png_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    args = ["--model", "qwen3-30b-a3b", "--trainer", "16xH100", "--rollout", "4x4xH100", "--nic-gbps", "400", "--sweep", "bucket_mb=64,256,1024", "--out-dir", str(tmp_path)]
    assert main(args) == 0
    data = json.loads((tmp_path / "sweep_qwen3-30b-a3b_bucket_mb.json").read_text())
    assert [pt["bucket_mb"] for pt in data["points"]] == [64.0, 256.0, 1024.0]
    assert data["best"]["total_s"] == min(pt["total_s"] for pt in data["points"])
    assert (tmp_path / "sweep_qwen3-30b-a3b_bucket_mb.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_validate_writes_the_table_and_every_measured_row_is_within_15_percent(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "validation.md"
    assert main(["--validate", str(ROOT / "bench" / "results"), "--out", str(out)]) == 0
    text = out.read_text()
    measured, published = text.split("### Predicted vs published")
    assert "**no**" not in measured
    assert measured.count("\n| ") > 40  # header + every GPU row of bench/results
    assert "Kimi-K2" in published and "Qwen3-235B-A22B" in published


@pytest.mark.parametrize(
    ("args", "flag", "allowed"),
    [
        (["--strategy", "bogus"], "--strategy", "all-senders"),
        (["--loader", "x"], "--loader", "vllm"),
        (["--trainer", "8xQ100"], "--trainer", "H800"),
        (["--rollout", "eight"], "--rollout", "ENGINESxGPUS_PER_ENGINExTYPE"),
        (["--delta", "2"], "--delta", "[0, 1]"),
        (["--sweep", "colour=red"], "--sweep", "bucket_mb"),
        (["--bucket-mb", "-1"], "--bucket-mb", "> 0"),
    ],
)
def test_bad_input_is_one_line_naming_the_flag(args: list[str], flag: str, allowed: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        raise SystemExit(main(args))
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and flag in err and allowed in err


def test_command_line_has_no_traceback_on_bad_input() -> None:
    proc = subprocess.run([sys.executable, "-m", "ckpt_engine.cli", "plan", "--strategy", "both"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "--strategy" in proc.stderr and "single" in proc.stderr
