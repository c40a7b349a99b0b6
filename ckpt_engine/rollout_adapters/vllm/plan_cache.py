"""The receive plan's dry run (`vllm/regions.py`), kept on disk per model and parallel layout.

Recording where every checkpoint tensor lands costs every vLLM engine's first sync and a late
joiner's prepare one pass of vLLM's loaders over placeholders (2.6 s for a 24-layer Qwen3-30B-A3B on
2xH200). What the loaders do is decided by vLLM's build, this package's, the model class, the
checkpoint specs, the layout the loaders write into (names, dtypes, shapes of the parameters and
buffers on their meta stand-ins, and the loader functions attached to them), the quantization config and the worker's place in the parallel
layout: a hash of those names a file (msgpack, a checksum of its payload inside, written through a
temp file and `os.replace`). A file that is torn, corrupt or of another format is ignored (logged by
name) and the plan recorded in full and written again.

Before a kept recording is used, a sample is re-traced with the same loaders: the names of one layer
(drawn per process) and every name outside the layers (embeddings, final norm, head), compared
field by field with the file. That catches what the key missed in everything that touches the
sampled names: another vLLM build whose version string is unchanged, a MoE backend that lays
experts out otherwise, a rank or parallel mode not hashed. It cannot catch a difference confined to
layers not sampled (a loader that behaves otherwise only in some layers); each process draws its
layer anew, so such a file does not survive many starts unnoticed.

Directory: `CKPT_ENGINE_CACHE_DIR`, else `$XDG_CACHE_HOME/ckpt_engine`, else `~/.cache/ckpt_engine`;
`CKPT_ENGINE_PLAN_CACHE=0` turns the cache off (both read once per process).
"""

from __future__ import annotations

import functools
import gc
import hashlib
import logging
import os
import random
import re
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import torch

from ckpt_engine.manifest import TensorSpec
from ckpt_engine.planning.regions import ReceivePlan
from ckpt_engine.rollout_adapters.region_footprint import Box
from ckpt_engine.rollout_adapters.vllm.installed import Landing
from ckpt_engine.rollout_adapters.vllm.regions import DryRun, PlanRecording, dry_run, planned

__all__ = ["PlanSource", "cache_dir", "decode", "encode", "kept_receive_plan", "plan_key", "sample_names"]

logger = logging.getLogger(__name__)

FORMAT = 1
"""The file format; a file of another is ignored and written again."""
_LAYER = re.compile(r"\.layers\.(\d+)\.")


@dataclass(frozen=True)
class PlanSource:
    """How this worker's receive plan was had: `how` is "cached" (the file, its sample re-traced and
    equal), "recorded" (a full dry run: no file, or it was off), "discarded" (a file whose sample
    differed, then recorded), "corrupt" (an unreadable file, then recorded) or "off" (turned off,
    or no key could be made); `why` says what was wrong with a file, or why no key; `seconds` the whole of it (key, file, sample or full dry run)."""

    how: str
    path: str | None
    why: str | None
    seconds: float
    sampled_layer: int | None = None


