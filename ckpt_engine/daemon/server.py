"""The daemon's control server: the protocol of `ckpt_engine.daemon.protocol` over TCP.

Frames are read with a size cap far below `ckpt_engine.wire`'s (control messages are small), an
idle timeout (a peer stuck mid-frame cannot pin a thread forever) and a cap on concurrent
connections. Every request is checked for the job token and its params before a handler runs;
any failure becomes an error reply (or, for a garbled frame, a closed connection) and the server
keeps serving everyone else.
"""

from __future__ import annotations

import hmac
import logging
import socket
import struct
import threading
from typing import TYPE_CHECKING, Any

import msgpack

from ckpt_engine.daemon.protocol import PROTOCOL_VERSION, AuthError, ProtocolError, check_params
from ckpt_engine.wire import WireError, send_frame

if TYPE_CHECKING:
    from ckpt_engine.daemon.coordinator import WeightSyncDaemon

__all__ = ["DaemonServer"]

logger = logging.getLogger(__name__)

_HEADER = struct.Struct("!I")


class _Refused(Exception):
    """The frame cannot be read; reply (when possible) and close the connection."""


class DaemonServer:
    """Serves one WeightSyncDaemon's control methods; one thread per connection."""

    def __init__(self, daemon: WeightSyncDaemon, host: str = "127.0.0.1", port: int = 0) -> None:
        self.daemon = daemon
        cfg = daemon.daemon_config
        self.max_frame_bytes = cfg.max_frame_bytes
        self.idle_timeout_s = cfg.idle_timeout_s
        self._slots = threading.BoundedSemaphore(cfg.max_connections)
        self._sock = socket.create_server((host, port))
        self.host, self.port = self._sock.getsockname()[:2]
        self.stopped = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name="ckpt-daemon-accept", daemon=True)
        self.refused = 0
        """Requests refused (bad token, bad params, garbled frames); for status and tests."""

    def start(self) -> DaemonServer:
        self._thread.start()
        logger.info("weight-sync daemon serving on %s:%d", self.host, self.port)
        return self

    def close(self) -> None:
        self.stopped.set()
        try:
            self._sock.close()
        except OSError:
            pass

    def _accept_loop(self) -> None:
        while not self.stopped.is_set():
            try:
                conn, peer = self._sock.accept()
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                logger.warning("refusing control connection from %s: %d connections open", peer, self.daemon.daemon_config.max_connections)
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), name="ckpt-daemon-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            with conn:
                conn.settimeout(self.idle_timeout_s)
                while not self.stopped.is_set():
                    try:
                        req = self._recv(conn)
                    except _Refused as exc:
                        self.refused += 1
                        logger.warning("control connection closed: %s", exc)
                        _try_send(conn, _error(-1, "ProtocolError", str(exc)))
                        return
                    except (OSError, WireError):
                        return  # closed, reset or idle
                    reply = self._dispatch(req)
                    if not reply["ok"]:
                        self.refused += 1
                    if not _try_send(conn, reply):
                        return
        finally:
            self._slots.release()

    def _recv(self, conn: socket.socket) -> Any:
        header = _recv_exact(conn, _HEADER.size)
        (n,) = _HEADER.unpack(header)
        if n > self.max_frame_bytes:
            raise _Refused(f"peer announced a {n}-byte control frame; the limit is {self.max_frame_bytes}")
        body = _recv_exact(conn, n)
        try:
            return msgpack.unpackb(body, raw=False, strict_map_key=True, max_ext_len=0)
        except Exception as exc:  # msgpack raises several types for garbage; none may escape
            raise _Refused(f"garbled control message: {type(exc).__name__}: {exc}") from None

    def _dispatch(self, req: Any) -> dict[str, Any]:
        if not isinstance(req, dict) or set(req) != {"id", "method", "params"} or not isinstance(req.get("id"), int) or isinstance(req.get("id"), bool):
            return _error(-1, "ProtocolError", "a request is a map of exactly id (int), method (str), params (map)")
        rid = req["id"]
        params = req["params"]
        try:
            if not isinstance(params, dict):
                raise ProtocolError("params must be a map")
            self._check_token(params.get("token"))
            args = check_params(req["method"], params)
            return {"id": rid, "ok": True, "result": self._handle(req["method"], args)}
        except (ProtocolError, AuthError) as exc:
            logger.info("refused %s request: %s", str(req.get("method"))[:40], exc)
            return _error(rid, type(exc).__name__, str(exc))
        except Exception as exc:
            logger.debug("control method %s failed", req["method"], exc_info=True)
            return _error(rid, type(exc).__name__, str(exc)[:2000])

    def _check_token(self, token: Any) -> None:
        if not isinstance(token, str) or not token:
            raise AuthError("every request must carry the job token (params.token)")
        if not hmac.compare_digest(token.encode("utf-8", "replace"), self.daemon.token.encode()):
            raise AuthError("wrong job token: this daemon serves another job")

    def _handle(self, method: str, args: dict[str, Any]) -> Any:
        d = self.daemon
        if method == "hello":
            return {"protocol": PROTOCOL_VERSION, "role": d.role, "version": d.version, "epoch": d.membership.epoch}
        if method == "register":
            return d.register(args["name"], args["engine"])
        if method == "leave":
            return {"left": d.leave(args["name"])}
        if method == "heartbeat":
            return d.heartbeat(args["name"])
        if method == "members":
            return d.members()
        if method == "status":
            status = d.status()
            status["refused_requests"] = self.refused
            return status
        if method == "report_sync":
            return d.record_sync(args["outcome"])
        if method == "shutdown":
            threading.Timer(0.05, self.close).start()  # reply first, then stop
            return {}
        raise AssertionError(f"method {method} passed check_params but has no handler")


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = conn.recv(min(n - got, 1 << 20))
        if not chunk:
            raise WireError("peer closed the connection")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _error(rid: int, typ: str, message: str) -> dict[str, Any]:
    return {"id": rid, "ok": False, "error": {"type": typ, "message": message}}


def _try_send(conn: socket.socket, reply: dict[str, Any]) -> bool:
    try:
        send_frame(conn, reply)
        return True
    except (OSError, WireError, TypeError, ValueError) as exc:
        logger.debug("could not send a control reply: %s", exc)
        return False
