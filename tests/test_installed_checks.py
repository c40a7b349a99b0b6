"""Installed-weight checks (issue 42 item 5, `checkpoint_engine.verify_installed`): every engine
rank digests what it installed and the trainer the same from the source; planted faults in real
reference-receiver processes (a loader that transposes, one that skips a tensor, a buffer of the
engine's layout no sync writes) fail the sync by tensor and engine and leave that engine out of
service, each case 3 times, staged and not; clean syncs, TP slices with receive plans included,
pass. The digest itself: exact, layout-blind, and sensitive to the faults it is for."""

from __future__ import annotations

import logging
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ckpt_engine import CheckpointEngineConfig, SyncError, WeightSyncSession
from ckpt_engine.config import ConfigError
from ckpt_engine.installed import InstalledReport, InstalledRequest, digest
from ckpt_engine.planning.regions import Region
from ckpt_engine.rollout_adapters.torch_ref import serve
from ckpt_engine.rollout_adapters.torch_ref import TorchRefRollout, write_spec_file
from ckpt_engine.sources.base import StateDictSource, spec_of
from helpers_procs import fork_program
from refengines import holds, spawn_engine, state

pytestmark = pytest.mark.timeout(600)

REPEAT = 3
TIMEOUT_S = 20.0


def cfg(stage: str = "off", **kw: object) -> CheckpointEngineConfig:
    return CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.0625, timeout_s=TIMEOUT_S, stage=stage, **kw)  # type: ignore[arg-type]


def spawn_faulty(spec_file: str, name: str, fault: str) -> TorchRefRollout:
    token = secrets.token_hex(16)
    argv = [fault, "--spec-file", spec_file, "--port", "0"]
    program = fork_program("_faulty_ref:main", argv, f"engine-{name}", env={serve.TOKEN_ENV: token})
    line = program.read_line(serve.READY_PREFIX, 60)
    assert line is not None, f"faulty engine {name} did not start"
    return TorchRefRollout(name, "127.0.0.1", int(line[len(serve.READY_PREFIX):].strip()), program.process, TIMEOUT_S, token=token)


@pytest.fixture
def healthy(spec_file: str) -> Iterator[TorchRefRollout]:
    e = spawn_engine("good", spec_file=spec_file, timeout_s=TIMEOUT_S)
    yield e
    e.close()


# --- the digest ---------------------------------------------------------------------------------


@pytest.mark.parametrize("samples", [0, 64])
def test_the_digest_is_the_same_for_a_view_and_its_copy_and_moves_with_any_fault(samples: int) -> None:
    g = torch.Generator().manual_seed(1)
    t = torch.randn(96, 80, generator=g).bfloat16()
    for seed in (0, 12345):
        ref = int(digest(t, seed, samples))
        assert int(digest(t.t().contiguous().t(), seed, samples)) == ref  # layout-blind: C order of the logical tensor
        region = Region(1, 16, 32)
        assert int(digest(t.narrow(1, 16, 32), seed, samples)) == int(digest(t.narrow(1, 16, 32).contiguous(), seed, samples))
        assert int(digest(t.t().contiguous().view(t.shape), seed, samples)) != ref, "a transpose"
        tail = t.clone()
        tail.view(-1)[-1] += 1
        assert int(digest(tail, seed, samples)) != ref, "the last element (always read)"
        assert region.length == 32
    for dtype in (torch.float32, torch.float16, torch.int64, torch.int8, torch.bool, torch.float8_e4m3fn):
        x = torch.randn(300, generator=g).to(dtype) if dtype != torch.bool else torch.rand(300, generator=g) > 0.5
        assert int(digest(x, 7, samples)) == int(digest(x.clone(), 7, samples))


