"""sync_rollout_weights end to end into reference receivers running in their own processes."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch

from ckpt_engine import CheckpointEngineConfig, SyncError, WeightSyncSession, sync_rollout_weights
from tamper import GlooEngine
from ckpt_engine import ManifestRejectedError
from ckpt_engine.rollout_adapters.torch_ref import TorchRefRollout, write_spec_file
from ckpt_engine.sync.api import cached_session, close_sessions
from ckpt_engine.sources.base import StateDictSource, WeightSource
from refengines import spawn_engine
from roundtrip import mixed_state, same_bits

CFG = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.0625, timeout_s=30)


@pytest.fixture(scope="module")
def spec_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("spec") / "spec.msgpack"
    write_spec_file(path, StateDictSource(mixed_state(0, num_small=300)).metadata())
    return str(path)


@pytest.fixture(scope="module")
def engines(spec_file: str) -> Iterator[list[TorchRefRollout]]:
    rs = [spawn_engine(f"ref{i}", spec_file=spec_file, timeout_s=60) for i in range(2)]
    yield rs
    close_sessions()  # sessions cached by sync_rollout_weights leave their groups first
    for r in rs:
        r.close()


@pytest.fixture(scope="module")
def session(engines: list[TorchRefRollout]) -> Iterator[WeightSyncSession]:
    s = WeightSyncSession(engines, CFG)
    yield s
    s.close()


def assert_holds(engine: TorchRefRollout, sd: dict[str, torch.Tensor], names: list[str] | None = None) -> None:
    for name in names if names is not None else list(sd):
        assert same_bits(engine.get_tensor(name), sd[name]), f"{engine.name}: {name} differs"


def test_two_syncs_land_bit_exact_and_reuse_the_group(session: WeightSyncSession, engines: list[TorchRefRollout]) -> None:
    sd0 = mixed_state(0, num_small=300)
    report = session.sync(StateDictSource(sd0), version=7)
    assert (report.version, report.tensors, report.engines) == (7, len(sd0), 2)
    assert report.bytes == sum(t.numel() * t.element_size() for t in sd0.values()) and report.buckets > 1
    assert {"plan", "validate", "transfer", "export", "pack", "load_max", "swap", "total"} <= set(report.seconds)
    assert report.staged == "full" and report.stall_s <= report.seconds["swap"]  # issue 28: staged by default, paused for the swap only (inside that step)
    for e in engines:
        assert_holds(e, sd0)
        h = e.health()
        assert (h["version"], h["paused"], h["stale"]) == (7, False, False)
    group_engine = session._group.engine
    sd1 = mixed_state(1, num_small=300)
    report = session.sync(StateDictSource(sd1))
    assert report.version == 8 and session._group.engine is group_engine  # same group, same buffers
    for e in engines:
        assert_holds(e, sd1, ["fp32", "big", "fp8", "scalar", "small.299"])
        assert e.health()["version"] == 8


def test_a_dtype_hint_is_given_once_however_many_tensors_need_it(session: WeightSyncSession, engines: list[TorchRefRollout]) -> None:
    before = mixed_state(5, num_small=300)
    session.sync(StateDictSource(before))
    doubled = {n: t.double() if t.dtype == torch.float32 else t for n, t in before.items()}
    wrong = sum(t.dtype == torch.float32 for t in before.values())
    assert wrong >= 3
    with pytest.raises(ManifestRejectedError) as info:
        session.sync(StateDictSource(doubled))
    text = str(info.value)
    assert f"({wrong * len(engines)} problems)" in text  # every tensor named (the message shows the first few)
    assert text.count("StateDictSource(..., dtype=torch.float32)") == 1, text  # the hint once, not once per tensor
    assert "the same fix as above" in text


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda sd: sd.__setitem__("not_in_engine", torch.zeros(2)), r"engines 'ref0', 'ref1' rejected the manifest: ref0: not_in_engine: the engine has no such tensor"),
        (lambda sd: sd.__setitem__("fp32", torch.zeros(33, 18)), r"fp32: shape \[33, 18\] but the engine holds \[33, 17\]"),
        (lambda sd: sd.__setitem__("int64", torch.zeros(129, dtype=torch.int32)), r"int64: dtype int32 but the engine holds int64; cast it to int64"),
        (lambda sd: sd.__setitem__("fp32", sd["fp32"].double()), r"fp32: dtype float64 but the engine holds float32; send it as float32: StateDictSource\(\.\.\., dtype=torch\.float32\)"),
    ],
)
def test_rejected_manifest_moves_nothing(session: WeightSyncSession, engines: list[TorchRefRollout], change, match: str) -> None:
    before = mixed_state(5, num_small=300)
    session.sync(StateDictSource(before))
    received = [e.health()["buckets_received"] for e in engines]
    bad = mixed_state(6, num_small=300)
    change(bad)
    with pytest.raises(ManifestRejectedError, match=match):
        session.sync(StateDictSource(bad))
    for e, n in zip(engines, received):
        h = e.health()
        assert h["buckets_received"] == n and not h["paused"] and not h["stale"]
        assert_holds(e, before, ["fp32", "int64", "big"])


def test_corrupt_manifest_is_refused_by_the_engine(engines: list[TorchRefRollout]) -> None:
    reply = engines[0].rpc.call("validate", encoded=b"\x93\x01garbage", digest="0" * 64)
    assert reply["accepted"] is False and "corrupt manifest" in reply["problems"][0]


def test_sync_rollout_weights_reuses_a_session_per_engine_list(engines: list[TorchRefRollout]) -> None:
    sd = mixed_state(2, num_small=300)
    r1 = sync_rollout_weights(StateDictSource(sd), engines, config=CFG)
    r2 = sync_rollout_weights(StateDictSource(sd), engines, config=CFG)
    assert r1 is not None and r2 is not None and r2.version == r1.version + 1
    assert_holds(engines[1], sd, ["bf16", "bool"])


class _Addressed(TorchRefRollout):
    """A handle that names its engine by address, as the vLLM and SGLang adapters do (URL, `LLM`)."""

    def engine_key(self) -> object:
        return ("ref", self.rpc.host, self.rpc.port)


def test_rebuilt_handles_keep_the_session_and_its_delta_chain(engines: list[TorchRefRollout]) -> None:
    """Handles rebuilt every step (as a trainer may) find the cached session by engine: the group
    stays and delta syncs keep patching (keyed by handle, every sync went dense: a new session)."""
    cfg = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.0625, timeout_s=30, delta="on")
    sd = mixed_state(8, num_small=300)
    kinds, sessions, old = [], set(), []
    try:
        for step in range(4):
            handles = [_Addressed(e.name, e.rpc.host, e.rpc.port, None, e.timeout_s, token=e.token) for e in engines]
            sd["fp32"][step] += 1.0  # a few words change per step
            report = sync_rollout_weights(StateDictSource(sd), handles, config=cfg)
            assert report is not None
            kinds.append(report.delta)
            sessions.add(id(cached_session(handles, cfg)))
            for e in engines:
                assert_holds(e, sd, ["fp32", "big", "small.7"])
            for h in old:
                h.close()  # the session drives the new handles now
            old = handles
        assert kinds == ["seed", "patch", "patch", "patch"] and len(sessions) == 1
    finally:
        close_sessions()
        for h in old:
            h.close()


class _WalkCounter(WeightSource):
    """A weight source that counts how often it is walked (a sharded trainer's gathers)."""

    is_sender = False

    def __init__(self, sd: dict[str, torch.Tensor]) -> None:
        self.inner, self.walked = StateDictSource(sd), 0

    def metadata(self):
        return self.inner.metadata()

    def iter_weights(self):
        for item in self.inner.iter_weights():
            self.walked += 1
            yield item


def test_non_sender_ranks_only_walk_the_source() -> None:
    src = _WalkCounter(mixed_state(0))
    assert sync_rollout_weights(src, None) is None
    assert src.walked == len(src.inner.weights)


class _CorruptingGloo(GlooEngine):
    """Flips one byte of bucket 1 after its checksum is computed (a link corrupting data)."""

    def _tamper_hook(self, bucket_index: int, message: torch.Tensor) -> None:
        if bucket_index == 1:
            message[3] ^= 0xFF


def test_checksum_mismatch_is_reported_as_such(spec_file: str) -> None:
    cfg = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.0625, timeout_s=20, verify=True, stage="off")
    engine = _CorruptingGloo(bucket_size_bytes=cfg.bucket_size_bytes, verify=True, timeout_s=20)
    r = spawn_engine("victim", spec_file=spec_file)
    session = WeightSyncSession([r], cfg, engine=engine)
    try:
        with pytest.raises(SyncError, match=r"victim: .*bucket 1 failed its checksum") as info:
            session.sync(StateDictSource(mixed_state(3, num_small=300)))
        assert info.value.stage == "transfer" and info.value.stale == ["victim"]
        assert r.health()["stale"] is True
    finally:
        session.close()
        r.close()