@functools.cache
def cache_dir() -> Path | None:
    """Where recordings are kept, or None when `CKPT_ENGINE_PLAN_CACHE=0` (read once per process)."""
    if os.environ.get("CKPT_ENGINE_PLAN_CACHE", "1").strip().lower() in ("0", "off", "false", "no"):
        return None
    explicit = os.environ.get("CKPT_ENGINE_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "ckpt_engine"


def kept_receive_plan(
    model: torch.nn.Module, specs: Mapping[str, TensorSpec], vllm_config: Any,
) -> tuple[ReceivePlan, PlanRecording, PlanSource]:
    """`record_receive_plan`'s result, taken from the cache when a kept file's sample re-traces the
    same, else recorded in full (and kept). The sampled layer is drawn by this process's id."""
    t0 = time.perf_counter()
    with dry_run(model, vllm_config) as run:
        off = None
        try:
            where = cache_dir()
            path = where / f"plan-{plan_key(model, specs, vllm_config, run)}.msgpack" if where is not None else None
        except Exception as exc:  # a vLLM build without one of the groups hashed, no home: the plan is recorded, not kept
            off = f"its key could not be made: {type(exc).__name__}: {exc}"
            logger.warning("receive plan: not kept on disk (%s)", off)
            path = None
        if path is None:
            rec = run.record(specs)
            return planned(rec), rec, PlanSource("off", None, off, time.perf_counter() - t0)
        how, why, layer = "recorded", None, None
        kept = _read(path)
        if isinstance(kept, str):
            how, why = "corrupt", kept
            logger.warning("receive plan: ignoring the kept recording %s (%s); recording in full", path, why)
        elif kept is not None:
            names, layer = sample_names(list(specs), os.getpid())
            fresh = run.record({n: specs[n] for n in names})
            fresh.plan()  # its whole-tensor fallbacks as the kept one's
            why = _first_difference(kept, fresh, names)
            if why is None:
                seconds = time.perf_counter() - t0
                logger.info("receive plan: taken from %s (%d names re-traced, layer %s and those outside the layers: the same) in %.3f s",
                            path, len(names), layer, seconds)
                return planned(kept), kept, PlanSource("cached", str(path), None, seconds, layer)
            how = "discarded"
            logger.warning("receive plan: discarding the kept recording %s: its sample (layer %s) re-traced otherwise: %s; recording in full",
                           path, layer, why)
        rec = run.record(specs)
    plan = planned(rec)
    try:
        _write(path, encode(rec))
    except OSError as exc:  # a read-only or full disk: the plan stands, the next process records again
        logger.warning("receive plan: recorded in full, but could not keep it in %s (%s)", path, exc)
    else:
        logger.info("receive plan: recorded in full in %.3f s, kept in %s", time.perf_counter() - t0, path)
    seconds = time.perf_counter() - t0
    return plan, rec, PlanSource(how, str(path), why, seconds, layer)


def plan_key(model: torch.nn.Module, specs: Mapping[str, TensorSpec], vllm_config: Any, run: DryRun) -> str:
    """A hash of everything that decides what the loaders do (see the module's docstring)."""
    import vllm

    import ckpt_engine

    cls = type(model)
    material = [
        FORMAT, vllm.__version__, ckpt_engine.__version__, f"{cls.__module__}.{cls.__qualname__}",
        [[s.name, s.dtype, list(s.shape)] for s in specs.values()],
        [[name, str(t.dtype), list(t.shape)] for name, t in run.layout.values()], run.loaders,
        _quantization(vllm_config), _parallel_place(vllm_config),
    ]
    return hashlib.sha256(msgpack.packb(material, use_bin_type=True)).hexdigest()[:40]


def _quantization(vllm_config: Any) -> list[Any]:
    model_config = vllm_config.model_config
    hf = model_config.hf_config.to_dict() if model_config is not None else {}
    return [str(model_config.quantization) if model_config is not None else None, repr(hf.get("quantization_config"))]


def _parallel_place(vllm_config: Any) -> list[Any]:
    """The parallel layout's sizes (config) and this worker's size and rank in each of vLLM's groups."""
    from vllm.distributed import parallel_state as ps

    par = vllm_config.parallel_config
    place: list[Any] = [par.tensor_parallel_size, par.pipeline_parallel_size, par.data_parallel_size, bool(par.enable_expert_parallel)]
    for group in (ps.get_tp_group, ps.get_pp_group, ps.get_dp_group, ps.get_ep_group, ps.get_pcp_group, ps.get_dcp_group):
        try:
            g = group()
        except AssertionError:  # a group this vLLM build did not initialize here
            place.append(None)
            continue
        place.append([g.world_size, g.rank_in_group])
    return place


def sample_names(names: Sequence[str], seed: int) -> tuple[list[str], int | None]:
    """The names of one layer (drawn by `seed`) and every name outside the layers, in their order."""
    layers = sorted({int(m.group(1)) for n in names if (m := _LAYER.search(n))})
    layer = random.Random(seed).choice(layers) if layers else None
    picked = []
    for n in names:
        m = _LAYER.search(n)
        if m is None or int(m.group(1)) == layer:
            picked.append(n)
    return picked, layer


def _first_difference(kept: PlanRecording, fresh: PlanRecording, names: Sequence[str]) -> str | None:
    """The first field of a sampled name where the kept recording and the fresh one differ."""
    wanted = set(names)
    by_name: dict[str, list[Landing]] = {}
    for la in kept.landings:
        if la.name in wanted:
            by_name.setdefault(la.name, []).append(la)
    fresh_by_name: dict[str, list[Landing]] = {}
    for la in fresh.landings:
        fresh_by_name.setdefault(la.name, []).append(la)
    for n in names:
        for field, a, b in (
            ("boxes", kept.boxes.get(n), fresh.boxes.get(n)),
            ("whole", kept.whole.get(n), fresh.whole.get(n)),
            ("computed", kept.computed.get(n), fresh.computed.get(n)),
            ("unfollowed", kept.unfollowed.get(n), fresh.unfollowed.get(n)),
            ("touched", kept.touched.get(n), fresh.touched.get(n)),
            ("landings", by_name.get(n), fresh_by_name.get(n)),
        ):
            if a != b:
                return f"{n}: {field} {_short(a)} kept, {_short(b)} now"
    return None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 160 else text[:157] + "..."


# --- the file --------------------------------------------------------------------------------------
def encode(rec: PlanRecording) -> bytes:
    """A recording's file: {format, sha256 of the payload, payload} with the payload msgpack too."""
    payload = msgpack.packb({
        "boxes": {n: [[list(p) for p in b] for b in bs] for n, bs in rec.boxes.items()},
        "whole": rec.whole, "computed": rec.computed, "unfollowed": rec.unfollowed,
        "touched": {n: sorted(t) for n, t in rec.touched.items()},
        "specs": [[s.name, s.dtype, list(s.shape)] for s in rec.specs.values()],
        "landings": [[la.name, [list(p) for p in la.box], list(la.root), la.target, list(la.target_shape), list(la.sizes),
                      list(la.strides), la.offset] for la in rec.landings],
    }, use_bin_type=True)
    return msgpack.packb({"format": FORMAT, "sha256": hashlib.sha256(payload).hexdigest(), "payload": payload}, use_bin_type=True)


def decode(data: bytes) -> PlanRecording:
    """The recording of a file's bytes; ValueError naming what is wrong (not msgpack, another format,
    a checksum that does not match, a field missing or of the wrong kind)."""
    try:
        outer = msgpack.unpackb(data, raw=False)
    except (msgpack.UnpackException, ValueError) as exc:
        raise ValueError(f"not msgpack ({type(exc).__name__})") from exc
    if not isinstance(outer, dict) or outer.get("format") != FORMAT:
        raise ValueError(f"format {outer.get('format') if isinstance(outer, dict) else type(outer).__name__}, expected {FORMAT}")
    payload = outer.get("payload")
    if not isinstance(payload, bytes) or hashlib.sha256(payload).hexdigest() != outer.get("sha256"):
        raise ValueError("the payload's checksum does not match (a torn or changed file)")
    try:
        body = msgpack.unpackb(payload, raw=False)
        specs = {n: TensorSpec(n, d, tuple(s)) for n, d, s in body["specs"]}
        rec = PlanRecording(specs)
        rec.boxes = {n: [_box(b) for b in bs] for n, bs in body["boxes"].items()}
        rec.whole, rec.computed, rec.unfollowed = dict(body["whole"]), dict(body["computed"]), dict(body["unfollowed"])
        rec.touched = {n: set(t) for n, t in body["touched"].items()}
        rec.landings = [Landing(n, _box(b), tuple(r), t, tuple(ts), tuple(sz), tuple(st), int(o)) for n, b, r, t, ts, sz, st, o in body["landings"]]
    except (KeyError, TypeError, ValueError, msgpack.UnpackException) as exc:
        raise ValueError(f"a malformed payload ({type(exc).__name__}: {str(exc)[:120]})") from exc
    return rec


def _box(pairs: Sequence[Sequence[int]]) -> Box:
    return tuple((int(lo), int(hi)) for lo, hi in pairs)


def _read(path: Path) -> PlanRecording | str | None:
    """The kept recording, None when there is none, or why the file there is unusable."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"unreadable: {exc}"
    collecting = gc.isenabled()
    gc.disable()  # decoding makes ~10 tuples a landing, no cycles: a full collection of the worker's heap mid-way cost 0.4 s on the CPU box
    try:
        return decode(data)
    except ValueError as exc:
        return str(exc)
    finally:
        if collecting:
            gc.enable()


def _write(path: Path, data: bytes) -> None:
    """Whole or not at all: a temp file in the same directory, then `os.replace`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