@pytest.mark.parametrize("samples", [0, 64])
def test_a_source_cast_on_the_wire_is_folded_as_the_wire_carries_it(samples: int) -> None:
    """`StateDictSource(..., dtype=)` walks fp32 masters and sends bf16 (or bf16 sent as fp32): the
    trainer's fold of the walked tensor as the wire dtype equals the engine's of what it holds."""
    from ckpt_engine.sync.installed import InstalledChecks

    g = torch.Generator().manual_seed(3)
    walked = {"w": torch.randn(96, 80, generator=g), "b": torch.randn(80, generator=g).bfloat16()}
    wire = {"w": torch.bfloat16, "b": torch.float32}
    held = {n: t.to(wire[n]) for n, t in walked.items()}
    checks = InstalledChecks(1, samples, "warn")
    checks.arm([], list(walked), [None], 1, dtypes={n: str(d).removeprefix("torch.") for n, d in wire.items()})
    assert checks.request is not None
    list(checks.tap(iter(walked.items())))
    folded = checks.source_digests()
    for n, t in held.items():
        assert folded[(n, None)] == int(digest(t, checks.request.seed, samples)), n
        assert int(digest(walked[n], checks.request.seed, samples)) != int(digest(t, checks.request.seed, samples)), n  # as walked: differs


