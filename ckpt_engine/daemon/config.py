"""`daemon:` section of the job YAML: how the coordinator watches engines and recovers from faults.

Transport settings stay in `checkpoint_engine:` (CheckpointEngineConfig); this section only holds
what the coordinator itself needs, so one YAML file configures trainer, rollout, transport and
daemon with dotted overrides such as `daemon.heartbeat_timeout_s=10`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckpt_engine.config import ConfigError

__all__ = ["DaemonConfig"]


@dataclass(kw_only=True)
class DaemonConfig:
    """Membership, liveness and recovery settings of the weight-sync daemon."""

    host: str = "127.0.0.1"
    """Address the control server binds (`ckpt-engine serve`, or an embedded daemon's `serve()`)."""
    port: int = 0
    """Control port; 0 asks the OS for a free one (printed at start)."""
    heartbeat_timeout_s: float = 30.0
    """An engine neither heard from (heartbeat) nor answering health probes for this long is dropped; 0 disables."""
    health_interval_s: float = 2.0
    """Seconds between the monitor's health probes of every registered engine."""
    max_resync_attempts: int = 2
    """After a sync loses engines, re-sync the survivors to the same version up to this many times."""
    catch_up: bool = True
    """The trainer syncs right away (instead of at the next `sync_every`) when an engine waits for weights."""
    max_connections: int = 64
    """Concurrent control connections; more are refused so a flood cannot exhaust threads."""
    idle_timeout_s: float = 300.0
    """A control connection silent this long (or stuck mid-frame) is closed."""
    max_frame_bytes: int = 4 * 1024 * 1024
    """Largest control message accepted; control messages are small, so a big header is hostile."""

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ConfigError(f"daemon.host must be a non-empty string, got {self.host!r}")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ConfigError(f"daemon.port must be an int in [0, 65535] (0 = free port from the OS), got {self.port!r}")
        for name in ("heartbeat_timeout_s", "health_interval_s", "idle_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ConfigError(f"daemon.{name} must be a number >= 0, got {value!r}")
        if not self.health_interval_s > 0 or not self.idle_timeout_s > 0:
            raise ConfigError("daemon.health_interval_s and daemon.idle_timeout_s must be > 0")
        for name, low in (("max_resync_attempts", 0), ("max_connections", 1), ("max_frame_bytes", 1024)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"daemon.{name} must be an int >= {low}, got {value!r}")
        if not isinstance(self.catch_up, bool):
            raise ConfigError(f"daemon.catch_up must be a bool, got {self.catch_up!r}")
