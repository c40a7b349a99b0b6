"""The daemon's control protocol under abuse, two jobs on one host, and the `serve`/`status` CLI.

Hostile and garbled messages are sent over real sockets to a real server; after each one the
daemon must still answer a well-formed request.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import torch

from ckpt_engine.config import CheckpointEngineConfig
from ckpt_engine.daemon import AuthError, DaemonClient, DaemonConfig, WeightSyncDaemon
from ckpt_engine.rollout_adapters.torch_ref import write_spec_file
from ckpt_engine.sources.base import StateDictSource
from ckpt_engine.control.wire import RpcError, WireError
from helpers_daemon import Engines, descriptor, start_serve
from helpers_procs import fork_program

pytestmark = pytest.mark.timeout(180)

TIMEOUT_S = 20.0
JOB_TOKEN = "test-protocol-job-token"


def weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(32, 512, generator=g) for i in range(4)}


@pytest.fixture(scope="module")
def spec_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("proto") / "spec.msgpack"
    write_spec_file(path, StateDictSource(weights(0)).metadata())
    return str(path)


@pytest.fixture
def engines(spec_file: str) -> Iterator[Engines]:
    made = Engines(spec_file, JOB_TOKEN)
    yield made
    made.close()


def config() -> CheckpointEngineConfig:
    return CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.25, timeout_s=TIMEOUT_S)


@pytest.fixture
def daemon() -> Iterator[WeightSyncDaemon]:
    d = WeightSyncDaemon(config(), DaemonConfig(heartbeat_timeout_s=0, idle_timeout_s=1.0, handshake_timeout_s=1.0, max_frame_bytes=64 * 1024))
    d.serve()
    yield d
    d.close()


def raw_exchange(d: WeightSyncDaemon, payload: bytes, wait_s: float = 5.0) -> object:
    """Send raw bytes; return the decoded reply, or None if the daemon closed without one."""
    with socket.create_connection((d.server.host, d.server.port), timeout=wait_s) as s:
        s.sendall(payload)
        try:
            header = s.recv(4, socket.MSG_WAITALL)
        except (ConnectionResetError, socket.timeout):
            return None
        if len(header) < 4:
            return None
        (n,) = struct.unpack("!I", header)
        body = s.recv(n, socket.MSG_WAITALL)
        return msgpack.unpackb(body, raw=False)


def frame(obj: object) -> bytes:
    data = msgpack.packb(obj, use_bin_type=True)
    return struct.pack("!I", len(data)) + data


def assert_still_serving(d: WeightSyncDaemon) -> None:
    c = DaemonClient(d.address, d.token, timeout_s=5)
    try:
        assert c.hello()["protocol"] == 1
    finally:
        c.close()


def test_garbled_and_hostile_frames_are_refused(daemon: WeightSyncDaemon) -> None:
    tok = daemon.token
    cases: list[tuple[str, bytes]] = [
        ("random bytes", os.urandom(256)),
        ("oversized header", struct.pack("!I", 0xFFFFFFF0) + b"x" * 16),
        ("over the control limit", struct.pack("!I", 64 * 1024 + 1) + b"x" * 16),
        ("not msgpack", struct.pack("!I", 5) + b"\xc1\xc1\xc1\xc1\xc1"),
        ("extension type", frame(msgpack.ExtType(1, b"boom"))),
        ("a list", frame([1, 2, 3])),
        ("bool id", frame({"id": True, "method": "hello", "params": {"token": tok}})),
        ("extra keys", frame({"id": 1, "method": "hello", "params": {"token": tok}, "x": 1})),
        ("params not a map", frame({"id": 1, "method": "hello", "params": [tok]})),
        ("deep nesting", frame({"id": 1, "method": "status", "params": {"token": tok, "x": _nest(500)}})),
    ]
    for what, payload in cases:
        reply = raw_exchange(daemon, payload)
        assert reply is None or (isinstance(reply, dict) and reply["ok"] is False), (what, reply)
        assert_still_serving(daemon)

    # A peer that announces a frame and stalls is cut off by the idle timeout; others are served meanwhile.
    with socket.create_connection((daemon.server.host, daemon.server.port), timeout=5) as stalled:
        stalled.sendall(struct.pack("!I", 100) + b"abc")
        assert_still_serving(daemon)
        stalled.settimeout(60)  # bounds the wait only: the 1 s idle timeout cuts it (nothing else would)
        assert stalled.recv(16) == b""  # closed by the daemon


def _nest(depth: int) -> object:
    x: object = 0
    for _ in range(depth):
        x = [x]
    return x


def test_wrong_types_unknown_methods_and_tokens_are_refused(daemon: WeightSyncDaemon) -> None:
    with _refusing_port() as refusing:  # an engine address nothing answers at
        good = DaemonClient(daemon.address, daemon.token, timeout_s=60)  # a liveness bound: each refusal is an answer, not a timeout
        bad_calls: list[tuple[str, dict[str, object], str]] = [
            ("hello", {"token": "not-this-job-token"}, "AuthError"),
            ("hello", {}, "AuthError"),
            ("hello", {"token": 12345}, "AuthError"),
            ("frobnicate", {"token": daemon.token}, "unknown method"),
            ("register", {"token": daemon.token, "name": "x"}, "missing param"),
            ("register", {"token": daemon.token, "name": 5, "engine": {"kind": "torch_ref"}}, "engine name"),
            ("register", {"token": daemon.token, "name": "a b", "engine": {"kind": "torch_ref"}}, "engine name"),
            ("register", {"token": daemon.token, "name": "e", "engine": "torch_ref"}, "must be a map"),
            ("register", {"token": daemon.token, "name": "e", "engine": {"kind": "warp_drive"}}, "unknown engine kind 'warp_drive'"),
            ("register", {"token": daemon.token, "name": "e", "engine": {"kind": "torch_ref", "host": "127.0.0.1", "port": 70000}}, "port must be an int"),
            ("register", {"token": daemon.token, "name": "e", "engine": {"kind": "torch_ref", "host": "127.0.0.1", "port": "1"}}, "port must be an int"),
            ("register", {"token": daemon.token, "name": "e", "engine": {"kind": "torch_ref", "host": "127.0.0.1", "port": 9, "cmd": "rm"}}, "unknown key"),
            ("register", {"token": daemon.token, "name": "e", "engine": {"kind": "torch_ref", "host": "127.0.0.1", "port": refusing}}, "unreachable"),
            ("leave", {"token": daemon.token, "name": "e", "extra": 1}, "unknown param"),
            ("heartbeat", {"token": daemon.token, "name": "nobody"}, "not registered"),
            ("report_sync", {"token": daemon.token, "outcome": {"version": "1"}}, "outcome"),
            ("report_sync", {"token": daemon.token, "outcome": {"version": 1, "ok": True, "engines": {"e": -3}, "states": {}, "dropped": {}, "stale": []}}, "outcome.engines.e"),
        ]
        raw = good._rpc
        for method, params, match in bad_calls:
            with pytest.raises(RpcError, match=match):
                raw.call(method, **params)
            assert good.hello()["protocol"] == 1
        assert daemon.membership.names() == []
        assert good.status()["refused_requests"] >= len(bad_calls)
        good.close()


@contextlib.contextmanager
def _refusing_port() -> Iterator[int]:
    """A port bound and never listened on: connections to it are refused, and no other process can
    take it while the test runs (a port closed after `bind(0)` could be bound by anyone meanwhile)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


