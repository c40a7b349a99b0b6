"""Our own GPU measurements (``bench/results/**.json``) as rows the planner can predict.

Four kinds of file are read: ``ckpt-engine bench`` runs (raw, bucketed, naive and ckpt-engine
modes), ``ckpt-engine bench --receiver-tp N --link-mb-s R`` runs (full and shard receive over an
emulated link of R MB/s per rank), ``bench/fsdp2_export_bench.py`` and ``bench/fsdp2_sync_bench.py``. Each measured figure
becomes a :class:`MeasuredRow` that knows how to predict itself under a :class:`Calibration`,
so calibration (fit) and validation (compare) read the same rows the same way.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ckpt_engine.plan.cluster import GPUS, Links, RolloutLayout, TrainerLayout
from ckpt_engine.plan.cost import SyncSetup, broadcast_s, predict
from ckpt_engine.plan.model_shapes import model_bytes
from ckpt_engine.plan.params import Calibration

__all__ = ["MeasuredRow", "export_features", "find_bench_files", "load_rows", "loader_samples"]

logger = logging.getLogger(__name__)


@dataclass
class MeasuredRow:
    """One measured time and how to predict it. ``kind``: raw, bucketed, naive, sync, export."""

    label: str
    source: str
    kind: str
    measured_s: float
    predict_s: Callable[[Calibration], float]
    setup: SyncSetup | None = None
    link: tuple[float, int] | None = None  # (bytes, messages) for raw/bucketed/naive rows
    note: str = ""
    gpu: str = "H200"


def find_bench_files(paths: list[str]) -> list[Path]:
    """JSON files under the given files/directories, sorted for a stable table."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            out += sorted(p.rglob("*.json"))
        elif p.is_file():
            out.append(p)
        else:
            raise ValueError(f"--calibrate/--validate path {str(p)!r} does not exist")
    return out


def _gpu_name(text: str) -> str:
    for name in GPUS:
        if name in text.upper().split():
            return name
    raise ValueError(f"unknown GPU {text!r} in a bench file; known: {', '.join(GPUS)}")


def _pair(gpu: str, nvlink_scale: float = 1.0) -> tuple[TrainerLayout, RolloutLayout, Links]:
    """Two GPUs of one NVLink node: sender GPU0, receiver GPU1."""
    spec = GPUS[gpu]
    links = Links(spec.nvlink_gbs * nvlink_scale, spec.nic_gbps / 8, spec.pcie_gbs, same_node=True)
    return TrainerLayout(1, spec), RolloutLayout(1, 1, spec), links


def _link_rate(cal: Calibration, gpu: str) -> float:
    return GPUS[gpu].nvlink_gbs * 1e9 * cal.nvlink_eff


def _broadcast_pred(nbytes: float, msgs: int, gpu: str) -> Callable[[Calibration], float]:
    """A link row's prediction, its numbers bound now (rows are built in loops)."""
    return lambda cal: broadcast_s(nbytes, msgs, _link_rate(cal, gpu), cal)


