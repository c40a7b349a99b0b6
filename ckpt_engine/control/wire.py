"""Control messages: length-prefixed msgpack over TCP, request/response, every read bounded.

Requests are `{"id": int, "method": str, "params": map}`; replies `{"id": int, "ok": bool,
"result"|"error": ...}`. Frames are size-checked before they are read and decoded without
extension types: a garbled or hostile peer gets an error reply or a closed socket, never code
execution. The server side (token, caps, deadlines) is `control/server.py`.
"""

from __future__ import annotations

import itertools
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import msgpack

from ckpt_engine.readable import readable

__all__ = ["MAX_FRAME_BYTES", "AuthError", "RpcClient", "RpcError", "WireError", "recv_frame", "send_frame"]

MAX_FRAME_BYTES = 512 * 1024 * 1024
"""Largest reply a client accepts (a reference receiver's `get_tensor` may carry a large tensor)."""
_HEADER = struct.Struct("!I")


class WireError(ConnectionError):
    """The peer closed, timed out, sent a frame that is not a valid message (`garbled`), or could
    not be reached at all (`unreachable`: nothing listens, so a retry cannot help)."""

    def __init__(self, message: str, *, garbled: bool = False, timed_out: bool = False, unreachable: bool = False) -> None:
        super().__init__(message)
        self.garbled, self.timed_out, self.unreachable = garbled, timed_out, unreachable


class RpcError(RuntimeError):
    """The remote method raised; `remote_type` is its exception class name."""

    def __init__(self, method: str, remote_type: str, message: str) -> None:
        super().__init__(f"{method}: {remote_type}: {message}")
        self.method, self.remote_type, self.remote_message = method, remote_type, message


class AuthError(RpcError):
    """The remote refused the call's job token (another job's, or none): a control port serves one job."""


def send_frame(sock: socket.socket, obj: Any) -> None:
    data = msgpack.packb(obj, use_bin_type=True)
    if len(data) > MAX_FRAME_BYTES:
        raise WireError(f"message of {len(data)} bytes exceeds the {MAX_FRAME_BYTES}-byte frame limit")
    sock.sendall(_HEADER.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int, deadline: float | None) -> bytes:
    chunks, got = [], 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WireError("frame not complete before its deadline", timed_out=True)
            sock.settimeout(left)
        try:
            chunk = sock.recv(min(n - got, 1 << 20))
        except socket.timeout:
            if deadline is None:
                raise
            raise WireError("frame not complete before its deadline", timed_out=True) from None
        if not chunk:
            raise WireError("peer closed the connection")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def recv_frame(
    sock: socket.socket,
    *,
    max_bytes: int = MAX_FRAME_BYTES,
    first_byte_by: float | None = None,
    frame_timeout_s: float | None = None,
    frame_by: float | None = None,
    on_first_byte: Callable[[], None] | None = None,
) -> Any:
    """One message. Deadlines are `time.monotonic()` values: the first byte must arrive by
    `first_byte_by`; the whole frame by `frame_by` and within `frame_timeout_s` of its first byte
    (whichever is earlier). Without them the socket's own timeout bounds each read."""
    first = _recv_exact(sock, 1, first_byte_by)
    if on_first_byte is not None:
        on_first_byte()
    deadline = frame_by
    if frame_timeout_s is not None:
        by = time.monotonic() + frame_timeout_s
        deadline = by if deadline is None else min(deadline, by)
    (n,) = _HEADER.unpack(first + _recv_exact(sock, _HEADER.size - 1, deadline))
    if n > max_bytes:
        raise WireError(f"peer announced a {n}-byte frame, over the {max_bytes}-byte limit", garbled=True)
    body = _recv_exact(sock, n, deadline)
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=True, max_ext_len=0)
    except Exception as exc:  # msgpack raises several types for garbage; none may escape
        raise WireError(f"garbled message: {type(exc).__name__}: {exc}", garbled=True) from None


class RpcClient:
    """One connection, one call at a time (a lock serializes callers); every call has a timeout.

    With `token`, every request carries it as `params.token` (control ports refuse requests
    without the job token)."""

    def __init__(self, host: str, port: int, timeout_s: float, token: str | None = None) -> None:
        self.host, self.port, self.timeout_s = host, port, timeout_s
        self.token = token
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._sock: socket.socket | None = None

    def _connect(self, timeout_s: float) -> socket.socket:
        if self._sock is not None and _closed_by_peer(self._sock):
            self.close_locked()  # the server cut an idle connection; start a fresh one
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
            except OSError as exc:
                timed_out = isinstance(exc, socket.timeout)
                raise WireError(f"{method}: cannot connect to {self.host}:{self.port}: {exc}", timed_out=timed_out, unreachable=not timed_out) from exc
            try:
                sock.settimeout(timeout)
                req_id = next(self._ids)
                if self.token is not None:
                    params.setdefault("token", self.token)
                send_frame(sock, {"id": req_id, "method": method, "params": params})
                deadline = time.monotonic() + timeout
                reply = recv_frame(sock, first_byte_by=deadline, frame_by=deadline)
            except (OSError, WireError) as exc:
                self.close_locked()
                if isinstance(exc, socket.timeout) or getattr(exc, "timed_out", False):
                    raise WireError(f"{method}: no reply from {self.host}:{self.port} within {timeout}s", timed_out=True) from exc
                raise WireError(f"{method}: {self.host}:{self.port}: {exc}") from exc
        finally:
            self._lock.release()
        if not isinstance(reply, dict) or reply.get("id") != req_id or not isinstance(reply.get("ok"), bool):
            raise WireError(f"{method}: malformed reply from {self.host}:{self.port}")
        if not reply["ok"]:
            err = reply.get("error")
            if not isinstance(err, dict):
                err = {}
            kind = str(err.get("type", "Error"))
            raise (AuthError if kind == AuthError.__name__ else RpcError)(method, kind, str(err.get("message", "")))
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


def _closed_by_peer(sock: socket.socket) -> bool:
    """True when the peer has closed (or reset) an idle connection: a zero-wait peek sees EOF."""
    try:
        return readable(sock) and sock.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):
        return True
