"""`daemon:` section of the job YAML: how the coordinator watches engines and recovers from faults.

Transport settings stay in `checkpoint_engine:` (CheckpointEngineConfig); this section only holds
what the coordinator itself needs, so one YAML file configures trainer, rollout, transport and
daemon with dotted overrides such as `daemon.heartbeat_timeout_s=10`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ckpt_engine.config import ConfigError
from ckpt_engine.control.server import ControlLimits

__all__ = ["DaemonConfig"]


@dataclass(frozen=True, kw_only=True)
class DaemonConfig(ControlLimits):
    """Membership, liveness and recovery settings of the weight-sync daemon, and its control port's
    limits (a `ControlLimits`, their keys flat in `daemon:`)."""

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
    peer_join: bool = False
    """An engine that registers without the current version pulls it from a serving peer over NIXL
    (`ckpt_engine.elastic`, docs/elastic.md) instead of waiting for the trainer's next sync."""
    state_file: str | None = None
    """Where this job's highest version is kept (a small JSON file, written as versions are handed
    out), so that a daemon started again after the whole job stopped never hands out a version the
    job used, even before the engine holding it registers. None: what engines report is all it knows."""
    engine_lease_s: float = 60.0
    """An engine this daemon claimed stays its own while the daemon was heard from within this
    (every health probe and control call renews it); released at once on leave or close."""
    max_frame_bytes: int = 4 * 1024 * 1024
    """Largest control message accepted; control messages are small, so a big header is hostile.
    The other limits of the control port (`max_connections`, `max_unauthenticated`,
    `handshake_timeout_s`, `frame_timeout_s`, `idle_timeout_s`) come from `ControlLimits`."""

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ConfigError(f"daemon.host must be a non-empty string, got {self.host!r}")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ConfigError(f"daemon.port must be an int in [0, 65535] (0 = free port from the OS), got {self.port!r}")
        for name in ("heartbeat_timeout_s", "health_interval_s", "engine_lease_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ConfigError(f"daemon.{name} must be a finite number of seconds >= 0, got {value!r}")
            if name != "heartbeat_timeout_s" and not value > 0:
                raise ConfigError(f"daemon.{name} must be > 0, got {value!r}")
        value = self.max_resync_attempts
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"daemon.max_resync_attempts must be an int >= 0, got {value!r}")
        if self.state_file is not None and (not isinstance(self.state_file, str) or not self.state_file):
            raise ConfigError(f"daemon.state_file must be a file path (or unset), got {self.state_file!r}")
        for name in ("catch_up", "peer_join"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"daemon.{name} must be a bool, got {getattr(self, name)!r}")
        try:  # the control port's limits check themselves (one rule for every control port)
            super().__post_init__()
        except ValueError as exc:
            raise ConfigError(f"daemon.{exc}") from None
