"""An SGLang server that dies mid-stream fails the sync at once, naming the engine, instead of
leaving the sender waiting the whole `timeout_s` in a broadcast nobody will answer.

Against `tests/sglang_standin.py` (SGLang 0.5.x's RL weight-update API, CPU/gloo) while the
trainer streams its buckets: SIGKILLed (its connections close), or its scheduler dead with the
process alive (`--fail-after-updates`: the request fails, the group's connection stays open).
"""

from __future__ import annotations

import re
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from ckpt_engine import CheckpointEngineConfig, WeightSyncSession
from ckpt_engine.sources.base import StateDictSource
from ckpt_engine.sync.report import SyncError
from helpers_procs import ForkedProcess
from helpers_sglang import standin, tiny_model, write_model_dir

pytest.importorskip("transformers")
pytest.importorskip("requests")

TIMEOUT_S = 240.0
"""Far past any normal run: a sync that waited it out is told apart from one that noticed the death
by a bound of half of it, on any box (the sync takes seconds)."""
NAME = "sglang-doomed"


@dataclass
class Server:
    proc: ForkedProcess
    client: object
    weights: dict[str, torch.Tensor]


def _start(model_dir: Path, *extra: str) -> Iterator[Server]:
    from ckpt_engine.rollout_adapters.sglang import SglangClient

    with standin(write_model_dir(model_dir), *extra) as (proc, url):
        client = SglangClient(NAME, url, timeout_s=TIMEOUT_S)
        try:
            weights = {n: t.detach() for n, t in tiny_model(model_dir, seed=1).state_dict().items()}
            yield Server(proc, client, weights)
        finally:
            client.close()


@pytest.fixture()
def server(tmp_path: Path) -> Iterator[Server]:
    yield from _start(tmp_path)


@pytest.fixture()
def failing_server(tmp_path: Path) -> Iterator[Server]:
    yield from _start(tmp_path, "--fail-after-updates", "2")


class _KillsServer(StateDictSource):
    """Yields the trainer's weights and SIGKILLs the server at the `at`-th tensor (mid-stream),
    going on only once its process is reaped (at most `reap_s`): the rest of the stream then
    meets a dead server, its sockets closed, on a fast box as on a loaded one."""

    def __init__(self, weights: dict[str, torch.Tensor], proc: ForkedProcess, at: int, reap_s: float = 60.0) -> None:
        super().__init__(weights)
        self.proc, self.at, self.reap_s = proc, at, reap_s

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for i, item in enumerate(super().iter_weights()):
            if i == self.at:
                self.proc.kill()
                try:
                    self.proc.wait(self.reap_s)
                except subprocess.TimeoutExpired as exc:
                    raise RuntimeError(f"the SIGKILLed server (pid {self.proc.pid}) was not reaped within {self.reap_s:g}s") from exc
            yield item


def _fails_at_once(server: Server, source: StateDictSource, flattened: bool) -> SyncError:
    """Sync `source` into the server; the SyncError, after checking it named the engine and did not
    wait out `timeout_s`."""
    import ckpt_engine.rollout_adapters.sglang.rollout  # noqa: F401  (registers the `sglang` transport)
    from ckpt_engine.rollout_adapters.sglang import SglangRollout

    config = CheckpointEngineConfig(bucket_size_mb=0.05, timeout_s=TIMEOUT_S, engine_kwargs={"sglang": {"flattened": flattened}})
    session = WeightSyncSession([SglangRollout(server.client)], config)  # type: ignore[arg-type]
    try:
        t0 = time.monotonic()
        with pytest.raises(SyncError, match=NAME) as err:
            session.sync(source)
        elapsed = time.monotonic() - t0
    finally:
        session.close()
    print(f"noticed in {elapsed:.2f}s: {err.value}")
    assert NAME in err.value.failed, err.value.failed
    assert elapsed < TIMEOUT_S / 2, f"the sync took {elapsed:.1f}s to notice the dead server (timeout_s {TIMEOUT_S})"
    return err.value


@pytest.mark.parametrize("flattened", [True, False], ids=["flattened_bucket", "per_tensor"])
def test_a_server_killed_mid_stream_fails_the_sync_at_once(server: Server, flattened: bool) -> None:
    _fails_at_once(server, _KillsServer(server.weights, server.proc, at=len(server.weights) // 2), flattened)
    assert server.proc.wait(5) == -signal.SIGKILL


@pytest.mark.parametrize("flattened", [True, False], ids=["flattened_bucket", "per_tensor"])
def test_a_server_whose_scheduler_dies_mid_stream_fails_the_sync_at_once(failing_server: Server, flattened: bool) -> None:
    """The third bucket's request answers 500 and the server never joins its broadcast, while its
    process keeps the group's connection open: the sync stops at once, naming the engine and the
    bucket whose request failed. The sender may still be inside bucket 1's last broadcast when that
    failure lands (the server took those bytes and posted bucket 2 before the sender's poll saw its
    broadcast end), so the bucket the sender names is 1 or 2, on a loaded box as on a quiet one."""
    error = _fails_at_once(failing_server, StateDictSource(failing_server.weights), flattened)
    assert error.sender_error is not None, str(error)
    assert re.search(rf"SGLang engine\(s\) {NAME} failed while bucket [12] streamed", error.sender_error), error.sender_error
    assert f"{NAME}: bucket 2: " in error.sender_error and "scheduler died" in error.sender_error, error.sender_error
    assert failing_server.proc.poll() is None  # the process lives on: only its failed request told
