"""Configuration: one keyword-only dataclass per component, loaded from YAML or dicts.

Every section lives under its own top-level key (`checkpoint_engine:` here); dotted overrides such
as `checkpoint_engine.backend=nccl` patch a loaded mapping before it is validated, the way verl and
Hydra users pass them on the command line.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

__all__ = [
    "CheckpointEngineConfig",
    "ConfigError",
    "PAUSE_MODES",
    "STAGE_MODES",
    "apply_overrides",
    "check_sections",
    "config_from_mapping",
    "load_config",
    "load_mapping",
]

PAUSE_MODES = ("keep", "abort", "none", "recompute")
DELTA_MODES = ("off", "auto", "on")
STAGE_MODES = ("auto", "patches", "full", "off")
SENDER_MODES = ("rank0", "all", "per_stage")
WEIGHT_MODES = ("full", "adapters")
UNWRITTEN_MODES = ("warn", "error")
WIRE_DTYPES = ("fp8",)
"""`wire_dtype` values besides unset: `fp8` = block-FP8 (`ckpt_engine/sources/fp8.py`)."""
MAX_BUFFERS = 64
"""Most rotating bucket buffers per side: more only multiplies memory, never overlap."""
MAX_TIMEOUT_S = 7 * 24 * 3600.0
"""Longest wait a config may ask for (a week): longer ones overflow the timers that enforce it."""


class ConfigError(ValueError):
    """A configuration value is missing, mistyped or out of range; the message names the field."""


@dataclass(kw_only=True)
class CheckpointEngineConfig:
    """How weights travel from trainer to rollout engines."""

    backend: str = "auto"
    """Transport: `auto` (nccl on CUDA, hccl on Ascend, gloo on CPU) or a registered name."""
    bucket_size_mb: float | None = None
    """Bucket size in MiB; unset sizes it from free device memory (see `planning.buckets.auto_bucket_size_bytes`)."""
    num_buffers: int = 2
    """Rotating bucket buffers per side (>= 2): bucket k+1 is packed while bucket k is in flight."""
    region_slot_memory_mb: float | None = None
    """Region delivery (receive plans): slot memory in MiB a sender may give receiver sets streamed
    side by side; each set takes `num_buffers` x bucket, so max(1, budget // (num_buffers x
    bucket)) sets stream at once (at most the layout's sets; below one set's slots: one at a time).
    Unset: 8 sets side by side. Raise it where engines have more than 8 TP/EP ranks on their own NICs."""
    timeout_s: float = 300.0
    """Upper bound on every wait: rendezvous, collectives, control calls."""
    verify: bool = False
    """Send a checksum with every bucket and check it on every receiver before loading."""
    pause_mode: str = "keep"
    """How engines pause around a load: `keep` in-flight requests (with their KV), `abort` them,
    `recompute` (keep them, but they re-prefill their tokens so far under the new weights: vLLM
    keep + its cache reset of running requests, SGLang `retract`), or `none`."""
    stage: str = "auto"
    """Staged syncs (engines keep generating while the next version streams in, and pause only for
    the swap): `patches` stages patch syncs (the decoded patches, checked against the live weights,
    are applied at the swap) and pauses for dense ones as `off` does; `full` stages dense syncs too,
    in a staging copy of every weight (an engine without room for one is refused before anything
    pauses); `auto` stages patches, and a dense sync only when every engine reports room for the
    copy, else pauses as today (said once per session); `off`: pause for the whole sync. Engines
    that cannot stage (`RolloutAdapter.stages` False) make every sync of their session `off`."""
    engine_kwargs: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Extra keyword arguments per backend name, e.g. `{"nccl": {"device": 0}}`."""
    delta: str = "off"
    """Lossless delta syncs: `off`; `on` (each bucket travels as the words that changed since the
    last sync when that is smaller, dense otherwise; every side keeps a base copy of what it sends
    or receives, the model's wire bytes on each receiver and each sender's share on each sender);
    `auto` (as `on` where the backend and every engine support it, and dense for a while after
    patches did not pay, e.g. at a high learning rate)."""
    full_sync_every: int = 0
    """With delta: a dense seed every this many syncs (0: only when needed: first sync, new or
    restarted engine, new plan, after a failure)."""
    senders: str = "auto"
    """Who streams the weights: `rank0` (trainer rank 0 sends full tensors, the others only walk
    `iter_weights`), `all` (every trainer rank sends the shards it owns, no gather; the source must
    be a `ShardedWeightSource`), `per_stage` (Megatron: each pipeline stage sends its layers;
    sources declare it through the same ownership map), or `auto` (`all` when the source is
    sharded over several ranks, else `rank0`)."""
    weights: str = "full"
    """What a sync carries: `full` (every tensor the engines load) or `adapters` (only a LoRA
    adapter, in PEFT's layout: `AdapterSource`, or `FSDP2Config(weights="adapters")`; the engines
    hold several adapter versions, e.g. `VllmLoraRollout`). See docs/lora.md."""
    max_adapter_versions: int = 2
    """With `weights: adapters`: adapter versions an engine keeps live at once (the newest, plus
    older ones until their last request ends)."""
    wire_dtype: str | None = None
    """What the weights travel as: unset, each tensor in the source's own dtype; `fp8`, block-FP8
    (each linear weight quantized on the trainer's device into float8_e4m3fn with float32
    `<name>_scale_inv` per 128 x 128 block, as FP8 checkpoints and vLLM's block-FP8 loader hold them;
    norms, embeddings, the LM head, biases and routers as they are), for engines holding an FP8
    model. See docs/fp8.md."""
    verify_installed: str | int = "first"
    """Installed-weight checks (docs/guarantees.md): after the stream, every engine rank digests what
    it installed, in its own layout, and the trainer the same regions of the source; a difference
    fails the sync naming the tensor and the engine (left paused and stale). `first`: the syncs of a
    session until one completes; N (an int >= 1): those and every N-th sync; `off`: never. Engines
    without the capability are named once and not checked. See `ckpt_engine/installed.py`."""
    verify_installed_samples: int = 4096
    """Positions each check reads per tensor region (spread over all of it, drawn afresh every
    check, the first and last always): a fault touching a fraction f of a tensor goes unseen with
    probability (1 - f)^samples; 0 reads every element (a full fold, about one read of the model)."""
    unwritten_tensors: str = "warn"
    """A checked sync names the parameters and persistent buffers of an engine's layout it does not
    write: `warn` logs them once, `error` fails the sync with them."""

    def __post_init__(self) -> None:
        _check_type("checkpoint_engine.backend", self.backend, str)
        if not self.backend:
            raise ConfigError("checkpoint_engine.backend must be 'auto' or a registered backend name, got ''")
        from ckpt_engine.registry import CheckpointEngineRegistry

        known = CheckpointEngineRegistry.names()
        if self.backend != "auto" and self.backend not in known:
            raise ConfigError(
                f"checkpoint_engine.backend={self.backend!r} is not a backend; allowed: auto, {', '.join(known)}"
            )
        if self.bucket_size_mb is not None:
            _check_number("checkpoint_engine.bucket_size_mb", self.bucket_size_mb)
            if not 0 < self.bucket_size_mb <= 1 << 20:
                raise ConfigError(f"checkpoint_engine.bucket_size_mb must be in (0, 1048576] MiB or unset, got {self.bucket_size_mb}")
        _check_type("checkpoint_engine.num_buffers", self.num_buffers, int)
        if not 2 <= self.num_buffers <= MAX_BUFFERS:
            raise ConfigError(
                f"checkpoint_engine.num_buffers must be in [2, {MAX_BUFFERS}] (one packs while one sends; each side holds that many "
                f"buckets per sender), got {self.num_buffers}"
            )
        if self.region_slot_memory_mb is not None:
            _check_number("checkpoint_engine.region_slot_memory_mb", self.region_slot_memory_mb)
            if not 0 < self.region_slot_memory_mb <= 1 << 30:
                raise ConfigError(
                    f"checkpoint_engine.region_slot_memory_mb must be in (0, 1073741824] MiB or unset (8 sets side by side), "
                    f"got {self.region_slot_memory_mb}"
                )
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) or not 0 < self.timeout_s <= MAX_TIMEOUT_S:  # NaN fails too
            raise ConfigError(
                f"checkpoint_engine.timeout_s must be a finite number of seconds in (0, {MAX_TIMEOUT_S:.0f}], got {self.timeout_s!r}"
                f"{_text_number(self.timeout_s)}"
            )
        _check_type("checkpoint_engine.verify", self.verify, bool)
        if self.pause_mode not in PAUSE_MODES:
            raise ConfigError(f"checkpoint_engine.pause_mode must be one of {', '.join(PAUSE_MODES)}, got {self.pause_mode!r}")
        if self.stage is False:  # YAML 1.1 reads `stage: off` as a bool
            self.stage = "off"
        if self.stage not in STAGE_MODES:
            raise ConfigError(f"checkpoint_engine.stage must be one of {', '.join(STAGE_MODES)}, got {self.stage!r}")
        if not isinstance(self.engine_kwargs, dict) or not all(
            isinstance(k, str) and isinstance(v, dict) for k, v in self.engine_kwargs.items()
        ):
            raise ConfigError("checkpoint_engine.engine_kwargs must map backend names to dicts of keyword arguments")
        for name, kwargs in self.engine_kwargs.items():
            _check_engine_kwargs(name, kwargs, known)
        if isinstance(self.delta, bool):  # YAML 1.1 reads `delta: on` (and `delta=off`) as a bool
            self.delta = "on" if self.delta else "off"
        if self.delta not in DELTA_MODES:
            raise ConfigError(f"checkpoint_engine.delta must be one of {', '.join(DELTA_MODES)}, got {self.delta!r}")
        _check_type("checkpoint_engine.full_sync_every", self.full_sync_every, int)
        if self.full_sync_every < 0:
            raise ConfigError(f"checkpoint_engine.full_sync_every must be >= 0 (0: only when needed), got {self.full_sync_every}")
        if self.senders not in (*SENDER_MODES, "auto"):
            raise ConfigError(f"checkpoint_engine.senders must be one of auto, {', '.join(SENDER_MODES)}, got {self.senders!r}")
        if self.weights not in WEIGHT_MODES:
            raise ConfigError(f"checkpoint_engine.weights must be one of {', '.join(WEIGHT_MODES)}, got {self.weights!r}")
        _check_type("checkpoint_engine.max_adapter_versions", self.max_adapter_versions, int)
        if self.max_adapter_versions < 1:
            raise ConfigError(f"checkpoint_engine.max_adapter_versions must be >= 1, got {self.max_adapter_versions}")
        self._check_installed()
        if self.wire_dtype is not None and self.wire_dtype not in WIRE_DTYPES:
            raise ConfigError(
                f"checkpoint_engine.wire_dtype must be one of {', '.join(WIRE_DTYPES)} or unset (the source's own dtypes), got "
                f"{self.wire_dtype!r} (casts such as bfloat16 are the source's: StateDictSource(dtype=...), the trainer's wire_dtype)"
            )

    def _check_installed(self) -> None:
        if isinstance(self.verify_installed, bool):  # YAML 1.1 reads `verify_installed: off` as a bool
            self.verify_installed = "first" if self.verify_installed else "off"
        v = self.verify_installed
        if not (v in ("first", "off") or isinstance(v, int) and v >= 1):
            raise ConfigError(f"checkpoint_engine.verify_installed must be first, off or an int N >= 1 (every N-th sync), got {v!r}")
        _check_type("checkpoint_engine.verify_installed_samples", self.verify_installed_samples, int)
        if not 0 <= self.verify_installed_samples <= 1 << 30:
            raise ConfigError(f"checkpoint_engine.verify_installed_samples must be in [0, 1073741824] (0: every element), got {self.verify_installed_samples}")
        if self.unwritten_tensors not in UNWRITTEN_MODES:
            raise ConfigError(f"checkpoint_engine.unwritten_tensors must be one of {', '.join(UNWRITTEN_MODES)}, got {self.unwritten_tensors!r}")

    def check_memory(self, device: str | None = None) -> None:
        """Refuse a bucket size whose buffers cannot fit in `device`'s free memory (before any engine joins).

        `device` defaults to the backend's: CUDA for nccl, host memory otherwise.
        A sync allocates `num_buffers` buckets on the sender and on every receiver; finding out at
        the join costs a timeout and a misleading error far from the setting."""
        if self.bucket_size_bytes is None:
            return  # sized from free memory at the first sync
        if device is None:
            from ckpt_engine.registry import CheckpointEngineRegistry

            try:
                device = "cuda" if CheckpointEngineRegistry.resolve_name(self.backend) == "nccl" else "cpu"
            except Exception:  # no device to detect: nothing to check against
                return
        need = self.bucket_size_bytes * self.num_buffers
        free = _free_bytes(device)
        if free is not None and need > free:
            most = max(0.0, free / self.num_buffers / (1 << 20))
            raise ConfigError(
                f"checkpoint_engine.bucket_size_mb={self.bucket_size_mb}: {self.num_buffers} buffers need {need / (1 << 30):.2f} GiB "
                f"but {device} has {free / (1 << 30):.2f} GiB free; allowed: at most {most:.0f} MiB with num_buffers={self.num_buffers}, "
                "or leave it unset to size buckets from free memory"
            )

    @property
    def bucket_size_bytes(self) -> int | None:
        if self.bucket_size_mb is None:
            return None
        return max(4096, int(self.bucket_size_mb * (1 << 20)) // 4096 * 4096)

    @property
    def region_slot_memory_bytes(self) -> int | None:
        if self.region_slot_memory_mb is None:
            return None
        return int(self.region_slot_memory_mb * (1 << 20))

    def kwargs_for(self, backend: str) -> dict[str, Any]:
        return dict(self.engine_kwargs.get(backend, {}))


def _check_type(name: str, value: Any, typ: type) -> None:
    if typ is int and isinstance(value, bool) or not isinstance(value, typ):
        raise ConfigError(f"{name} must be {typ.__name__}, got {type(value).__name__} {value!r}")


def _check_number(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number, got {type(value).__name__} {value!r}{_text_number(value)}")


def _text_number(value: Any) -> str:
    """Why a number came as text, where YAML 1.1 made it so (`1e9` is a string there, `1.0e9` a float)."""
    try:
        float(value)
    except (TypeError, ValueError):
        return ""
    return " (YAML reads a number such as 1e9 as text: write 1.0e9)" if isinstance(value, str) else ""


def _check_engine_kwargs(backend: str, kwargs: dict[str, Any], known: list[str]) -> None:
    """Unknown options and bad values are refused now, not at the first sync (where they fail after
    engines paused): each transport's options are a typed dataclass that checks its values."""
    from ckpt_engine.registry import BackendUnavailableError, CheckpointEngineRegistry

    where = f"checkpoint_engine.engine_kwargs.{backend}"
    if backend not in known:
        raise ConfigError(f"{where}: {backend!r} is not a backend; allowed: {', '.join(known)}")
    try:
        CheckpointEngineRegistry.check_options(backend, kwargs)
    except BackendUnavailableError:  # not importable here (e.g. hccl without torch_npu): checked where it runs
        return
    except (TypeError, ValueError) as exc:
        sep = ": " if str(exc).startswith("unknown option") else "."
        raise ConfigError(f"{where}{sep}{exc}") from None


def _free_bytes(device: str) -> int | None:
    """Free memory of `device` ("cpu", "cuda", "cuda:1"), or None when it cannot be told."""
    try:
        if device.startswith("cuda"):
            import torch

            if not torch.cuda.is_available():
                return None
            return int(torch.cuda.mem_get_info(torch.device(device))[0])
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, RuntimeError):
        return None
    return None


def load_mapping(source: str | os.PathLike[str] | Mapping[str, Any] | None) -> dict[str, Any]:
    """Read a YAML file (or take a mapping) as a plain nested dict."""
    if source is None:
        return {}
    if isinstance(source, Mapping):
        return _deep_copy(source)
    path = Path(source)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        data = yaml.load(path.read_text(), Loader=_UniqueKeyLoader) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {_yaml_problem(exc)}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping at the top level")
    return data


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (plain YAML keeps the last one
    silently: an edit that adds a setting again would quietly override the first)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first at line {seen[key].line + 1})", key_node.start_mark
                )
            seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """One line: what YAML found and where (its own message spans several lines)."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else str(problem)


def _deep_copy(m: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, Mapping) else v for k, v in m.items()}


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` overrides (values parsed as YAML scalars) to a nested dict in place."""
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override {item!r} must look like section.field=value")
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part!r} is a value, not a section")
            node = child
        try:
            node[parts[-1]] = yaml.safe_load(text) if text else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"override {item!r}: the value is not a YAML scalar, list or map: {_yaml_problem(exc)}") from None
    return data


