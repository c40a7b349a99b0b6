"""DaemonClient: the control protocol from the other side (engines, trainers, `ckpt-engine status`)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from ckpt_engine.control.wire import RpcClient, RpcError, WireError

__all__ = ["DaemonClient", "HeartbeatSender", "parse_address"]

logger = logging.getLogger(__name__)


def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"daemon address must look like host:port, got {address!r}")
    return host.strip("[]"), int(port)


class DaemonClient:
    """One connection to a daemon; every call carries the job token and has a timeout.

    Calls are idempotent (register replaces by name, report_sync is keyed by version), so a call
    that fails on a connection the daemon closed (idle timeout, restart, a newcomer took the
    slot of this idle connection) is sent again until `timeout_s` runs out.
    """

    def __init__(self, address: str | tuple[str, int], token: str, timeout_s: float = 30.0) -> None:
        self.host, self.port = parse_address(address) if isinstance(address, str) else address
        self.token = token
        self.timeout_s = timeout_s
        self._rpc = RpcClient(self.host, self.port, timeout_s)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def call(self, method: str, **params: Any) -> Any:
        """One request within `timeout_s`: waits while every connection slot is mid-request, and
        sends again when the daemon closed the connection under the request (a newcomer took the
        slot of a connection that looked idle, an idle timeout, a restart)."""
        deadline = time.monotonic() + self.timeout_s
        pause = 0.01
        while True:
            try:
                left = max(0.05, deadline - time.monotonic())  # every try within the one timeout
                return self._rpc.call(method, timeout_s=left, token=self.token, **params)
            except RpcError as exc:
                if exc.remote_type != "ConnectionLimit" or time.monotonic() > deadline:
                    raise
            except WireError as exc:
                # Timed out: the daemon is slow, not gone, and a retry would only double the wait.
                # Unreachable: nothing listens. Garbled: not a daemon speaking this protocol.
                if exc.timed_out or exc.unreachable or exc.garbled or time.monotonic() > deadline:
                    raise
                logger.debug("retrying %s after a connection error: %s", method, exc)
            time.sleep(pause)
            pause = min(2 * pause, 0.2)

    def hello(self) -> dict[str, Any]:
        return self.call("hello")

    def register(self, name: str, engine: dict[str, Any]) -> dict[str, Any]:
        return self.call("register", name=name, engine=engine)

    def leave(self, name: str) -> dict[str, Any]:
        return self.call("leave", name=name)

    def heartbeat(self, name: str) -> dict[str, Any]:
        return self.call("heartbeat", name=name)

    def members(self) -> dict[str, Any]:
        return self.call("members")

    def status(self) -> dict[str, Any]:
        return self.call("status")

    def begin_sync(self, version: int) -> dict[str, Any]:
        return self.call("begin_sync", version=version)

    def report_sync(self, outcome: dict[str, Any]) -> dict[str, Any]:
        return self.call("report_sync", outcome=outcome)

    def shutdown(self) -> dict[str, Any]:
        return self.call("shutdown")

    def close(self) -> None:
        self._rpc.close()


class HeartbeatSender:
    """Background heartbeats for one engine (for launchers of engines that cannot send their own).

    Given the engine's descriptor (`engine`), it also registers the engine again whenever the
    daemon does not know it: a `ckpt-engine serve` restarted on the same address and token gets
    its engines back within one `interval_s` of coming up, and drops are healed alike."""

    def __init__(self, client: DaemonClient, name: str, interval_s: float, engine: dict[str, Any] | None = None) -> None:
        self.client, self.name, self.interval_s, self.engine = client, name, interval_s, engine
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"ckpt-heartbeat-{name}", daemon=True)
        self.registrations = 0
        """How many times it registered the engine again."""

    def start(self) -> HeartbeatSender:
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.client.heartbeat(self.name)
            except RpcError as exc:
                if self.engine is not None and exc.remote_type == "ValueError" and "is not registered" in exc.remote_message:
                    self._register()
                else:
                    logger.warning("heartbeat for %s failed: %s", self.name, exc)
            except Exception as exc:
                logger.warning("heartbeat for %s failed: %s", self.name, exc)

    def _register(self) -> None:
        assert self.engine is not None
        try:
            self.client.register(self.name, dict(self.engine))
            self.registrations += 1
            logger.info("engine %s registered again with the daemon at %s", self.name, self.client.address)
        except Exception as exc:
            logger.warning("registering %s again failed: %s", self.name, exc)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.interval_s + self.client.timeout_s)
