"""Delta syncs through WeightSyncSession into reference engines in their own processes: the
version chain (seed, patches, dense again when a base is not exact), corruption caught before
any load, and `auto` falling back to plain dense syncs when patches do not pay."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from ckpt_engine import CheckpointEngineConfig, SyncError, WeightSyncSession
from ckpt_engine.transports.gloo import GlooCheckpointEngine
from ckpt_engine.rollout_adapters.torch_ref import TorchRefRollout, write_spec_file
from ckpt_engine.sync.api import close_sessions
from ckpt_engine.sources.base import StateDictSource, WeightSource, spec_of
from multisender import model_state, wire
from refengines import holds

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
    rs = [TorchRefRollout.spawn(f"delta{i}", spec_file=spec_file, timeout_s=60) for i in range(2)]
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
        engines[1] = TorchRefRollout.spawn("delta1", spec_file=spec_file, timeout_s=60)
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


class _Tampered(GlooCheckpointEngine):
    """Flips one bit of the second patch it sends, once armed."""

    armed = False

    def _tamper_hook(self, bucket_index: int, message: torch.Tensor) -> None:
        if self.armed and message.numel() > 64 and bucket_index == 1:
            message[48] ^= 0x04
            type(self).armed = False


def test_corrupt_patch_leaves_old_weights_and_the_next_sync_heals(engines: list[TorchRefRollout]) -> None:
    engine = _Tampered(bucket_size_bytes=CFG.bucket_size_bytes, timeout_s=CFG.timeout_s, solo_bytes=0)
    session = WeightSyncSession(engines, CFG, engine=engine)
    try:
        sd0, sd1 = version(10), version(11)
        session.sync(StateDictSource(sd0))
        _Tampered.armed = True
        with pytest.raises(SyncError, match="checksum mismatch|malformed patch") as info:
            session.sync(StateDictSource(sd1))
        assert info.value.stage == "transfer"
        for e in engines:
            assert holds(e, sd0) == []  # the loader never ran: still the old version, bit for bit
            h = e.health()
            assert h["stale"] and h["paused"]
        sd2 = version(12)
        report = session.sync(StateDictSource(sd2))
        assert report.delta == "seed"  # nobody may assume a base after a failure
        assert all(holds(e, sd2) == [] for e in engines)
    finally:
        session.close()


def test_auto_falls_back_to_plain_dense_when_patches_do_not_pay(engines: list[TorchRefRollout]) -> None:
    """At a learning rate where nearly every word changes, `auto` tries one patch sync, sees the
    patches carry most of the bytes, and sends the next syncs dense without base copies."""
    cfg = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.0625, timeout_s=30, delta="auto")
    session = WeightSyncSession(engines, cfg)
    try:
        kinds, wire_fraction = [], []
        for v in range(4):
            sd = version(v, lr=1e-1)
            report = session.sync(StateDictSource(sd))
            kinds.append(report.delta)
            wire_fraction.append(report.wire_bytes / report.dense_bytes)
            assert all(holds(e, sd) == [] for e in engines)
        assert kinds[:2] == ["seed", "patch"] and kinds[2:] == ["off", "off"]
        assert wire_fraction[1] > 0.5 and wire_fraction[2:] == [1.0, 1.0]
    finally:
        session.close()


class _CastingTrainer(WeightSource):
    """A custom one-rank trainer synced through the library call: fp32 masters stepped by AdamW,
    bf16 weights written through the engine's cast recorder once the sync offered it
    (`record_casts`), by a plain cast before; other dtypes sent as they are."""

    is_sender = True
    stable_tensors = True

    def __init__(self, sd: dict[str, torch.Tensor]) -> None:
        self.weights = {n: t.clone() for n, t in sd.items()}
        self.masters = {n: t.float() for n, t in self.weights.items() if t.dtype == torch.bfloat16}
        self.opt = torch.optim.AdamW(list(self.masters.values()), lr=1e-6)
        self.recorder = None
        self.offers = 0

    def metadata(self) -> list:
        return [spec_of(n, t) for n, t in self.weights.items()]

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.weights.items()

    def record_casts(self, recorder_of, *, pieces: bool) -> bool:  # noqa: ANN001 - the hook recorded_casts.py documents
        self.offers += 1
        rec = recorder_of()
        if rec is not self.recorder:
            rec.bind({n: (self.masters[n], self.weights[n]) for n in rec.names})
            self.recorder = rec
        return not pieces

    def step(self, g: torch.Generator) -> None:
        for m in self.masters.values():
            m.grad = torch.randn(m.shape, generator=g) * 0.01
        self.opt.step()
        if self.recorder is not None:
            self.recorder.cast_()
        else:
            for n, m in self.masters.items():
                self.weights[n].copy_(m)


def test_a_custom_trainer_records_its_casts_through_the_library_call(engines: list[TorchRefRollout]) -> None:
    """`delta_base: cast` through `WeightSyncSession.sync`: the session offers its engine's
    recorder before each delta walk, the trainer binds its (master, weight) pairs once and casts
    through it after each step (twice between two of the syncs); after the seed every sync sends
    the recorded patches and every engine equals the trainer's weights bit for bit."""
    cfg = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.0625, timeout_s=30, delta="on", delta_base="cast")
    trainer = _CastingTrainer(version(0))
    session = WeightSyncSession(engines, cfg)
    g = torch.Generator().manual_seed(0)
    try:
        kinds = []
        for v in range(4):
            for _ in range(2 if v == 2 else 1 if v else 0):
                trainer.step(g)
            report = session.sync(trainer)
            kinds.append(report.delta)
            assert all(holds(e, trainer.weights) == [] for e in engines)
            if report.delta == "patch":
                assert report.wire_bytes < 0.6 * report.dense_bytes
        assert kinds == ["seed", "patch", "patch", "patch"] and trainer.offers == 4
    finally:
        session.close()