def _bench_rows(path: Path, d: dict[str, Any]) -> list[MeasuredRow]:
    if d.get("device") != "cuda" or d.get("backend") != "nccl":
        return []  # CPU/gloo files: loopback sockets, not a link this model describes
    gpu, name = _gpu_name(d["gpu"]), path.as_posix()
    nbytes, buckets, tensors = float(d["bytes"]), int(d["buckets"]), int(d["tensors"])
    previous = path.parent.name.endswith("_earlier") or "engine_kwargs" not in d
    kwargs = d.get("engine_kwargs") or {}
    group_max = 0 if previous else int(kwargs.get("group_max_tensors", 64))
    tag = f"{d['preset']} {d['bucket_mb']:g} MiB {'in place' if d.get('in_place') else 'copy'}"
    extras = [f"{k}={v}" for k, v in (("buffers", d.get("buffers")), ("solo_mb", d.get("solo_mb"))) if v not in (None, 1, 2)]
    extras += [f"{k}={v}" for k, v in kwargs.items()]
    if previous:
        extras.append("previous code: every bucket packed")
    note = ", ".join(extras)
    rows: list[MeasuredRow] = []
    for mode, msgs in (("raw", 1), ("bucketed", buckets), ("naive", tensors)):
        if mode in d["modes"]:
            rows.append(MeasuredRow(
                f"{tag} {mode}", name, mode, d["modes"][mode]["best_s"],
                _broadcast_pred(nbytes, msgs, gpu),
                link=(nbytes, msgs), note=note if mode != "raw" else "", gpu=gpu,
            ))
    if "ours" in d["modes"]:
        trainer, rollout, links = _pair(gpu)
        model = replace(model_bytes(d["preset"]), total_bytes=int(nbytes), num_tensors=tensors)
        setup = SyncSetup(
            model, trainer, rollout, links, bucket_bytes=int(d["bucket_mb"] * 2**20), num_buffers=int(d.get("buffers") or 2),
            loader="inplace" if d.get("in_place") else "copy", export="none", group_max_tensors=group_max, num_buckets=buckets,
        )
        rows.append(MeasuredRow(f"{tag} ckpt-engine", name, "sync", d["modes"]["ours"]["best_s"], lambda cal: predict(setup, cal).total_s, setup=setup, note=note))
    return rows


def export_features(nbytes: float, shards: int, units: int, tensors: int, gpu: str) -> tuple[float, float, float]:
    """(gather bytes / NVLink peak, gather calls, tensors): export time is linear in these."""
    return nbytes * (1 - 1 / shards) / (GPUS[gpu].nvlink_gbs * 1e9), float(units), float(tensors)


def _export_row(label: str, source: str, measured: float, feats: tuple[float, float, float]) -> MeasuredRow:
    def pred(cal: Calibration) -> float:
        return feats[0] / cal.export_eff + feats[1] * cal.export_unit_s + feats[2] * cal.export_tensor_s

    return MeasuredRow(label, source, "export", measured, pred)