def test_receiver_killed_mid_sync_is_named_within_the_timeout(spec_file: str) -> None:
    timeout_s = 120.0  # far past the seconds the sync takes: an end within half of it is no wait of it, on any box
    cfg = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.0625, timeout_s=timeout_s, stage="off")
    slow = [spawn_engine(f"slow{i}", spec_file=spec_file, load_delay_s=0.2) for i in range(2)]
    session = WeightSyncSession(slow, cfg)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            session.sync(StateDictSource(mixed_state(4, num_small=300)))
        except BaseException as exc:
            errors.append(exc)

    try:
        session.sync(StateDictSource(mixed_state(0, num_small=300)))  # group built, version 1 everywhere
        t = threading.Thread(target=run)
        before = slow[1].health()["buckets_received"]
        start = time.monotonic()
        t.start()
        deadline = time.monotonic() + 20
        while slow[1].health()["buckets_received"] < before + 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        slow[1].process.kill()
        t.join(timeout_s / 2)
        assert not t.is_alive(), f"the sender still waits {time.monotonic() - start:.0f}s later: it hung or waits out its {timeout_s:g}s timeout"
        assert len(errors) == 1 and isinstance(errors[0], SyncError), errors
        assert "slow1" in errors[0].failed and "died" in errors[0].failed["slow1"]
        h = slow[0].health()
        assert h["version"] is None and h["stale"] is True  # the survivor holds no complete version, never serves a half-new state
    finally:
        session.close()
        for r in slow:
            r.close()


def test_bucket_larger_than_free_memory_is_refused_before_any_join(engines: list[TorchRefRollout]) -> None:
    cfg = CheckpointEngineConfig(backend="gloo", bucket_size_mb=1048576, timeout_s=30)
    session = WeightSyncSession(engines, cfg)
    try:
        with pytest.raises(ValueError, match=r"bucket_size_mb=1048576: 2 buffers need .* GiB but cpu has"):
            session.sync(StateDictSource(mixed_state(0, num_small=300)))
        assert session._group.engine is None  # nothing was allocated or joined
        assert all(not e.health()["paused"] for e in engines)
    finally:
        session.close()