def test_a_half_written_tensor_is_caught_by_the_sampled_digest_whatever_the_seed() -> None:
    t = torch.randn(1 << 20)
    half = t.clone()
    half[len(t) // 2 :] = 0  # a copy that raced its reader: the second half never landed
    for seed in range(20):
        assert int(digest(half, seed, 4096)) != int(digest(t, seed, 4096))


def test_requests_and_reports_round_trip_and_bad_ones_are_refused() -> None:
    req = InstalledRequest(["a", "b"], 5, 0)
    assert InstalledRequest.from_wire(req.to_wire()) == req
    for bad in ({"names": "a", "seed": 1, "samples": 1}, {"names": [], "seed": -1, "samples": 1}, {"names": []}):
        with pytest.raises(ValueError):
            InstalledRequest.from_wire(bad)
    rep = InstalledReport({("a", None): 3, ("b", Region(0, 2, 4)): -9}, ["buf"], ["w13"])
    assert InstalledReport.from_wire(rep.to_wire()) == rep


def test_an_engine_rank_agrees_with_the_source_only_on_equal_digests_and_nothing_missing_or_unwritten() -> None:
    """What a vLLM worker told the source's digests decides before it finalizes in its receive's last
    call (`vllm/worker.py` `agrees`, on the wire forms): its digests a subset of the source's, nothing missing."""
    from ckpt_engine.rollout_adapters.vllm.worker import agrees

    source = InstalledReport({("a", None): 3, ("b", Region(0, 2, 4)): -9, ("b", Region(0, 0, 2)): 7})
    mine = InstalledReport({("a", None): 3, ("b", Region(0, 2, 4)): -9}, unchecked=["w13"])  # its slice; unchecked: named, not refused
    assert mine.agrees(source) and agrees(mine.to_wire(), source.to_wire())
    for differs in (
        InstalledReport({("a", None): 4}),  # a wrong digest
        InstalledReport({("a", None): 3, ("c", None): 1}),  # a key the source has not got
        InstalledReport({("a", None): 3}, missing=["b"]),  # sent, not installed
    ):
        assert not differs.agrees(source) and not agrees(differs.to_wire(), source.to_wire())
    # tensors no sync writes (vLLM's attention scales) fail a check only with unwritten_tensors: error,
    # where the controller sends no digests ahead: they do not keep a rank from finalizing
    assert InstalledReport({("a", None): 3}, unwritten=["attn._k_scale"]).agrees(source)
    assert not agrees(None, source.to_wire())  # no report rode on the receive: finalized apart


def test_reports_of_the_same_keys_compare_as_columns_and_an_agreed_one_carries_no_digests() -> None:
    """A worker's report and the source's list the same keys at every check: `agreeing` compares the
    columns (None where only reading them says), `from_wire` reuses the last report's keys (not
    fooled by a caller changing its lists after), and a report whose rank agreed is read without
    its digests and passes the compare, still naming what it left unchecked or missing."""
    from ckpt_engine.installed import _KEYS, agreeing

    source = InstalledReport({("a", None): 3, ("b", Region(0, 2, 4)): -9})
    same = InstalledReport({("a", None): 3, ("b", Region(0, 2, 4)): -9}, unchecked=["w13"])
    assert agreeing(same.to_wire(), source.to_wire()) is True
    assert agreeing(InstalledReport({("a", None): 4, ("b", Region(0, 2, 4)): -9}).to_wire(), source.to_wire()) is False
    assert agreeing(InstalledReport({("a", None): 3}, missing=["b"]).to_wire(), source.to_wire()) is False
    reordered = InstalledReport({("b", Region(0, 2, 4)): -9, ("a", None): 3}).to_wire()
    assert agreeing(reordered, source.to_wire()) is None and InstalledReport.from_wire(reordered).agrees(source)
    wire = source.to_wire()
    assert InstalledReport.from_wire(wire) == source
    wire["names"][0] = "z"  # the caller's list, changed after it was read
    assert InstalledReport.from_wire(source.to_wire()) == source
    assert InstalledReport.from_wire(wire).digests == {("z", None): 3, ("b", Region(0, 2, 4)): -9}
    InstalledReport.from_wire(source.to_wire())
    light = InstalledReport.from_wire(same.to_wire(), agreed=True)
    assert light.agreed and light.digests == {} and light.unchecked == ["w13"] and light.agrees(source)
    assert _KEYS[0] is not None and _KEYS[0][0] == ["a", "b"]  # an agreed report leaves the last full one's keys kept
    assert not InstalledReport.from_wire(InstalledReport(missing=["b"]).to_wire(), agreed=True).agrees(source)
    with pytest.raises(ValueError):
        InstalledReport.from_wire({"names": [], "regions": None, "digests": [], "unwritten": "x", "unchecked": []}, agreed=True)


def test_the_config_keys_are_checked() -> None:
    assert cfg().verify_installed == "first"
    assert cfg(verify_installed=False).verify_installed == "off"
    assert cfg(verify_installed=3).verify_installed == 3
    for bad in ({"verify_installed": 0}, {"verify_installed": "always"}, {"verify_installed_samples": -1}, {"unwritten_tensors": "ignore"}):
        with pytest.raises(ConfigError):
            cfg(**bad)


# --- planted faults in real engines ---------------------------------------------------------------


@pytest.mark.parametrize("stage", ["off", "auto"])
@pytest.mark.parametrize("fault", ["transpose:fp32", "skip:bf16"])
def test_a_faulty_loader_fails_the_sync_by_tensor_and_engine_and_leaves_it_out_of_service(
    spec_file: str, healthy: TorchRefRollout, fault: str, stage: str
) -> None:
    bad = spawn_faulty(spec_file, "bad", fault)
    tensor = fault.split(":")[1]
    try:
        for i in range(REPEAT):
            session = WeightSyncSession([healthy, bad], cfg(stage))
            try:
                with pytest.raises(SyncError) as info:
                    session.sync(StateDictSource(state(10 + i)))
                err = info.value
                assert err.stage == "verify" and set(err.failed) == {"bad"}, str(err)
                assert tensor in err.failed["bad"] and "differ from the source" in err.failed["bad"], str(err)
                assert "bad" in err.stale
                h = bad.health()
                assert h["paused"], h  # out of service
                assert stage != "off" or (h["stale"] and h["version"] is None), h
            finally:
                session.close()
    finally:
        bad.close()


class ReusedBuffer(StateDictSource):
    """Yields every tensor through one buffer it overwrites for the next (a gather's staging
    buffer): not stable, so the check must fold each tensor as it passes."""

    stable_tensors = False

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        buffer = torch.empty(max(t.numel() * t.element_size() for t in self.weights.values()), dtype=torch.uint8)
        for name, t in self.weights.items():
            view = buffer[: t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            view.copy_(t)
            yield name, view


def test_a_walk_of_temporaries_is_folded_as_it_passes_and_still_catches_a_fault(spec_file: str, healthy: TorchRefRollout) -> None:
    """Stable walks are folded after the stream (`InstalledChecks.verify`); a walk whose tensors are
    gone at the next is folded as it passes: clean syncs through one reused buffer pass, and a
    loader that transposes still fails the sync by tensor and engine."""
    bad = spawn_faulty(spec_file, "bad", "transpose:fp32")
    try:
        for i in range(REPEAT):
            session = WeightSyncSession([healthy], cfg())
            try:
                report = session.sync(ReusedBuffer(state(40 + i)))
                assert "installed_check" in report.seconds and holds(healthy, state(40 + i)) == []
            finally:
                session.close()
            session = WeightSyncSession([healthy, bad], cfg())
            try:
                with pytest.raises(SyncError) as info:
                    session.sync(ReusedBuffer(state(50 + i)))
                assert info.value.stage == "verify" and set(info.value.failed) == {"bad"}, str(info.value)
                assert "fp32" in info.value.failed["bad"] and "differ from the source" in info.value.failed["bad"], str(info.value)
            finally:
                session.close()
    finally:
        bad.close()


def test_checks_off_let_the_same_fault_through_and_every_nth_sync_is_checked(spec_file: str, healthy: TorchRefRollout) -> None:
    bad = spawn_faulty(spec_file, "bad", "transpose:fp32")
    try:
        session = WeightSyncSession([healthy, bad], cfg(verify_installed="off"))
        try:
            session.sync(StateDictSource(state(1)))  # what the check is for: the wire was fine, the loader was not
            assert holds(bad, state(1)) == ["fp32"]
        finally:
            session.close()
        session = WeightSyncSession([healthy], cfg(verify_installed=2))
        try:
            for i in range(4):
                session.sync(StateDictSource(state(20 + i)))
        finally:
            session.close()
    finally:
        bad.close()


@pytest.mark.parametrize("stage", ["off", "auto"])
def test_clean_syncs_pass_the_check_whole_and_as_tp_slices(spec_file: str, tmp_path: Path, stage: str) -> None:
    g = torch.Generator().manual_seed(3)
    sd = {"wq": torch.randn(64, 32, generator=g), "wo": torch.randn(32, 64, generator=g), "norm": torch.randn(32, generator=g)}
    path = tmp_path / "tp.msgpack"
    write_spec_file(path, [spec_of(n, t) for n, t in sd.items()])
    engines = [spawn_engine(f"tp{r}", spec_file=str(path), timeout_s=TIMEOUT_S, layout={"tp_size": 2, "tp_rank": r}) for r in range(2)]
    try:
        for i in range(REPEAT):
            session = WeightSyncSession(engines, cfg(stage, verify_installed=1, verify_installed_samples=16))
            try:
                for v in range(2):
                    session.sync(StateDictSource({n: t + i + v for n, t in sd.items()}))
            finally:
                session.close()
    finally:
        for e in engines:
            e.close()


@pytest.mark.parametrize("mode", ["warn", "error"])
def test_a_buffer_no_sync_writes_is_named_at_the_first_sync(healthy: TorchRefRollout, tmp_path: Path, mode: str, caplog: pytest.LogCaptureFixture) -> None:
    sd = state(0)
    path = tmp_path / "with_buffer.msgpack"
    write_spec_file(path, [*StateDictSource(sd).metadata(), spec_of("rotary.inv_freq", torch.zeros(16))])
    stale = spawn_engine("stale", spec_file=str(path), timeout_s=TIMEOUT_S)
    try:
        for i in range(REPEAT):
            session = WeightSyncSession([healthy, stale], cfg(unwritten_tensors=mode))
            try:
                with caplog.at_level(logging.WARNING, logger="ckpt_engine.sync.installed"):
                    if mode == "error":
                        with pytest.raises(SyncError) as info:
                            session.sync(StateDictSource(state(30 + i)))
                        assert set(info.value.failed) == {"stale"} and "rotary.inv_freq" in info.value.failed["stale"], str(info.value)
                    else:
                        session.sync(StateDictSource(state(30 + i)))
                        assert "rotary.inv_freq" in caplog.text and "'stale'" in caplog.text
            finally:
                session.close()
            caplog.clear()
    finally:
        stale.close()
