"""Calibration from our own bench files, and validation against them (held-out rows included)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckpt_engine.plan.bench_rows import load_rows
from ckpt_engine.plan.calibrate import calibrate, link_efficiency, nnls
from ckpt_engine.plan.cost import predict
from ckpt_engine.plan.params import load_calibration
from ckpt_engine.plan.published import fit_vllm_loader, load_published

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
DEFAULT_SOURCES = ["h200x2", "fsdp2_export_7b.json", "fsdp2_sync_7b_2gpu.json", "fsdp2_sync_30b_2gpu.json"]


def test_nnls_recovers_known_coefficients_and_never_goes_negative() -> None:
    truth = [2e-5, 3.0, 0.5]
    feats = [[float(n), b, c] for n, b, c in [(1, 0.1, 0.0), (16, 0.1, 0.2), (57, 0.4, 0.1), (8, 0.2, 0.3), (33, 0.05, 0.0)]]
    targets = [sum(t * f for t, f in zip(truth, row)) for row in feats]
    assert nnls(feats, targets) == pytest.approx(truth, rel=1e-6)
    # a feature that only hurts gets 0, not a negative coefficient
    assert min(nnls([[1.0, 1.0], [2.0, 1.0], [3.0, 1.0]], [1.0, 2.0, 3.0])) >= 0.0


def test_fit_on_the_h200_files_reproduces_them_within_15_percent() -> None:
    cal = calibrate([str(RESULTS / s) for s in DEFAULT_SOURCES])
    assert 0.75 < cal.nvlink_eff < 0.9  # 367-372 GB/s of H200's 450 GB/s per direction
    assert 0 < cal.msg_latency_s < 1e-4
    assert link_efficiency(cal, "H200", 2**20) < link_efficiency(cal, "H200", 2**30)
    assert all(abs(err) <= 0.15 for err in cal.residuals.values()), cal.residuals


def test_held_out_rows_are_predicted_within_15_percent() -> None:
    """Fit on today's files only; predict the earlier sessions' runs (other code, buckets, buffers)."""
    cal = calibrate([str(RESULTS / "h200x2")], base=load_calibration())
    held = [r for r in load_rows([str(RESULTS / "h200x2_earlier")]) if r.kind in ("raw", "bucketed", "sync")]
    assert len(held) > 20
    errors = {f"{r.source}:{r.label}": r.predict_s(cal) / r.measured_s - 1 for r in held}
    assert all(abs(e) <= 0.15 for e in errors.values()), errors


def test_checked_in_default_is_the_output_of_the_calibrate_command() -> None:
    fresh = fit_vllm_loader(calibrate([str(RESULTS / s) for s in DEFAULT_SOURCES]))
    default = load_calibration()
    for name in ("nvlink_eff", "msg_latency_s", "bucket_overhead_s", "export_eff", "load_tensor_s", "vllm_load_tensor_s"):
        assert getattr(default, name) == pytest.approx(getattr(fresh, name), rel=1e-6), name


def test_published_fit_entry_is_met_and_others_are_predictions() -> None:
    cal = load_calibration()
    figures = load_published()
    assert sum(f.fit for f in figures) == 1
    for f in figures:
        p = predict(f.scenario.setup(), cal)
        if f.fit:
            assert p.total_s == pytest.approx(f.published_s, rel=1e-3)
        assert p.total_s > 0 and p.bottleneck in p.stages


def test_missing_path_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="does not exist"):
        calibrate([str(RESULTS / "no-such-dir")])
    with pytest.raises(ValueError, match="no such file"):
        load_calibration(str(RESULTS / "no-such.json"))
