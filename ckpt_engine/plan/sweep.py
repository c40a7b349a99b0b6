"""Vary one setting, predict each value, write the curve as JSON and a matplotlib PNG."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from ckpt_engine.plan.cost import PIPELINED, predict
from ckpt_engine.plan.params import Calibration
from ckpt_engine.plan.scenario import SWEEPABLE, Scenario

__all__ = ["parse_sweep", "run_sweep", "write_plot"]

logger = logging.getLogger(__name__)


def parse_sweep(text: str) -> tuple[str, list[Any]]:
    """``bucket_mb=64,256,1024`` -> ("bucket_mb", [64.0, 256.0, 1024.0])."""
    key, sep, values = text.partition("=")
    key = key.strip().replace("-", "_")
    if not sep or key not in SWEEPABLE or not values.strip():
        raise ValueError(f"--sweep {text!r}: write SETTING=V1,V2,... with SETTING one of {', '.join(SWEEPABLE)}")
    try:
        parsed = [SWEEPABLE[key](v) for v in values.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--sweep {text!r}: values of {key} must be {SWEEPABLE[key].__name__}s") from None
    return key, parsed


def run_sweep(scenario: Scenario, key: str, values: list[Any], cal: Calibration) -> dict[str, Any]:
    """Predictions for every value; the scenario and the winner included."""
    points = []
    for v in values:
        p = predict(replace(scenario, **{key: v}).setup(), cal)
        points.append({key: v, **p.to_json()})
    best = min(points, key=lambda pt: pt["total_s"])
    return {"scenario": asdict(scenario), "sweep": key, "points": points, "best": {key: best[key], "total_s": best["total_s"]}}


def write_plot(result: dict[str, Any], path: Path) -> None:
    """Total and per-stage seconds against the swept setting."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError("--sweep needs matplotlib for its plot: pip install matplotlib") from exc
    key, points = result["sweep"], result["points"]
    xs = [pt[key] for pt in points]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(xs, [pt["total_s"] for pt in points], "o-", color="black", linewidth=2, label="total")
    for stage in (*PIPELINED, "overhead"):
        ys = [pt["stages_s"][stage] for pt in points]
        if max(ys) > 0:
            ax.plot(xs, ys, ".--", label=stage)
    if key in ("bucket_mb", "senders", "nic_gbps", "nvlink_gbs") and min(xs) > 0:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(key)
    ax.set_ylabel("seconds per sync")
    sc = result["scenario"]
    ax.set_title(f"{sc['model']}: {sc['trainer']} -> {sc['rollout']}, {sc['strategy']}" + (f", delta {sc['delta']}" if sc["delta"] is not None else ""), fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    logger.info("wrote %s", path)


def write_sweep(result: dict[str, Any], out_dir: Path, stem: str) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out_dir / f"{stem}.json", out_dir / f"{stem}.png"
    json_path.write_text(json.dumps(result, indent=1) + "\n")
    write_plot(result, png_path)
    return json_path, png_path
