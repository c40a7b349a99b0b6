"""The daemon's control server: the methods of `ckpt_engine.daemon.protocol` on a ControlServer.

The connection handling (token, handshake and frame deadlines, connection caps, frame limit) is
`ckpt_engine.control.server`'s, shared with every other control port; this module only checks
each request's params against the protocol's table and routes it. It knows the daemon through
the small `DaemonMethods` protocol, so the coordinator imports it and not the other way round.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Protocol

from ckpt_engine.control.server import ControlLimits, ControlServer
from ckpt_engine.daemon.protocol import check_params

__all__ = ["DaemonMethods", "DaemonServer"]

logger = logging.getLogger(__name__)


class DaemonMethods(Protocol):
    """What the control server needs from the daemon (WeightSyncDaemon implements it)."""

    def hello(self) -> dict[str, Any]: ...
    def register(self, name: str, engine: dict[str, Any]) -> dict[str, Any]: ...
    def leave(self, name: str) -> bool: ...
    def heartbeat(self, name: str) -> dict[str, Any]: ...
    def members(self) -> dict[str, Any]: ...
    def status(self) -> dict[str, Any]: ...
    def begin_sync(self, version: int) -> dict[str, Any]: ...
    def record_sync(self, outcome: dict[str, Any]) -> dict[str, Any]: ...


class DaemonServer(ControlServer):
    """Serves one daemon's control methods to holders of the job token."""

    def __init__(self, daemon: DaemonMethods, *, token: str, limits: ControlLimits, host: str = "127.0.0.1", port: int = 0) -> None:
        self.daemon = daemon
        super().__init__(self._route, token=token, limits=limits, host=host, port=port, name="daemon")

    def _route(self, method: str, params: dict[str, Any]) -> Any:
        args = check_params(method, params)
        d = self.daemon
        if method == "hello":
            return d.hello()
        if method == "register":
            return d.register(args["name"], args["engine"])
        if method == "leave":
            return {"left": d.leave(args["name"])}
        if method == "heartbeat":
            return d.heartbeat(args["name"])
        if method == "members":
            return d.members()
        if method == "status":
            return {**d.status(), "refused_requests": self.refused, "connections": self.connections()}
        if method == "begin_sync":
            return d.begin_sync(args["version"])
        if method == "report_sync":
            return d.record_sync(args["outcome"])
        if method == "shutdown":
            threading.Timer(0.05, self.close).start()  # reply first, then stop
            return {}
        raise AssertionError(f"method {method} passed check_params but has no handler")
