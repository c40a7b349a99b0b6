"""A sender whose delta frame header lies about its payload's size (issue 26, item 5), and a header
corrupted on its own after the sender sealed it, its payload posted at its real size (issue 45,
item 3): reference engines in their own processes get a SyncError naming the sender and the
bucket, none of them dies (gloo aborts a process whose receive size differs from what arrives),
each keeps its old weights bit for bit (an unstaged one stays paused and stale), and the next
sync heals. Each fault is injected three times in a row."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from ckpt_engine import CheckpointEngineConfig, SyncError, WeightSyncSession
from ckpt_engine.pipeline.delta_bases import DENSE, PATCH
from ckpt_engine.sync.report import SyncReport
from ckpt_engine.rollout_adapters.torch_ref import TorchRefRollout, write_spec_file
from ckpt_engine.sources.base import StateDictSource
from ckpt_engine.sync.api import close_sessions
from tamper import GlooEngine
from multisender import model_state, wire
from refengines import holds, spawn_engine

CFG = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.0625, timeout_s=30, delta="on")


def version(v: int, lr: float = 1e-5, seed: int = 0) -> dict[str, torch.Tensor]:
    """Step `v` of the AdamW chain from base state `seed` (each case its own base: short chains)."""
    return wire(model_state(v, lr=lr, base_seed=seed))


class _Lying(GlooEngine):
    """Once armed, announces the first frame of kind `kind` `by` bytes off its real size."""

    kind = PATCH
    by = 0  # 1: armed
    _by = 0  # bytes off
    lied: list[int] = []

    def _tamper_size_hook(self, bucket_index: int, kind: int, size: int) -> int:
        if self.by and kind == self.kind:
            type(self).lied.append(bucket_index)
            type(self).by = 0
            return size + self._by
        return size


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[TorchRefRollout]]:
    path = tmp_path_factory.mktemp("spec") / "spec.msgpack"
    write_spec_file(path, StateDictSource(version(0)).metadata())
    rs = [spawn_engine(f"frames{i}", spec_file=str(path), timeout_s=60) for i in range(2)]
    yield rs
    close_sessions()
    for r in rs:
        r.close()


@pytest.mark.parametrize(("kind", "by"), [(PATCH, -8), (PATCH, 8), (DENSE, -8), (DENSE, 8)])
def test_a_frame_that_misstates_its_payload_fails_the_sync_and_the_next_heals(engines: list[TorchRefRollout], kind: int, by: int) -> None:
    seed, v = 1 + 2 * kind + (by > 0), 0
    for _ in range(3):  # a failed sync rebuilds the group (with a plain engine): one session per lie
        session = WeightSyncSession(engines, CFG, engine=_Lying(bucket_size_bytes=CFG.bucket_size_bytes, timeout_s=CFG.timeout_s, solo_bytes=0))
        try:
            held = version(v, seed=seed)
            assert session.sync(StateDictSource(held)).delta == "seed"
            _Lying.kind, _Lying.by, _Lying._by, _Lying.lied = kind, 1, by, []
            try:  # a patch sync; at lr 0.1 nearly every word changes and every bucket goes dense
                report = session.sync(StateDictSource(version(v + 1, lr=1e-5 if kind == PATCH else 1e-1, seed=seed)))
            except SyncError as exc:
                error = exc
            else:
                pytest.fail(f"the sync succeeded: {report.delta}, frames misstated in buckets {_Lying.lied}")
            assert len(_Lying.lied) == 1
            assert f"bucket {_Lying.lied[0]} from sender 0" in str(error)
            assert error.stage == "transfer"
            for e in engines:
                assert holds(e, held) == []  # alive, and still the old version, bit for bit
            held = version(v + 2, seed=seed)
            report = session.sync(StateDictSource(held))
            assert report.delta == "seed"  # nobody may assume a base after a failure
            assert all(holds(e, held) == [] for e in engines)
            v += 3
        finally:
            session.close()


class _Corrupting(GlooEngine):
    """Once armed, corrupts the size word of the first sealed frame header of kind `kind` by `by`
    bytes; the payload still leaves at its real size (a header corrupted on its own)."""

    kind = PATCH
    by = 0
    armed = False
    hit: list[int] = []

    def _tamper_header_hook(self, bucket_index: int, header: torch.Tensor) -> None:
        cls = type(self)
        if cls.armed and int(header[0, 0]) == cls.kind:
            header[0, 1] += cls.by
            cls.hit.append(bucket_index)
            cls.armed = False


@pytest.mark.parametrize("stage", ["auto", "off"])
@pytest.mark.parametrize("kind", [PATCH, DENSE])
def test_a_header_corrupted_on_its_own_fails_the_sync_and_kills_no_receiver(engines: list[TorchRefRollout], kind: int, stage: str) -> None:
    cfg = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.0625, timeout_s=30, delta="on", stage=stage)
    seed, v = 11 + 2 * kind + (stage == "off"), 0
    for _ in range(3):
        session = WeightSyncSession(engines, cfg, engine=_Corrupting(bucket_size_bytes=cfg.bucket_size_bytes, timeout_s=cfg.timeout_s, solo_bytes=0))
        try:
            held = version(v, seed=seed)
            assert session.sync(StateDictSource(held)).delta == "seed"
            _Corrupting.kind, _Corrupting.by, _Corrupting.armed, _Corrupting.hit = kind, -8, True, []
            try:  # at lr 0.1 nearly every word changes and every bucket goes dense
                report: SyncReport = session.sync(StateDictSource(version(v + 1, lr=1e-5 if kind == PATCH else 1e-1, seed=seed)))
            except SyncError as exc:
                error = exc
            else:
                pytest.fail(f"the sync succeeded: {report.delta}, headers corrupted in buckets {_Corrupting.hit}")
            assert len(_Corrupting.hit) == 1
            assert f"bucket {_Corrupting.hit[0]} from sender 0" in str(error) and "frame header is corrupt" in str(error)
            assert error.stage == "transfer"
            assert set(error.failed) >= {e.name for e in engines}
            for e in engines:
                assert e.process is not None and e.process.poll() is None  # alive
                assert holds(e, held) == []  # the old version, bit for bit
                health = e.health()
                assert health["stale"] == (stage == "off") and health["paused"] == (stage == "off")
            held = version(v + 2, seed=seed)
            report = session.sync(StateDictSource(held))
            assert report.delta == "seed"  # nobody may assume a base after a failure
            assert all(holds(e, held) == [] for e in engines)
            assert all(not e.health()["stale"] and not e.health()["paused"] for e in engines)
            v += 3
        finally:
            session.close()
