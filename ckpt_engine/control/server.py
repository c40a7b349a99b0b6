"""The one control server every port of the project opens (the daemon's, each reference receiver's).

A control port is reachable by any local process, so it is written for a hostile peer:

- **Authentication first.** Every request carries the job token (`params.token`, compared in
  constant time); a connection must deliver its first request with the right token within
  `handshake_timeout_s` of being accepted (a wrong one may be retried inside it), or it is cut.
- **Two connection pools.** Unauthenticated connections have their own cap, the oldest cut to
  admit a newcomer, so idle strangers cannot keep a client from its handshake. At the cap of
  authenticated ones a newcomer closes the longest-idle (clients reconnect), so a job with more
  clients than the cap never locks itself out; only when every slot is mid-request is it refused.
- **Bounded frames.** A frame larger than `max_frame_bytes` is refused from its header; once its
  first byte arrives the whole frame must arrive within `frame_timeout_s` (trickled bytes do not
  reset the clock). Between frames an authenticated connection may idle for `idle_timeout_s`.
"""

from __future__ import annotations

import hmac
import itertools
import logging
import math
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Self

from ckpt_engine.control.wire import AuthError, WireError, recv_frame, send_frame
from ckpt_engine.readable import readable

__all__ = ["ControlLimits", "ControlServer", "Handler", "ProtocolError", "RpcServer"]

logger = logging.getLogger(__name__)

Handler = Callable[[str, dict[str, Any]], Any]
"""(method, params without the token) -> result; an exception becomes an error reply."""


class ProtocolError(ValueError):
    """A control message does not follow the protocol; the message names the offending field."""