def _fsdp2_export_rows(path: Path, d: dict[str, Any]) -> list[MeasuredRow]:
    gpu, name = _gpu_name(d["device"]), path.as_posix()
    cfg = model_bytes("qwen2.5-7b")
    units, t, b, w = cfg.num_layers + 1, int(d["tensors"]), float(d["bytes"]), int(d["world_size"])
    return [
        _export_row("qwen2.5-7b FSDP2 export (gather per unit)", name, d["export_s"], export_features(b, w, units, t, gpu)),
        _export_row("qwen2.5-7b FSDP2 export (gather per parameter)", name, d["per_param_allgather_s"], export_features(b, w, t, t, gpu)),
        MeasuredRow("qwen2.5-7b raw broadcast (1 GiB messages)", name, "bucketed", d["raw_broadcast_s"],
                    _broadcast_pred(b, -(-int(b) // 2**30), gpu), link=(b, -(-int(b) // 2**30)), gpu=gpu),
    ]


def _fsdp2_sync_rows(path: Path, d: dict[str, Any]) -> list[MeasuredRow]:
    s, name = d["summary"], path.as_posix()
    gpu, preset = _gpu_name(s["gpu"]), s["preset"]
    base = model_bytes(preset)
    model = replace(base, total_bytes=int(s["bytes"]), num_tensors=int(s["tensors"]))
    units = base.num_layers + 1
    rows = [_export_row(f"{preset} FSDP2 export (2 ranks walk iter_weights)", name, s["export_s"],
                        export_features(s["bytes"], int(s["gpus"]), units, int(s["tensors"]), gpu))]
    # This run's link is shared with trainer rank 1 on GPU1; its own raw broadcast gives the rate.
    raw_msgs = -(-int(s["bytes"]) // 2**32)

    def pred(cal: Calibration) -> float:
        scale = s["bytes"] / (s["raw_s"] - raw_msgs * cal.msg_latency_s) / _link_rate(cal, gpu)
        trainer, rollout, links = _pair(gpu, nvlink_scale=scale)
        trainer = TrainerLayout(int(s["gpus"]), GPUS[gpu])
        setup = SyncSetup(model, trainer, rollout, links, bucket_bytes=int(s["bucket_mb"]) * 2**20, loader="ref",
                          export="gather", num_buckets=int(s["buckets"]))
        return predict(setup, cal).total_s

    rows.append(MeasuredRow(f"{preset} FSDP2 -> receiver full sync", name, "sync", s["sync_s"], pred,
                            note="link rate from this run's raw broadcast (GPU1 shared with trainer rank 1)"))
    return rows


def _region_rows(path: Path, d: dict[str, Any]) -> list[MeasuredRow]:
    """`ckpt-engine bench --receiver-tp N --link-mb-s R`: each rank on its own emulated link of R
    MB/s (exact pacing: link efficiency 1), one node per rank; full receive against shard receive.
    Loopback runs without --link-mb-s measure the host's cores, not a link: skipped."""
    rate = d.get("link_mb_s")
    if rate is None:
        return []
    gbs = float(rate) / 1e3
    spec = replace(GPUS["H100"], nic_gbps=gbs * 8)
    links = Links(gbs, gbs, gbs, gpus_per_node=1)
    senders, tp, receivers = int(d["senders"]), int(d["receiver_tp"]), int(d["receivers"])
    model = replace(model_bytes("qwen2.5-7b"), name=str(d["preset"]), total_bytes=int(d["model_bytes"]), num_tensors=int(d["tensors"]))
    rows = []
    for mode, receive in (("full", "full"), ("regions", "shard")):
        setup = SyncSetup(
            model, TrainerLayout(senders, spec), RolloutLayout(max(1, receivers // tp), tp, spec), links,
            strategy="all-senders" if senders > 1 else "single", bucket_bytes=int(float(d["bucket_mb"]) * 2**20),
            loader="copy", export="none", receive=receive,
        )

        def pred(cal: Calibration, setup: SyncSetup = setup) -> float:
            return predict(setup, replace(cal, nic_eff=1.0, nvlink_eff=1.0)).total_s

        label = f"{d['preset']} {senders} sender(s) -> TP={tp} x {receivers // tp}, {rate:g} MB/s links, {receive} receive"
        rows.append(MeasuredRow(label, path.as_posix(), "sync", float(d["modes"][mode]["median_s"]), pred, setup=setup,
                                note=f"emulated links (CPU box); median of {len(d['modes'][mode]['all_s'])}", gpu="CPU"))
    return rows


def load_rows(paths: list[str]) -> list[MeasuredRow]:
    """Every GPU measurement in the given bench files/directories."""
    rows: list[MeasuredRow] = []
    for path in find_bench_files(paths):
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not JSON ({exc})") from exc
        if "receiver_tp" in d and "modes" in d:
            rows += _region_rows(path, d)
        elif "modes" in d and ("buckets" not in d or d.get("receivers", 1) != 1 or d.get("senders", 1) != 1):
            # Delta / many-sender / many-receiver runs: not the one-pair topology these rows model.
            logger.info("skipping %s: a topology or mode the validation rows do not model yet", path)
        elif "modes" in d:
            rows += _bench_rows(path, d)
        elif "per_param_allgather_s" in d:
            rows += _fsdp2_export_rows(path, d)
        elif "summary" in d and "sync_s" in d.get("summary", {}):
            rows += _fsdp2_sync_rows(path, d)
        else:
            logger.info("skipping %s: not a bench file the planner reads", path)
    return rows


def loader_samples(paths: list[str]) -> list[tuple[float, int]]:
    """(receiver loader host seconds, tensors) pairs from FSDP2 sync benches: the ``ref`` loader."""
    out: list[tuple[float, int]] = []
    for path in find_bench_files(paths):
        d = json.loads(path.read_text())
        s = d.get("summary") if isinstance(d, dict) else None
        if isinstance(s, dict) and "load_host_s" in s:
            out += [(float(v), int(s["tensors"])) for v in s["load_host_s"].values()]
    return out