def test_two_daemons_on_one_host_do_not_cross(engines: Engines) -> None:
    a = WeightSyncDaemon(config(), DaemonConfig(heartbeat_timeout_s=0))
    b = WeightSyncDaemon(config(), DaemonConfig(heartbeat_timeout_s=0))
    try:
        a.serve(), b.serve()
        ca, cb = DaemonClient(a.address, a.token, 10), DaemonClient(b.address, b.token, 10)
        cross = DaemonClient(b.address, a.token, 10)  # job A's token sent to job B's daemon
        with pytest.raises(AuthError, match="wrong job token"):
            cross.register("a0", {"kind": "torch_ref", "host": "127.0.0.1", "port": 1})
        ra = [engines.spawn(f"e{i}", token=a.token) for i in range(2)]  # same engine names in both jobs
        rb = [engines.spawn(f"e{i}", token=b.token) for i in range(2)]
        for r in ra:
            ca.register(r.name, descriptor(r))
        for r in rb:
            cb.register(r.name, descriptor(r))
        sda, sdb = weights(1), weights(2)
        results: dict[str, object] = {}
        threads = [
            threading.Thread(target=lambda: results.__setitem__("a", a.sync(StateDictSource(sda)))),
            threading.Thread(target=lambda: results.__setitem__("b", b.sync(StateDictSource(sdb), version=7))),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert results["a"].ok and results["b"].ok  # type: ignore[attr-defined]
        for r in ra:
            assert r.health()["version"] == 1 and torch.equal(r.get_tensor("w0"), sda["w0"])
        for r in rb:
            assert r.health()["version"] == 7 and torch.equal(r.get_tensor("w0"), sdb["w0"])
        assert ca.status()["version"] == 1 and cb.status()["version"] == 7
        for c in (ca, cb, cross):
            c.close()
    finally:
        a.close()
        b.close()


def test_serve_status_and_a_trainer_following_it(tmp_path: Path, engines: Engines) -> None:
    """`ckpt-engine serve` and `ckpt-engine status` as a user runs them (the one `serve` of the
    suite started as a command; the others fork the same `main`, tests/helpers_daemon.py)."""
    yaml = "checkpoint_engine:\n  backend: gloo\n  bucket_size_mb: 0.25\n  timeout_s: 20\ndaemon:\n  health_interval_s: 0.5\n"
    serve = start_serve(tmp_path, JOB_TOKEN, "daemon.heartbeat_timeout_s=0", "checkpoint_engine.verify=true", yaml=yaml, command=True)
    proc, address, token = serve.process, serve.address, serve.token
    trainer: WeightSyncDaemon | None = None
    try:
        client = DaemonClient(address, token, timeout_s=10)
        assert client.hello()["role"] == "standalone"
        r0, r1 = engines.spawn("r0"), engines.spawn("r1")
        client.register("r0", descriptor(r0))
        client.register("r1", descriptor(r1))
        assert not r0.health()["paused"]  # registration pauses nothing until a sync starts (issue 26)

        # The trainer process drives the data; the standalone daemon hands it the members.
        trainer = WeightSyncDaemon(config(), upstream=DaemonClient(address, token, timeout_s=10))
        with pytest.raises(RpcError):
            client.call("report_sync", outcome={"version": 0})
        sd = weights(5)
        outcome = trainer.sync(StateDictSource(sd))
        assert outcome.ok and outcome.engines == {"r0": 1, "r1": 1}
        assert torch.equal(r1.get_tensor("w3"), sd["w3"]) and r1.health()["version"] == 1

        status = client.status()
        assert status["version"] == 1 and status["last_sync"]["ok"]
        assert {e["name"]: (e["state"], e["version"]) for e in status["engines"]} == {"r0": ("serving", 1), "r1": ("serving", 1)}

        # A member that leaves at the daemon is left out of the trainer's next sync.
        client.leave("r0")
        outcome = trainer.sync(StateDictSource(weights(6)))
        assert outcome.ok and outcome.engines == {"r1": 2} and r0.health()["version"] == 1

        out = subprocess.run(
            [sys.executable, "-m", "ckpt_engine.cli", "status", "--address", address, "--token", token],
            capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "160"},
        )
        assert out.returncode == 0, out.stderr
        for text in ("r1", "serving", "departed", "r0", "last sync", "complete"):
            assert text in out.stdout, (text, out.stdout)
        err = tmp_path / "status.err"  # the same `main`, forked: no second interpreter start
        wrong = fork_program("ckpt_engine.cli:main", ["status", "--address", address, "--token", "0" * 32], "status", stderr_path=str(err))
        assert wrong.process.wait(60) == 1 and "wrong job token" in err.read_text()

        client.shutdown()
        assert proc.wait(15) == 0
        with pytest.raises(WireError):
            DaemonClient(address, token, timeout_s=2).hello()
        client.close()
    finally:
        if trainer is not None:
            trainer.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
