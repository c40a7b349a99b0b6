"""Shared by the daemon, reliability and restart tests: the job's weights, reference engines
registered by descriptor, `ckpt-engine serve` in a process of its own (waits with deadlines: tests/helpers_wait.py).

Engines and `serve` are forked from the test session's preloaded server (tests/helpers_procs.py):
the same `main` a command line runs, in a real process the tests kill and restart, without a new
interpreter importing torch each time. tests/test_daemon_protocol.py starts `serve` as a command.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt_engine.config import CheckpointEngineConfig
from ckpt_engine.daemon.cli import READY_PREFIX
from ckpt_engine.readable import readable
from ckpt_engine.rollout_adapters.torch_ref import TorchRefRollout, write_spec_file
from ckpt_engine.sources.base import StateDictSource
from helpers_procs import ForkedProcess, fork_program
from refengines import spawn_engine

TIMEOUT_S = 20.0
NUM_TENSORS = 8
SERVE_YAML = "checkpoint_engine:\n  backend: gloo\n  bucket_size_mb: 0.25\n  timeout_s: 20\n  stage: 'off'\ndaemon:\n  health_interval_s: 0.3\n  heartbeat_timeout_s: 0\n"


def weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}.weight": torch.randn(64, 1024, generator=g) for i in range(NUM_TENSORS)}  # 256 KiB each


def config(timeout_s: float = TIMEOUT_S) -> CheckpointEngineConfig:
    return CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.25, timeout_s=timeout_s, stage="off")  # the daemon's recovery of paused, stale engines


def write_spec(path: Path) -> str:
    """A spec file of `weights`' tensors (what every engine of these tests holds)."""
    write_spec_file(path, StateDictSource(weights(0)).metadata())
    return str(path)


def descriptor(r: TorchRefRollout) -> dict[str, Any]:
    return {"kind": "torch_ref", "host": r.rpc.host, "port": r.rpc.port}


def holds(r: TorchRefRollout, sd: dict[str, torch.Tensor], version: int) -> bool:
    """`r` serves `version` (unpaused, not stale) and holds `sd` bit for bit."""
    h = r.health()
    return (h["version"], h["paused"], h["stale"]) == (version, False, False) and all(torch.equal(r.get_tensor(n), t) for n, t in sd.items())


class Engines:
    """Reference engines of one job (its token), closed at teardown whatever happened."""

    def __init__(self, spec_file: str, token: str) -> None:
        self.spec_file, self.token = spec_file, token
        self.all: list[TorchRefRollout] = []

    def spawn(
        self, name: str, *, token: str | None = None, port: int = 0, load_delay_s: float = 0.0, spec_file: str | None = None,
        hold_file: str | None = None,
    ) -> TorchRefRollout:
        """`hold_file`: the engine's bucket loads wait while that file exists (load_gate.py)."""
        r = spawn_engine(
            name, spec_file=spec_file or self.spec_file, timeout_s=TIMEOUT_S, token=token or self.token, port=port, load_delay_s=load_delay_s,
            hold_file=hold_file,
        )
        self.all.append(r)
        return r

    def close(self) -> None:
        for r in self.all:
            r.close()


class Serve:
    """A running `ckpt-engine serve`: its process and the address and token it printed."""

    def __init__(self, process: subprocess.Popen[str] | ForkedProcess, ready: str) -> None:
        fields = dict(part.split("=", 1) for part in ready[len(READY_PREFIX):].split())
        self.process, self.address, self.token = process, fields["address"], fields["token"]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


def start_serve(tmp_path: Path, token: str, *overrides: str, port: int = 0, yaml: str = SERVE_YAML, command: bool = False) -> Serve:
    """`ckpt-engine serve` on `port` (0: a free one) with `yaml` as its config; its stderr goes to
    tmp_path/serve.log. `command`: run it as `python -m ckpt_engine.cli serve`, as a user does."""
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml)
    argv = ["serve", "--config", str(cfg), "--token", token, "--port", str(port), *overrides]
    log = tmp_path / "serve.log"
    if not command:
        program = fork_program("ckpt_engine.cli:main", argv, "serve", stderr_path=str(log))
        line = program.read_line(READY_PREFIX, 60) or ""
        if not line:
            program.process.kill()
            pytest.fail(f"ckpt-engine serve did not start: {log.read_text()[-2000:] if log.exists() else ''}")
        return Serve(program.process, line)
    with open(log, "a") as err:
        proc = subprocess.Popen([sys.executable, "-m", "ckpt_engine.cli", *argv], stdout=subprocess.PIPE, stderr=err, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline() if readable(proc.stdout, 60) else ""
    if not line.startswith(READY_PREFIX):
        proc.kill()
        pytest.fail(f"ckpt-engine serve did not start: {line!r}")
    return Serve(proc, line)


def engine_fixtures(token: str, label: str) -> tuple[Any, Any]:
    """A test module's `spec_file` (module-scoped: one spec of the reference engines under `label`)
    and `receivers` (the `Engines` on it, checked with `token`, closed after each test), to be bound
    as `spec_file, receivers = engine_fixtures(TOKEN, "label")`."""

    @pytest.fixture(scope="module")
    def spec_file(tmp_path_factory: pytest.TempPathFactory) -> str:
        return write_spec(tmp_path_factory.mktemp(label) / "spec.msgpack")

    @pytest.fixture
    def receivers(spec_file: str) -> Iterator[Engines]:
        rs = Engines(spec_file, token)
        yield rs
        rs.close()

    return spec_file, receivers
