"""Fit the planner's constants to our own bench files (``ckpt-engine plan --calibrate DIR``).

Four small least-squares fits, each on the rows that isolate its constants:
1. link: raw and bucketed broadcasts, ``t = messages x latency + bytes / (NVLink x efficiency)``;
2. export: FSDP2 gathers, ``t = gather bytes / (NVLink x eff) + calls x latency + tensors x cost``;
3. reference loader: host seconds per tensor from the FSDP2 sync benches;
4. pipeline overheads: what a ckpt-engine sync costs beyond the pipeline model's slowest stage,
   ``per bucket x buckets + per packed tensor x tensors + interference x copy seconds``.
Everything else keeps its documented default (see ``params.ASSUMED``).
"""

from __future__ import annotations

import logging
from dataclasses import replace

from ckpt_engine.plan.bench_rows import MeasuredRow, find_bench_files, load_rows, loader_samples
from ckpt_engine.plan.cluster import GPUS
from ckpt_engine.plan.cost import predict
from ckpt_engine.plan.params import Calibration

__all__ = ["calibrate", "link_efficiency", "nnls"]

logger = logging.getLogger(__name__)


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting; singular columns get 0."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-30:
            continue
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col and m[r][col]:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * y for x, y in zip(m[r], m[col])]
    return [m[i][n] / m[i][i] if abs(m[i][i]) > 1e-30 else 0.0 for i in range(n)]


def nnls(features: list[list[float]], targets: list[float]) -> list[float]:
    """Least squares with non-negative coefficients (drop a negative one and refit), relative
    errors weighted equally (each row scaled by 1 / target)."""
    if not features:
        raise ValueError("nothing to fit: no rows of this kind in the given bench files")
    k = len(features[0])
    active = list(range(k))
    while True:
        rows = [[f[j] / t for j in active] for f, t in zip(features, targets)]
        ys = [1.0] * len(rows)
        ata = [[sum(r[i] * r[j] for r in rows) for j in range(len(active))] for i in range(len(active))]
        aty = [sum(r[i] * y for r, y in zip(rows, ys)) for i in range(len(active))]
        coef = _solve(ata, aty) if active else []
        if all(c >= 0 for c in coef):
            out = [0.0] * k
            for j, c in zip(active, coef):
                out[j] = c
            return out
        active = [j for j, c in zip(active, coef) if c >= 0]


def link_efficiency(cal: Calibration, gpu: str, message_bytes: float) -> float:
    """Fraction of NVLink peak one message of ``message_bytes`` gets (the latency term included)."""
    rate = GPUS[gpu].nvlink_gbs * 1e9
    return (message_bytes / rate) / (message_bytes / (rate * cal.nvlink_eff) + cal.msg_latency_s)


def _fit_link(rows: list[MeasuredRow], cal: Calibration) -> Calibration:
    pts = [(r, r.link) for r in rows if r.kind in ("raw", "bucketed", "naive") and r.link is not None]
    if not pts:
        return cal
    # one efficiency for every GPU type: bytes are scaled by each row's own NVLink peak
    latency, inv = nnls([[float(n), b / (GPUS[r.gpu].nvlink_gbs * 1e9)] for r, (b, n) in pts], [r.measured_s for r, _ in pts])
    return replace(cal, msg_latency_s=latency, nvlink_eff=min(1.0, 1 / inv))


def _fit_export(rows: list[MeasuredRow], cal: Calibration) -> Calibration:
    pts = [r for r in rows if r.kind == "export"]
    if not pts:
        return cal
    # export rows predict linearly in (1/eff, unit latency, tensor cost): read the features back.
    probe = [Calibration(export_eff=1.0, export_unit_s=0, export_tensor_s=0), Calibration(export_eff=1.0, export_unit_s=1, export_tensor_s=0),
             Calibration(export_eff=1.0, export_unit_s=0, export_tensor_s=1)]
    feats = []
    for r in pts:
        x0 = r.predict_s(probe[0])
        feats.append([x0, r.predict_s(probe[1]) - x0, r.predict_s(probe[2]) - x0])
    inv, unit, tensor = nnls(feats, [r.measured_s for r in pts])
    return replace(cal, export_eff=min(1.0, 1 / inv) if inv > 0 else cal.export_eff, export_unit_s=unit, export_tensor_s=tensor)


def _fit_overheads(rows: list[MeasuredRow], cal: Calibration) -> Calibration:
    pts = [(r, r.setup) for r in rows if r.kind == "sync" and r.setup is not None and not r.note]
    if not pts:
        return cal
    bare = replace(cal, bucket_overhead_s=0.0, packed_tensor_s=0.0, copy_interference=0.0)
    feats, targets = [], []
    for r, setup in pts:
        p0 = predict(setup, bare)
        copy_s = predict(setup, replace(bare, copy_interference=1.0)).stages["overhead"]
        packed = p0.detail["packed"] * setup.model.num_tensors
        feats.append([float(p0.num_buckets), packed, copy_s])
        targets.append(max(r.measured_s - p0.total_s, 1e-9))
    # weight by the measured sync time, not the residual: fit the residual in absolute seconds
    scale = [r.measured_s for r, _ in pts]
    coef = nnls([[f / s for f in fe] for fe, s in zip(feats, scale)], [t / s for t, s in zip(targets, scale)])
    return replace(cal, bucket_overhead_s=coef[0], packed_tensor_s=coef[1], copy_interference=min(coef[2], 1.0))


def calibrate(paths: list[str], base: Calibration | None = None) -> Calibration:
    """Fit every constant our bench files can measure; keep the others from ``base``."""
    cal = base if base is not None else Calibration()
    rows = load_rows(paths)
    if not rows:
        raise ValueError(f"no GPU bench rows under {', '.join(paths)} (ckpt-engine bench / fsdp2 bench JSON files)")
    cal = _fit_link(rows, cal)
    cal = _fit_export(rows, cal)
    samples = loader_samples(paths)
    if samples:
        cal = replace(cal, load_tensor_s=sum(s for s, _ in samples) / sum(t for _, t in samples))
    cal = _fit_overheads(rows, cal)
    residuals = {f"{r.source}:{r.label}": round(r.predict_s(cal) / r.measured_s - 1, 4) for r in rows}
    sources = sorted({p.as_posix() for p in find_bench_files(paths)})
    logger.info("calibrated on %s rows from %s files", len(rows), len(sources))
    return replace(cal, sources=sources, residuals=residuals)
