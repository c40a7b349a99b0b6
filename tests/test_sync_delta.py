"""Delta syncs through WeightSyncSession into reference engines in their own processes: the
version chain (seed, patches, dense again when a base is not exact), corruption caught before
any load, and `auto` going dense where patches cost more than dense syncs and patching where they
pay (sync/delta_policy.py decides from the syncs' own seconds)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

import pytest
import torch

from ckpt_engine import CheckpointEngineConfig, SyncError, WeightSyncSession
from tamper import GlooEngine
from ckpt_engine.rollout_adapters.torch_ref import TorchRefRollout, write_spec_file
from ckpt_engine.sync.api import close_sessions
from ckpt_engine.sources.base import StateDictSource
from multisender import model_state, wire
from refengines import holds, spawn_engine
from tamper import FlipOnce

CFG = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.0625, timeout_s=30, delta="on")


def version(v: int, lr: float = 1e-5) -> dict[str, torch.Tensor]:
    return wire(model_state(v, lr=lr))


@pytest.fixture(scope="module")
def spec_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("spec") / "spec.msgpack"
    write_spec_file(path, StateDictSource(version(0)).metadata())
    return str(path)


@pytest.fixture(scope="module")
def engines(spec_file: str) -> Iterator[list[TorchRefRollout]]:
    rs = [spawn_engine(f"delta{i}", spec_file=spec_file, timeout_s=60) for i in range(2)]
    yield rs
    close_sessions()
    for r in rs:
        r.close()


def test_chain_of_patches_then_dense_after_a_restart(engines: list[TorchRefRollout], spec_file: str) -> None:
    """A seed, then five patch syncs of real AdamW steps (bf16 wire, fp32 router, int / bool
    buffers, NaN / -0.0, a tensor larger than a bucket): every engine equals the trainer byte for
    byte each time and the wire carries a fraction of the dense bytes. Then one engine is replaced
    by a fresh process: the next sync is dense for the group and everyone ends exact again."""
    session = WeightSyncSession(engines, CFG)
    try:
        kinds = []
        for v in range(6):
            sd = version(v)
            report = session.sync(StateDictSource(sd))
            kinds.append(report.delta)
            for e in engines:
                assert holds(e, sd) == []
            if report.delta == "patch":
                assert report.wire_bytes < 0.6 * report.dense_bytes
                assert 0 < report.changed_fraction < 0.5
        assert kinds == ["seed"] + ["patch"] * 5
        engines[1].close()
        engines[1] = spawn_engine("delta1", spec_file=spec_file, timeout_s=60)
        fresh = WeightSyncSession(engines, CFG)
        try:
            sd = version(6)
            report = fresh.sync(StateDictSource(sd))
            assert report.delta == "seed" and report.wire_bytes == report.dense_bytes
            assert all(holds(e, sd) == [] for e in engines)
            assert fresh.sync(StateDictSource(version(7))).delta == "patch"
        finally:
            fresh.close()
    finally:
        session.close()


class _Tampered(FlipOnce):
    """Flips one bit of the second patch it sends, once armed."""

    armed = False
    bucket = 1


@pytest.mark.parametrize("stage", ["off", "auto"])
def test_corrupt_patch_leaves_old_weights_and_the_next_sync_heals(engines: list[TorchRefRollout], stage: str) -> None:
    """Paused for the whole sync (`stage: off`), the engines stay paused and stale; staged (issue
    28), they never paused and stay fresh: their live weights were never touched."""
    cfg = dataclasses.replace(CFG, stage=stage)
    engine = _Tampered(bucket_size_bytes=cfg.bucket_size_bytes, timeout_s=cfg.timeout_s, solo_bytes=0)
    session = WeightSyncSession(engines, cfg, engine=engine)
    try:
        sd0, sd1 = version(10), version(11)
        held = session.sync(StateDictSource(sd0)).version
        _Tampered.armed = True
        with pytest.raises(SyncError, match="checksum mismatch|malformed patch") as info:
            session.sync(StateDictSource(sd1))
        assert info.value.stage == "transfer"
        for e in engines:
            assert holds(e, sd0) == []  # the loader never ran: still the old version, bit for bit
            h = e.health()
            if stage == "off":
                assert h["stale"] and h["paused"]
            else:
                assert (h["stale"], h["paused"], h["version"], h["staged"]) == (False, False, held, False), h
                assert info.value.stale == []
        sd2 = version(12)
        report = session.sync(StateDictSource(sd2))
        assert report.delta == "seed"  # nobody may assume a base after a failure
        assert all(holds(e, sd2) == [] for e in engines)
    finally:
        session.close()


@pytest.mark.parametrize("stage", ["off", "auto"])
def test_a_patch_sync_counts_the_buckets_it_took(engines: list[TorchRefRollout], stage: str) -> None:
    """`buckets_received` (engine health, the daemon CLI's health line) counts every bucket an
    engine took, a large tensor's middle chunks too: the dense seed and the patch sync each advance
    it by the plan's buckets, paused for the whole sync (`stage: off`) or staged (`auto`: the
    patches wait for the swap, and used to count nothing)."""
    session = WeightSyncSession(engines, dataclasses.replace(CFG, stage=stage))
    try:
        counts = [[e.health()["buckets_received"] for e in engines]]
        reports = []
        for v in (20, 21):
            reports.append(session.sync(StateDictSource(version(v))))
            counts.append([e.health()["buckets_received"] for e in engines])
        assert [r.delta for r in reports] == ["seed", "patch"], reports
        assert reports[1].staged == ("off" if stage == "off" else "patches"), reports[1]
        for before, seeded, patched in zip(*counts):  # one sender, no receive plans: each engine takes every bucket
            assert (seeded - before, patched - seeded) == (reports[0].buckets, reports[1].buckets), (before, seeded, patched)
    finally:
        session.close()


def _sparse_version(v: int, words: int, changed: float) -> dict[str, torch.Tensor]:
    """`words` bf16 words in 16 tensors (several per bucket); version v changes a fraction
    `changed` of the words of version v - 1."""
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(words, generator=g) * 0.02).bfloat16().view(torch.int16)
    for k in range(1, v + 1):
        w[torch.rand(w.numel(), generator=torch.Generator().manual_seed(k)) < changed] += 1
    return {f"w{i}": t.view(torch.bfloat16).reshape(-1, 256).clone() for i, t in enumerate(w.chunk(16))}


class _SlowLink(GlooEngine):
    """gloo over a link of LINK_BYTES_S: every message waits its bytes' time before it goes (a
    slow network, where sending fewer bytes pays for the codec)."""

    LINK_BYTES_S = 2e6

    def _tamper_hook(self, bucket_index: int, message: torch.Tensor) -> None:
        time.sleep(message.numel() / self.LINK_BYTES_S)


def _auto_syncs(
    tmp: pytest.TempPathFactory, words: int, changed: float, bucket_mb: float, n: int, slow: bool
) -> tuple[list[str], list[float]]:
    """`n` syncs with delta=auto of consecutive versions into two reference engines; the kinds
    sent and their transfer seconds."""
    path = tmp.mktemp("auto") / "spec.msgpack"
    write_spec_file(path, StateDictSource(_sparse_version(0, words, changed)).metadata())
    engines = [spawn_engine(f"auto{i}", spec_file=str(path), timeout_s=60) for i in range(2)]
    cfg = CheckpointEngineConfig(backend="gloo", bucket_size_mb=bucket_mb, timeout_s=60, delta="auto")
    engine = _SlowLink(bucket_size_bytes=cfg.bucket_size_bytes, timeout_s=60) if slow else None
    session = WeightSyncSession(engines, cfg, engine=engine)
    kinds, seconds = [], []
    try:
        for v in range(n):
            sd = _sparse_version(v, words, changed)
            report = session.sync(StateDictSource(sd))
            kinds.append(report.delta)
            seconds.append(round(report.seconds["transfer"], 4))
            assert all(holds(e, sd) == [] for e in engines)
    finally:
        session.close()
        for e in engines:
            e.close()
    return kinds, seconds


def test_auto_goes_dense_where_patches_cost_more_than_dense(tmp_path_factory: pytest.TempPathFactory) -> None:
    """16 MiB with 5 % of the words changed per version, 4 MiB buckets, over loopback gloo: the
    CPU codec costs several times moving the dense bytes (~0.3-1 s against ~0.03-0.2 s here),
    though a patch carries ~11 % of them. After its dense measurement, a seed and three patch
    syncs, `auto` sends plain dense syncs."""
    kinds, seconds = _auto_syncs(tmp_path_factory, 1 << 23, 0.05, 4, 10, slow=False)
    assert kinds == ["off", "off", "seed", "patch", "patch", "patch", "off", "off", "off", "off"], (kinds, seconds)


def test_auto_keeps_patching_where_patches_pay(tmp_path_factory: pytest.TempPathFactory) -> None:
    """2 MiB, 1 % changed per version, on a 2 MB/s link: a dense sync takes ~1 s, a patch (~3 %
    of the bytes) a few hundredths once the kernels are compiled: `auto` keeps patching."""
    kinds, seconds = _auto_syncs(tmp_path_factory, 1 << 20, 0.01, 0.5, 8, slow=True)
    assert kinds == ["off", "off", "seed"] + ["patch"] * 5, (kinds, seconds)
