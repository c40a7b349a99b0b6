"""The `ray:` section of the job YAML: whether and how the job's processes become Ray actors.

Its own module so the job config can hold it without importing the launcher (which imports the
trainer loop, which imports the job config).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ckpt_engine.config import ConfigError

__all__ = ["PLACEMENT_STRATEGIES", "RayConfig"]

PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


def _number(name: str, value: Any, *, low: float = 0.0, strict: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < low or (strict and value == low):
        raise ConfigError(f"ray.{name} must be a number {'>' if strict else '>='} {low:g}, got {value!r}")


def _resources(name: str, value: Any) -> None:
    if not isinstance(value, dict):
        raise ConfigError(f"ray.{name} must be a map of custom resource name -> amount, got {value!r}")
    for key, amount in value.items():
        if not isinstance(key, str) or not key or key in ("CPU", "GPU", "memory"):
            raise ConfigError(f"ray.{name}: {key!r} is not a custom resource name (CPU and GPU have their own keys)")
        _number(f"{name}.{key}", amount, strict=True)


@dataclass(kw_only=True)
class RayConfig:
    """Placement, actor sizes and lifecycle bounds of a job launched on Ray."""

    enabled: bool = False
    """Run the trainer ranks and the rollout engines as Ray actors; false runs plain local processes."""
    address: str | None = None
    """`ray.init(address=...)` when this process has not connected yet: None starts a local cluster,
    "auto" joins the cluster this machine belongs to, "ray://host:port" a remote one."""
    trainer_num_cpus: float = 1.0
    """CPUs reserved for each trainer rank actor (rank 0 also runs the rollout worker threads)."""
    trainer_num_gpus: float = 0.0
    """GPUs reserved for each trainer rank actor."""
    engine_num_cpus: float = 1.0
    """CPUs reserved for each rollout engine actor."""
    engine_num_gpus: float = 0.0
    """GPUs reserved for each rollout engine actor."""
    trainer_resources: dict[str, float] = field(default_factory=dict)
    """Custom resources every trainer bundle asks for (pins the trainer to nodes that offer them)."""
    engine_resources: dict[str, float] = field(default_factory=dict)
    """Custom resources every engine bundle asks for."""
    placement_strategy: str = "PACK"
    """Placement-group strategy (PACK, SPREAD, STRICT_PACK, STRICT_SPREAD). Under STRICT_SPREAD the
    trainer ranks share one bundle (one node) and every engine gets a node of its own."""
    engine_max_restarts: int = 1
    """How often Ray restarts a dead engine actor; a restarted engine registers again and gets the
    current version before it serves."""
    monitor_interval_s: float = 1.0
    """How often the controller asks Ray whether the engine actors are alive."""
    start_timeout_s: float = 120.0
    """Bound on reserving the placement group and on each actor's start-up call."""
    job_timeout_s: float = 3600.0
    """Bound on the whole training run."""

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ConfigError(f"ray.enabled must be a bool, got {self.enabled!r}")
        if self.address is not None and (not isinstance(self.address, str) or not self.address):
            raise ConfigError(f"ray.address must be null or a non-empty string such as 'auto', got {self.address!r}")
        for role in ("trainer", "engine"):
            cpus, gpus = getattr(self, f"{role}_num_cpus"), getattr(self, f"{role}_num_gpus")
            _number(f"{role}_num_cpus", cpus)
            _number(f"{role}_num_gpus", gpus)
            if cpus == 0 and gpus == 0:  # Ray refuses an empty placement-group bundle
                raise ConfigError(f"ray.{role}_num_cpus and ray.{role}_num_gpus are both 0; reserve at least one of them")
            _resources(f"{role}_resources", getattr(self, f"{role}_resources"))
        if self.placement_strategy not in PLACEMENT_STRATEGIES:
            raise ConfigError(f"ray.placement_strategy must be one of {', '.join(PLACEMENT_STRATEGIES)}, got {self.placement_strategy!r}")
        if isinstance(self.engine_max_restarts, bool) or not isinstance(self.engine_max_restarts, int) or self.engine_max_restarts < 0:
            raise ConfigError(f"ray.engine_max_restarts must be an int >= 0, got {self.engine_max_restarts!r}")
        for name in ("monitor_interval_s", "start_timeout_s", "job_timeout_s"):
            _number(name, getattr(self, name), strict=True)
