"""Control messages: length-prefixed msgpack over TCP, request/response, every read bounded.

Used between the sync controller and out-of-process receivers (and the daemon). Requests are
`{"id": int, "method": str, "params": map}`; replies `{"id": int, "ok": bool, "result"|"error": ...}`.
Frames are size-checked before they are read and decoded without extension types: a garbled or
hostile peer gets an error reply or a closed socket, never code execution.
"""

from __future__ import annotations

import itertools
import logging
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

import msgpack

__all__ = ["RpcClient", "RpcError", "RpcServer", "WireError", "recv_frame", "send_frame"]

logger = logging.getLogger(__name__)

MAX_FRAME_BYTES = 512 * 1024 * 1024
_HEADER = struct.Struct("!I")


class WireError(ConnectionError):
    """The peer closed, timed out, or sent a frame that is not a valid message."""


class RpcError(RuntimeError):
    """The remote method raised; `remote_type` is its exception class name."""

    def __init__(self, method: str, remote_type: str, message: str) -> None:
        super().__init__(f"{method}: {remote_type}: {message}")
        self.method, self.remote_type, self.remote_message = method, remote_type, message


def send_frame(sock: socket.socket, obj: Any) -> None:
    data = msgpack.packb(obj, use_bin_type=True)
    if len(data) > MAX_FRAME_BYTES:
        raise WireError(f"message of {len(data)} bytes exceeds the {MAX_FRAME_BYTES}-byte frame limit")
    sock.sendall(_HEADER.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            raise WireError("peer closed the connection")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def recv_frame(sock: socket.socket) -> Any:
    (n,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if n > MAX_FRAME_BYTES:
        raise WireError(f"peer announced a {n}-byte frame, over the {MAX_FRAME_BYTES}-byte limit")
    try:
        return msgpack.unpackb(_recv_exact(sock, n), raw=False, strict_map_key=True, max_ext_len=0)
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError, TypeError) as exc:
        raise WireError(f"garbled message: {exc}") from None


class RpcServer:
    """Serves `handlers[method](**params)` to any number of clients, one thread per connection."""

    def __init__(
        self, handlers: dict[str, Callable[..., Any]], host: str = "127.0.0.1", port: int = 0, idle_timeout_s: float = 3600.0
    ) -> None:
        self.handlers = handlers
        self.idle_timeout_s = idle_timeout_s
        self._sock = socket.create_server((host, port))
        self.host, self.port = self._sock.getsockname()[:2]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name="ckpt-rpc-accept", daemon=True)

    def start(self) -> RpcServer:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        try:
            self._sock.close()
        except OSError:
            pass

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="ckpt-rpc-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(self.idle_timeout_s)  # a silent or half-sent client cannot pin this thread forever
        with conn:
            while not self._stop.is_set():
                try:
                    req = recv_frame(conn)
                except (WireError, OSError):
                    return
                reply = self._dispatch(req)
                try:
                    send_frame(conn, reply)
                except (WireError, OSError):
                    return

    def _dispatch(self, req: Any) -> dict[str, Any]:
        if (
            not isinstance(req, dict)
            or set(req) != {"id", "method", "params"}
            or not isinstance(req["id"], int)
            or not isinstance(req["method"], str)
            or not isinstance(req["params"], dict)
        ):
            return {"id": -1, "ok": False, "error": {"type": "ProtocolError", "message": "request must be {id, method, params}"}}
        handler = self.handlers.get(req["method"])
        if handler is None:
            msg = f"unknown method {req['method']!r}; known: {', '.join(sorted(self.handlers))}"
            return {"id": req["id"], "ok": False, "error": {"type": "ProtocolError", "message": msg}}
        try:
            return {"id": req["id"], "ok": True, "result": handler(**req["params"])}
        except Exception as exc:
            logger.debug("rpc %s failed", req["method"], exc_info=True)
            return {"id": req["id"], "ok": False, "error": {"type": type(exc).__name__, "message": str(exc)}}


class RpcClient:
    """One connection, one call at a time (a lock serializes callers); every call has a timeout."""

    def __init__(self, host: str, port: int, timeout_s: float) -> None:
        self.host, self.port, self.timeout_s = host, port, timeout_s
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._sock: socket.socket | None = None

    def _connect(self, timeout_s: float) -> socket.socket:
        if self._sock is None:
            self._sock = socket.create_connection((self.host, self.port), timeout=timeout_s)
        return self._sock

    def call(self, method: str, timeout_s: float | None = None, **params: Any) -> Any:
        timeout = timeout_s if timeout_s is not None else self.timeout_s
        if not self._lock.acquire(timeout=timeout):
            raise WireError(f"{method}: {self.host}:{self.port} is busy with another call for more than {timeout}s")
        try:
            try:
                sock = self._connect(timeout)
                sock.settimeout(timeout)
                req_id = next(self._ids)
                send_frame(sock, {"id": req_id, "method": method, "params": params})
                reply = recv_frame(sock)
            except (OSError, WireError) as exc:
                self.close_locked()
                if isinstance(exc, socket.timeout):
                    raise WireError(f"{method}: no reply from {self.host}:{self.port} within {timeout}s") from exc
                raise WireError(f"{method}: {self.host}:{self.port}: {exc}") from exc
        finally:
            self._lock.release()
        if not isinstance(reply, dict) or reply.get("id") != req_id or not isinstance(reply.get("ok"), bool):
            raise WireError(f"{method}: malformed reply from {self.host}:{self.port}")
        if not reply["ok"]:
            err = reply.get("error") if isinstance(reply.get("error"), dict) else {}
            raise RpcError(method, str(err.get("type", "Error")), str(err.get("message", "")))
        return reply.get("result")

    def close_locked(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None

    def close(self) -> None:
        with self._lock:
            self.close_locked()
