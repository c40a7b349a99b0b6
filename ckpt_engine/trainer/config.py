"""The job's one YAML file: sections `trainer`, `rollout`, `checkpoint_engine`, `daemon`.

    ckpt-engine demo --config job.yaml trainer.steps=40 checkpoint_engine.backend=gloo

Each section is its own keyword-only dataclass validated in `__post_init__`; unknown keys are
refused by name (`config_from_mapping`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ckpt_engine.config import CheckpointEngineConfig, ConfigError, apply_overrides, config_from_mapping, load_mapping
from ckpt_engine.daemon.config import DaemonConfig
from ckpt_engine.trainer.ray_config import RayConfig

__all__ = ["JobConfig", "RolloutConfig", "TrainerConfig", "load_job_config"]


def _positive_int(section: str, name: str, value: Any, low: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{section}.{name} must be an int >= {low}, got {value!r}")


def _positive_number(section: str, name: str, value: Any, allow_zero: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{section}.{name} must be a number {'>=' if allow_zero else '>'} 0, got {value!r}")


@dataclass(kw_only=True)
class TrainerConfig:
    """The training side of the fully-async loop."""

    backend: str = "tiny"
    """TrainEngine registry name (`tiny`, `fsdp2`, `megatron`, ...); the loop never branches on it."""
    steps: int = 40
    """Optimizer steps to run."""
    batch_size: int = 64
    """Samples per step."""
    sync_every: int = 2
    """Push the weights to the rollout engines every this many steps."""
    max_staleness: int = 2
    """Train only on samples made by a version at most this many versions behind the newest one pushed."""
    lr: float = 0.05
    seed: int = 0
    batch_timeout_s: float = 120.0
    """Give up (with an error naming the cause) when a batch of fresh samples does not arrive in time."""
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for the TrainEngine constructor (fsdp2: FSDP2Config fields)."""
    num_processes: int | None = None
    """Trainer ranks (data parallel, one process each; rank 0 hosts the daemon). None: 2 for
    fsdp2, 1 otherwise."""
    job_timeout_s: float = 900.0
    """Bound on a multi-process job as a whole (engine start included); the launcher then kills it."""
    lora: dict[str, Any] = field(default_factory=dict)
    """With `checkpoint_engine.weights: adapters`: the PEFT `LoraConfig` keywords of the trained
    adapter (empty: rank 8 on q_proj / v_proj)."""

    def __post_init__(self) -> None:
        if not isinstance(self.backend, str) or not self.backend:
            raise ConfigError(f"trainer.backend must be a registered TrainEngine name, got {self.backend!r}")
        if self.num_processes is not None:
            _positive_int("trainer", "num_processes", self.num_processes)
        _positive_number("trainer", "job_timeout_s", self.job_timeout_s)
        for name in ("steps", "batch_size", "sync_every"):
            _positive_int("trainer", name, getattr(self, name))
        _positive_int("trainer", "max_staleness", self.max_staleness, low=0)
        _positive_int("trainer", "seed", self.seed, low=0)
        _positive_number("trainer", "lr", self.lr)
        _positive_number("trainer", "batch_timeout_s", self.batch_timeout_s)
        if not isinstance(self.engine_kwargs, dict):
            raise ConfigError("trainer.engine_kwargs must be a map")
        if not isinstance(self.lora, dict):
            raise ConfigError(f"trainer.lora must be a map of peft.LoraConfig keywords, got {self.lora!r}")

    @property
    def world_size(self) -> int:
        return self.num_processes if self.num_processes is not None else (2 if self.backend == "fsdp2" else 1)


@dataclass(kw_only=True)
class RolloutConfig:
    """The generation side: engines and the workers that keep them busy."""

    engine: str = "torch_ref"
    """Engine kind (see `ckpt_engine.daemon.adapters`): torch_ref runs the reference receiver, vllm
    a real vLLM `api_server` per engine."""
    num_engines: int = 2
    """Rollout engines (one worker thread each)."""
    samples_per_request: int = 16
    """Prompts per generation request."""
    queue_size: int = 512
    """Bound on generated-but-unconsumed samples; workers block (with a timeout) when it is full."""
    load_delay_s: float = 0.0
    """Reference engine only: sleep per received bucket (emulates a slow loader)."""
    vocab_size: int = 16
    """Size of the synthetic task's token space (prompt and answer)."""
    model: dict[str, Any] = field(default_factory=dict)
    """vllm: overrides of the tiny Qwen2 config.json the job writes locally (hidden_size, ...)."""
    engine_args: list[str] = field(default_factory=list)
    """vllm: extra `api_server` command-line arguments for every engine."""
    start_timeout_s: float = 240.0
    """vllm: bound on an engine's start-up (until /health answers)."""

    def __post_init__(self) -> None:
        if not isinstance(self.model, dict):
            raise ConfigError("rollout.model must be a map of Qwen2 config fields")
        if not isinstance(self.engine_args, list) or not all(isinstance(a, str) for a in self.engine_args):
            raise ConfigError("rollout.engine_args must be a list of strings")
        _positive_number("rollout", "start_timeout_s", self.start_timeout_s)
        if not isinstance(self.engine, str) or not self.engine:
            raise ConfigError(f"rollout.engine must be an engine kind name, got {self.engine!r}")
        for name in ("num_engines", "samples_per_request", "queue_size"):
            _positive_int("rollout", name, getattr(self, name))
        _positive_int("rollout", "vocab_size", self.vocab_size, low=2)
        _positive_number("rollout", "load_delay_s", self.load_delay_s, allow_zero=True)


@dataclass(kw_only=True)
class JobConfig:
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    checkpoint_engine: CheckpointEngineConfig = field(default_factory=CheckpointEngineConfig)
    daemon: DaemonConfig = field(default_factory=DaemonConfig)
    ray: RayConfig = field(default_factory=RayConfig)


SECTIONS = {"trainer": TrainerConfig, "rollout": RolloutConfig, "checkpoint_engine": CheckpointEngineConfig, "daemon": DaemonConfig, "ray": RayConfig}


def load_job_config(
    source: str | os.PathLike[str] | Mapping[str, Any] | None = None, overrides: Sequence[str] = ()
) -> JobConfig:
    """YAML file (or mapping) + dotted overrides -> validated JobConfig; unknown sections are refused."""
    data = apply_overrides(load_mapping(source), overrides)
    unknown = sorted(set(data) - set(SECTIONS))
    if unknown:
        raise ConfigError(f"unknown section(s) {', '.join(unknown)}; allowed: {', '.join(SECTIONS)}")
    return JobConfig(**{name: config_from_mapping(cls, data, name) for name, cls in SECTIONS.items()})
