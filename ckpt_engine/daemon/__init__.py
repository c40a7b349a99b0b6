"""The weight-sync daemon: membership, versions, health, fault recovery and the control protocol.

`WeightSyncDaemon` (coordinator.py) is the one class: embedded in trainer rank 0, standalone
behind `ckpt-engine serve`, or a trainer-side follower of a standalone daemon. The control
protocol is documented in protocol.py.
"""

from ckpt_engine.daemon.adapters import EngineKindRegistry, make_adapter, register_engine_kind
from ckpt_engine.daemon.client import DaemonClient, HeartbeatSender, parse_address
from ckpt_engine.daemon.config import DaemonConfig
from ckpt_engine.daemon.coordinator import SyncOutcome, WeightSyncDaemon
from ckpt_engine.daemon.membership import EngineRecord, EngineState
from ckpt_engine.daemon.protocol import PROTOCOL_VERSION, AuthError, ProtocolError

__all__ = [
    "AuthError",
    "DaemonClient",
    "DaemonConfig",
    "EngineKindRegistry",
    "EngineRecord",
    "EngineState",
    "HeartbeatSender",
    "PROTOCOL_VERSION",
    "ProtocolError",
    "SyncOutcome",
    "WeightSyncDaemon",
    "make_adapter",
    "parse_address",
    "register_engine_kind",
]