@dataclass(frozen=True, kw_only=True)
class ControlLimits:
    """Limits of one control port; the daemon's come from `daemon:` in the job YAML."""

    max_connections: int = 64
    """Authenticated connections; at the cap the longest-idle one is closed for a newcomer."""
    max_unauthenticated: int = 64
    """Connections still in their handshake; at the cap the oldest is cut for a newcomer."""
    handshake_timeout_s: float = 5.0
    """A new connection must deliver its first request with the right token within this."""
    frame_timeout_s: float = 30.0
    """A frame whose first byte arrived must be complete within this (not reset by trickled bytes)."""
    idle_timeout_s: float = 300.0
    """An authenticated connection silent this long between frames is closed."""
    max_frame_bytes: int = 16 * 1024 * 1024
    """Largest request accepted; larger announced frames are refused from the header."""

    def __post_init__(self) -> None:
        for name in ("max_connections", "max_unauthenticated"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name in ("handshake_timeout_s", "frame_timeout_s", "idle_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")
        if isinstance(self.max_frame_bytes, bool) or not isinstance(self.max_frame_bytes, int) or self.max_frame_bytes < 1024:
            raise ValueError(f"max_frame_bytes must be an int >= 1024, got {self.max_frame_bytes!r}")


class _Conn:
    def __init__(self, sock: socket.socket, peer: Any) -> None:
        self.sock, self.peer = sock, peer
        self.accepted = time.monotonic()
        self.last_active = self.accepted
        self.busy = False
        self.authenticated = False

    def cut(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class ControlServer:
    """Serves `handle(method, params)` to token holders; one thread per connection, bounded everywhere."""

    def __init__(
        self, handle: Handler, *, token: str, limits: ControlLimits | None = None, host: str = "127.0.0.1", port: int = 0, name: str = "control"
    ) -> None:
        if not isinstance(token, str) or len(token) < 8:
            raise ValueError("a control server needs the job token: a string of at least 8 characters")
        self.handle = handle
        self.limits = limits if limits is not None else ControlLimits()
        self.name = name
        self._token = token.encode()
        try:
            self._sock = socket.create_server((host, port))
        except OverflowError:
            raise ValueError(f"port must be in [0, 65535], got {port}") from None
        except OSError as exc:
            raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
        self.host, self.port = self._sock.getsockname()[:2]
        self.stopped = threading.Event()
        self._lock = threading.Lock()
        self._pending: dict[int, _Conn] = {}
        self._authed: dict[int, _Conn] = {}
        self._ids = itertools.count()
        self._warned_at = -1e9
        self._thread = threading.Thread(target=self._accept_loop, name=f"ckpt-{name}-accept", daemon=True)
        self.refused = 0
        """Requests refused (bad token, bad params, garbled frames) and connections cut."""

    def start(self) -> Self:
        self._thread.start()
        logger.info("%s server on %s:%d", self.name, self.host, self.port)
        return self

    def close(self) -> None:
        self.stopped.set()
        try:
            self._sock.close()
        except OSError:
            pass
        with self._lock:
            conns = list(self._pending.values()) + list(self._authed.values())
        for c in conns:
            c.cut()

    def connections(self) -> dict[str, int]:
        with self._lock:
            return {"authenticated": len(self._authed), "unauthenticated": len(self._pending)}

    # --- connections --------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self.stopped.is_set():
            try:
                sock, peer = self._sock.accept()
            except OSError:
                return
            conn = _Conn(sock, peer)
            cid = next(self._ids)
            with self._lock:
                if len(self._pending) >= self.limits.max_unauthenticated:
                    oldest = min(self._pending, key=lambda k: self._pending[k].accepted)
                    victim = self._pending.pop(oldest)
                    self.refused += 1
                    now = time.monotonic()
                    if now - self._warned_at > 10.0:  # a flood would otherwise flood the log too
                        self._warned_at = now
                        logger.warning("%s: %d connections without a token; cutting the oldest (%s)", self.name, len(self._pending) + 1, victim.peer)
                    victim.cut()
                self._pending[cid] = conn
            threading.Thread(target=self._serve, args=(cid, conn), name=f"ckpt-{self.name}-conn", daemon=True).start()

    def _admit(self, cid: int, conn: _Conn) -> bool:
        """Move a connection that just proved the token into the authenticated pool."""
        with self._lock:
            if self._pending.pop(cid, None) is None:
                return False  # cut as the oldest stranger meanwhile
            if len(self._authed) >= self.limits.max_connections:
                idle = [k for k, c in self._authed.items() if not c.busy and not _has_bytes_waiting(c.sock)]
                if not idle:
                    return False
                victim = self._authed.pop(min(idle, key=lambda k: self._authed[k].last_active))
                logger.info("%s: %d authenticated connections; closing the longest idle", self.name, self.limits.max_connections)
                victim.cut()
            conn.authenticated = True
            self._authed[cid] = conn
            return True

    def _serve(self, cid: int, conn: _Conn) -> None:
        lim = self.limits
        try:
            with conn.sock:
                while not self.stopped.is_set():
                    if conn.authenticated:
                        first_byte_by = time.monotonic() + lim.idle_timeout_s
                        frame_by = None
                    else:
                        first_byte_by = frame_by = conn.accepted + lim.handshake_timeout_s
                    try:
                        req = recv_frame(conn.sock, max_bytes=lim.max_frame_bytes, first_byte_by=first_byte_by,
                                         frame_timeout_s=lim.frame_timeout_s, frame_by=frame_by, on_first_byte=lambda: _mark_busy(conn))
                    except WireError as exc:
                        if exc.garbled:
                            self.refused += 1
                            logger.warning("%s: connection from %s closed: %s", self.name, conn.peer, exc)
                            _try_send(conn.sock, _error(-1, "ProtocolError", str(exc)))
                        elif not conn.authenticated and not self.stopped.is_set():
                            self.refused += 1
                        return
                    except OSError:
                        return
                    reply = self._dispatch(cid, conn, req)
                    if not reply["ok"]:
                        self.refused += 1
                    conn.sock.settimeout(lim.frame_timeout_s)
                    at_cap = not reply["ok"] and reply["error"]["type"] == "ConnectionLimit"
                    sent = _try_send(conn.sock, reply)
                    conn.busy, conn.last_active = False, time.monotonic()  # only now may a newcomer close it
                    if not sent or at_cap:
                        return
        finally:
            with self._lock:
                self._pending.pop(cid, None)
                self._authed.pop(cid, None)

    # --- requests -----------------------------------------------------------------------------
    def _dispatch(self, cid: int, conn: _Conn, req: Any) -> dict[str, Any]:
        if (
            not isinstance(req, dict) or set(req) != {"id", "method", "params"}
            or not isinstance(req["id"], int) or isinstance(req["id"], bool) or not isinstance(req["method"], str)
        ):
            return _error(-1, "ProtocolError", "a request is a map of exactly id (int), method (str), params (map)")
        rid, method, params = req["id"], req["method"], req["params"]
        if not isinstance(params, dict):
            return _error(rid, "ProtocolError", "params must be a map")
        token = params.pop("token", None)
        if not isinstance(token, str) or not token:
            return _error(rid, AuthError.__name__, "every request must carry the job token (params.token)")
        if not hmac.compare_digest(token.encode("utf-8", "replace"), self._token):
            return _error(rid, AuthError.__name__, "wrong job token: this port serves another job")
        if not conn.authenticated and not self._admit(cid, conn):
            return _error(rid, "ConnectionLimit", f"all {self.limits.max_connections} control connections are mid-request; retry")
        try:
            return {"id": rid, "ok": True, "result": self.handle(method, params)}
        except Exception as exc:
            logger.debug("%s: method %.40s failed", self.name, method, exc_info=True)
            return _error(rid, type(exc).__name__, str(exc)[:4000])


def _mark_busy(conn: _Conn) -> None:
    conn.busy = True


def _has_bytes_waiting(sock: socket.socket) -> bool:
    """A request already on its way counts as busy: closing that connection would drop it."""
    try:
        return readable(sock)
    except (OSError, ValueError):
        return False


def _error(rid: int, typ: str, message: str) -> dict[str, Any]:
    return {"id": rid, "ok": False, "error": {"type": typ, "message": message}}


def _try_send(sock: socket.socket, reply: dict[str, Any]) -> bool:
    try:
        send_frame(sock, reply)
        return True
    except (OSError, WireError, TypeError, ValueError) as exc:
        logger.debug("could not send a control reply: %s", exc)
        return False


class RpcServer(ControlServer):
    """A control server over a table of methods (the reference receiver's port): `handlers[method](**params)`,
    an unknown method refused by name."""

    def __init__(
        self, handlers: dict[str, Callable[..., Any]], *, token: str, limits: ControlLimits | None = None, host: str = "127.0.0.1", port: int = 0
    ) -> None:
        self.handlers = handlers
        super().__init__(self._call, token=token, limits=limits, host=host, port=port, name="rpc")

    def _call(self, method: str, params: dict[str, Any]) -> Any:
        fn = self.handlers.get(method)
        if fn is None:
            raise ProtocolError(f"unknown method {method[:60]!r}; known: {', '.join(sorted(self.handlers))}")
        return fn(**params)
