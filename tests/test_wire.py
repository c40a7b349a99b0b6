"""The msgpack RPC used to reach receivers: garbage and hostile frames are refused, server lives on."""

from __future__ import annotations

import socket
import struct

import msgpack
import pytest

from ckpt_engine.control.server import ControlLimits, RpcServer
from ckpt_engine.control.wire import RpcClient, RpcError, WireError, recv_frame, send_frame

TOKEN = "wire-test-token"


@pytest.fixture()
def server():
    srv = RpcServer({"add": lambda a, b: a + b, "boom": lambda: 1 / 0}, token=TOKEN, limits=ControlLimits(idle_timeout_s=5)).start()
    yield srv
    srv.close()


def _raw(server: RpcServer, payload: bytes) -> socket.socket:
    sock = socket.create_connection((server.host, server.port), timeout=5)
    sock.sendall(payload)
    return sock


def test_calls_and_remote_errors(server: RpcServer) -> None:
    client = RpcClient(server.host, server.port, timeout_s=5, token=TOKEN)
    assert client.call("add", a=2, b=3) == 5
    with pytest.raises(RpcError, match="boom: ZeroDivisionError"):
        client.call("boom")
    with pytest.raises(RpcError, match="unknown method 'nope'; known: add, boom"):
        client.call("nope")
    with pytest.raises(RpcError, match="TypeError"):
        client.call("add", a=1)
    client.close()


def test_hostile_frames_are_refused_and_server_keeps_serving(server: RpcServer) -> None:
    # Not a request map: an error reply.
    with _raw(server, b"") as sock:
        send_frame(sock, [1, 2, 3])
        assert recv_frame(sock)["error"]["type"] == "ProtocolError"
    # Garbled msgpack, an extension type, an oversized header: an error reply, then the connection is closed.
    for payload in (
        struct.pack("!I", 4) + b"\xc1\xc1\xc1\xc1",
        struct.pack("!I", 4) + msgpack.packb(msgpack.ExtType(5, b"xy")),
        struct.pack("!I", 0xFFFFFFFF),
    ):
        with _raw(server, payload) as sock:
            assert recv_frame(sock)["error"]["type"] == "ProtocolError"
            with pytest.raises((WireError, OSError)):
                recv_frame(sock)
    client = RpcClient(server.host, server.port, timeout_s=5, token=TOKEN)
    assert client.call("add", a=1, b=1) == 2


def test_client_times_out_instead_of_hanging() -> None:
    silent = socket.create_server(("127.0.0.1", 0))
    try:
        client = RpcClient("127.0.0.1", silent.getsockname()[1], timeout_s=0.5)
        with pytest.raises(WireError, match="no reply .* within 0.5s"):
            client.call("add", a=1, b=2)
    finally:
        silent.close()
