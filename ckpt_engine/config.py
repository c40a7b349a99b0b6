"""Configuration: one keyword-only dataclass per component, loaded from YAML or dicts.

Every section lives under its own top-level key (`checkpoint_engine:` here); dotted overrides such
as `checkpoint_engine.backend=nccl` patch a loaded mapping before it is validated, the way verl and
Hydra users pass them on the command line.
"""

from __future__ import annotations

import dataclasses
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
    "apply_overrides",
    "config_from_mapping",
    "load_config",
    "load_mapping",
]

PAUSE_MODES = ("keep", "abort", "none")


class ConfigError(ValueError):
    """A configuration value is missing, mistyped or out of range; the message names the field."""


@dataclass(kw_only=True)
class CheckpointEngineConfig:
    """How weights travel from trainer to rollout engines."""

    backend: str = "auto"
    """Transport: `auto` (nccl on CUDA, hccl on Ascend, gloo on CPU) or a registered name."""
    bucket_size_mb: float | None = None
    """Bucket size in MiB; unset sizes it from free device memory (see `resolve_bucket_size_bytes`)."""
    num_buffers: int = 2
    """Rotating bucket buffers per side (>= 2): bucket k+1 is packed while bucket k is in flight."""
    timeout_s: float = 300.0
    """Upper bound on every wait: rendezvous, collectives, control calls."""
    verify: bool = False
    """Send a checksum with every bucket and check it on every receiver before loading."""
    pause_mode: str = "keep"
    """How engines pause around a load: `keep` in-flight requests, `abort` them, or `none`."""
    engine_kwargs: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Extra keyword arguments per backend name, e.g. `{"nccl": {"device": 0}}`."""

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
        if self.num_buffers < 2:
            raise ConfigError(f"checkpoint_engine.num_buffers must be >= 2 (one packs while one sends), got {self.num_buffers}")
        _check_number("checkpoint_engine.timeout_s", self.timeout_s)
        if not self.timeout_s > 0:
            raise ConfigError(f"checkpoint_engine.timeout_s must be > 0, got {self.timeout_s}")
        _check_type("checkpoint_engine.verify", self.verify, bool)
        if self.pause_mode not in PAUSE_MODES:
            raise ConfigError(f"checkpoint_engine.pause_mode must be one of {', '.join(PAUSE_MODES)}, got {self.pause_mode!r}")
        if not isinstance(self.engine_kwargs, dict) or not all(
            isinstance(k, str) and isinstance(v, dict) for k, v in self.engine_kwargs.items()
        ):
            raise ConfigError("checkpoint_engine.engine_kwargs must map backend names to dicts of keyword arguments")

    @property
    def bucket_size_bytes(self) -> int | None:
        if self.bucket_size_mb is None:
            return None
        return max(4096, int(self.bucket_size_mb * (1 << 20)) // 4096 * 4096)

    def kwargs_for(self, backend: str) -> dict[str, Any]:
        return dict(self.engine_kwargs.get(backend, {}))


def _check_type(name: str, value: Any, typ: type) -> None:
    if typ is int and isinstance(value, bool) or not isinstance(value, typ):
        raise ConfigError(f"{name} must be {typ.__name__}, got {type(value).__name__} {value!r}")


def _check_number(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number, got {type(value).__name__} {value!r}")


def load_mapping(source: str | os.PathLike[str] | Mapping[str, Any] | None) -> dict[str, Any]:
    """Read a YAML file (or take a mapping) as a plain nested dict."""
    if source is None:
        return {}
    if isinstance(source, Mapping):
        return _deep_copy(source)
    path = Path(source)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping at the top level")
    return data


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
        node[parts[-1]] = yaml.safe_load(text) if text else ""
    return data


T = TypeVar("T")


def config_from_mapping(cls: type[T], data: Mapping[str, Any] | None, section: str) -> T:
    """Build dataclass `cls` from `data[section]`, rejecting unknown keys by name."""
    values = dict(data.get(section) or {}) if data else {}
    if not isinstance(values, dict):
        raise ConfigError(f"{section} must be a mapping, got {type(values).__name__}")
    fields = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ConfigError(f"unknown key(s) under {section}: {', '.join(unknown)}; allowed: {', '.join(sorted(fields))}")
    try:
        return cls(**values)
    except TypeError as exc:
        raise ConfigError(f"{section}: {exc}") from None


def load_config(
    source: str | os.PathLike[str] | Mapping[str, Any] | None = None, overrides: Sequence[str] = ()
) -> CheckpointEngineConfig:
    """Load the `checkpoint_engine` section from a YAML file or mapping plus dotted overrides."""
    data = apply_overrides(load_mapping(source), overrides)
    return config_from_mapping(CheckpointEngineConfig, data, "checkpoint_engine")