T = TypeVar("T")


def config_from_mapping(cls: type[T], data: Mapping[str, Any] | None, section: str) -> T:
    """Build dataclass `cls` from `data[section]`, rejecting unknown keys by name."""
    raw = data.get(section) if data else None
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{section} must be a mapping of its fields (e.g. {section}.<field>=value), got {type(raw).__name__} {raw!r:.60}")
    values = dict(raw)
    fields = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(str(k) for k in set(values) - fields)
    if unknown:
        raise ConfigError(f"unknown key(s) under {section}: {', '.join(unknown)}; allowed: {', '.join(sorted(fields))}")
    try:
        return cls(**values)
    except TypeError as exc:
        raise ConfigError(f"{section}: {exc}") from None


def check_sections(data: Mapping[str, Any], known: Sequence[str]) -> None:
    """Refuse a top-level key that misspells one of the `known` sections (`checkpoint_engin`,
    `checkpoint-engine`): a job YAML may hold other sections, but a near miss of one read here
    would leave every setting under it silently at its default."""
    for key in data:
        if key in known or not isinstance(key, str):
            continue
        near = difflib.get_close_matches(key.replace("-", "_").lower(), known, n=1, cutoff=0.8)
        if near:
            raise ConfigError(f"unknown section {key!r}: did you mean {near[0]!r}? (its settings would be ignored)")


def load_config(
    source: str | os.PathLike[str] | Mapping[str, Any] | None = None, overrides: Sequence[str] = ()
) -> CheckpointEngineConfig:
    """Load the `checkpoint_engine` section from a YAML file or mapping plus dotted overrides."""
    data = apply_overrides(load_mapping(source), overrides)
    check_sections(data, ("checkpoint_engine",))
    return config_from_mapping(CheckpointEngineConfig, data, "checkpoint_engine")
