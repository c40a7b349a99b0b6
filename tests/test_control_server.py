"""The one control server behind every port (daemon, reference receiver) against hostile peers.

Real servers, real sockets (issue 10, items 4 and 5): idle strangers cannot lock out a token
holder, trickled bytes do not keep a frame alive, a job with more clients than the cap keeps
working, and a reference receiver's port demands the job token it was started with.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Iterator

import msgpack
import pytest
import torch

from ckpt_engine.control.server import ControlLimits, ControlServer, RpcServer
from ckpt_engine.daemon import DaemonClient, DaemonConfig, WeightSyncDaemon
from ckpt_engine.daemon.server import DaemonServer
from ckpt_engine.rollout_adapters.torch_ref import TorchRefRollout, write_spec_file
from ckpt_engine.sources.base import StateDictSource
from ckpt_engine.control.wire import AuthError, RpcClient, WireError, recv_frame

pytestmark = pytest.mark.timeout(120)

TOKEN = "control-server-test-token"


def frame(obj: object) -> bytes:
    data = msgpack.packb(obj, use_bin_type=True)
    return struct.pack("!I", len(data)) + data


def cut_within(sock: socket.socket, seconds: float, trickle: bytes = b"") -> float:
    """Seconds until the server closes `sock`, sending `trickle` one byte every 0.2 s meanwhile.
    Any answer fails: a trickled frame the deadline let through is answered, however slow the box."""
    t0 = time.monotonic()
    sock.settimeout(0.2)
    for i in range(int(seconds / 0.2) + 1):
        try:
            data = sock.recv(1 << 16)
            if data == b"":
                return time.monotonic() - t0
            pytest.fail(f"the server answered a trickled frame instead of cutting it at its deadline: {data[:80]!r}")
        except socket.timeout:
            pass
        except OSError:
            return time.monotonic() - t0
        if trickle:
            try:
                sock.sendall(trickle[i % len(trickle): i % len(trickle) + 1])
            except OSError:
                return time.monotonic() - t0
    pytest.fail(f"the server did not cut the connection within {seconds}s")


CUT_WITHIN_S = 30.0
"""A cut expected from the 1 s handshake or frame deadline must come before this: a liveness bound
~30x what the cut takes (~1 s), far from any other way the connection could end: the daemon's idle
timeout (`IDLE_TIMEOUT_S`) is 20x longer still, and a deadline that each trickled byte reset would
never cut (`cut_within` fails at its bound) or let the frame through (it is answered: fails at once)."""

IDLE_TIMEOUT_S = 600.0
"""The fixture daemon's idle timeout between frames: never reached within a test (pytest's 120 s)."""


@pytest.fixture
def daemon() -> Iterator[WeightSyncDaemon]:
    d = WeightSyncDaemon(
        None,
        DaemonConfig(heartbeat_timeout_s=0, handshake_timeout_s=1.0, frame_timeout_s=1.0, idle_timeout_s=IDLE_TIMEOUT_S, max_connections=4, max_unauthenticated=16),
        token=TOKEN,
        role="standalone",
    )
    d.serve()
    yield d
    d.close()


def test_one_server_class_behind_every_port() -> None:
    assert issubclass(DaemonServer, ControlServer) and issubclass(RpcServer, ControlServer)


def test_idle_strangers_cannot_lock_out_a_token_holder(daemon: WeightSyncDaemon) -> None:
    assert daemon.server is not None
    idle = [socket.create_connection((daemon.server.host, daemon.server.port), timeout=5) for _ in range(100)]  # > every cap
    try:
        client = DaemonClient(daemon.address, TOKEN, timeout_s=5)
        status = client.status()
        assert status["role"] == "standalone" and status["connections"]["unauthenticated"] <= 16
        client.close()
    finally:
        for s in idle:
            s.close()


def test_a_connection_must_show_the_token_within_the_handshake_deadline(daemon: WeightSyncDaemon) -> None:
    assert daemon.server is not None
    with socket.create_connection((daemon.server.host, daemon.server.port), timeout=5) as silent:
        assert cut_within(silent, CUT_WITHIN_S + 5) < CUT_WITHIN_S
    # Trickling one byte at a time does not keep a connection that never authenticates alive.
    with socket.create_connection((daemon.server.host, daemon.server.port), timeout=5) as trickler:
        assert cut_within(trickler, CUT_WITHIN_S + 5, trickle=frame({"id": 1, "method": "hello", "params": {"token": TOKEN}})) < CUT_WITHIN_S


def test_a_frame_has_a_total_deadline_that_trickled_bytes_do_not_reset(daemon: WeightSyncDaemon) -> None:
    assert daemon.server is not None
    with socket.create_connection((daemon.server.host, daemon.server.port), timeout=5) as s:
        s.sendall(frame({"id": 1, "method": "hello", "params": {"token": TOKEN}}))
        header = s.recv(4, socket.MSG_WAITALL)
        s.recv(struct.unpack("!I", header)[0], socket.MSG_WAITALL)  # authenticated now
        big = frame({"id": 2, "method": "status", "params": {"token": TOKEN, "pad": "x" * 200}})
        assert cut_within(s, CUT_WITHIN_S + 5, trickle=big) < CUT_WITHIN_S


def test_a_job_with_more_clients_than_the_cap_keeps_working(daemon: WeightSyncDaemon) -> None:
    clients = [DaemonClient(daemon.address, TOKEN, timeout_s=5) for _ in range(10)]  # the cap is 4
    try:
        for _ in range(3):
            for c in clients:
                assert c.hello()["role"] == "standalone"
        errors: list[BaseException] = []

        def hammer(c: DaemonClient) -> None:
            try:
                for _ in range(5):
                    c.status()
            except BaseException as exc:  # noqa: BLE001 - collected and asserted below
                errors.append(exc)

        threads = [threading.Thread(target=hammer, args=(c,)) for c in clients]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors, errors  # a client that finds every slot mid-request waits for one
    finally:
        for c in clients:
            c.close()


def test_a_client_sends_again_after_a_cut_but_not_to_a_daemon_that_is_gone(daemon: WeightSyncDaemon) -> None:
    """A connection the daemon closed between calls costs nothing; a daemon that is gone is named
    at once, not after the call's whole timeout (nothing listens, so retrying cannot help)."""
    assert daemon.server is not None
    client = DaemonClient(daemon.address, TOKEN, timeout_s=120)  # far past the bound below: a wait out of it is told apart on any box
    try:
        assert client.status()["role"] == "standalone"
        with daemon.server._lock:  # the daemon closes this client's idle connection, as a newcomer at the cap would
            conns = list(daemon.server._authed.values())
        for c in conns:
            c.cut()
        assert client.status()["role"] == "standalone"
        daemon.close()
        t0 = time.monotonic()
        with pytest.raises(WireError) as info:
            client.status()
        assert info.value.unreachable and time.monotonic() - t0 < 30, info.value  # milliseconds; the call's timeout is 120 s
    finally:
        client.close()


def test_the_reference_receivers_port_demands_the_job_token(tmp_path) -> None:
    sd = {"w": torch.arange(1024, dtype=torch.float32)}
    spec = tmp_path / "spec.msgpack"
    write_spec_file(spec, StateDictSource(sd).metadata())
    r = TorchRefRollout.spawn("r", spec_file=str(spec), timeout_s=60, token=TOKEN)  # start-up on a busy machine
    try:
        for token in (None, "some-other-jobs-token"):
            c = RpcClient(r.rpc.host, r.rpc.port, timeout_s=5, token=token)
            for method, params in (("finalize", {"version": 7}), ("resume", {}), ("health", {})):
                with pytest.raises(AuthError, match="AuthError"):  # an RpcError, by its own class
                    c.call(method, **params)
            c.close()
        # The same limits as the daemon's: a huge announced frame is refused from its header,
        # idle strangers do not lock the owner out.
        with socket.create_connection((r.rpc.host, r.rpc.port), timeout=5) as s:
            s.sendall(struct.pack("!I", ControlLimits().max_frame_bytes + 1))
            reply = recv_frame(s)
            assert reply["ok"] is False and "over the" in reply["error"]["message"]
            with pytest.raises((WireError, OSError)):
                recv_frame(s)
        idle = [socket.create_connection((r.rpc.host, r.rpc.port), timeout=5) for _ in range(80)]
        try:
            assert r.health()["version"] is None
        finally:
            for s in idle:
                s.close()
    finally:
        r.close()
