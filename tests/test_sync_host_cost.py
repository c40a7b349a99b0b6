"""Issue 39: a sync's per-tensor host work is done once per plan where its inputs allow, never at
the cost of a wrong plan or a wrong byte. Cached figures equal the recomputed ones; a check that is
not due builds nothing; a source whose tensors change shape, dtype or identity between syncs is
planned and sent afresh, bit-exact, through reference engines over a real gloo group."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from ckpt_engine import CheckpointEngineConfig, WeightSyncSession
from ckpt_engine.manifest import TensorSpec
from ckpt_engine.planning.buckets import plan_buckets
from ckpt_engine.rollout_adapters.base import ManifestRejectedError
from ckpt_engine.rollout_adapters.torch_ref import TorchRefRollout, write_spec_file
from ckpt_engine.sources.base import StateDictSource
from ckpt_engine.sources.layouts import Layout, layout_of
from ckpt_engine.sync.installed import InstalledChecks
from ckpt_engine.sync.weights_mode import WeightsModeCheck
from refengines import holds, serving, spawn_engine

pytestmark = pytest.mark.timeout(300)


def _specs() -> list[TensorSpec]:
    return [TensorSpec(f"t{i}", ("float32", "bfloat16", "int8")[i % 3], (i % 7 + 1, 33)) for i in range(60)]


def test_the_manifests_cached_figures_equal_the_recomputed_ones() -> None:
    m = plan_buckets(_specs(), 4096, num_senders=2)
    entries = [e for b in m.buckets for e in b.entries]
    for _ in range(2):  # the second read comes from the cache
        assert m.total_bytes == sum(e.chunk_size for e in entries) == sum(s.nbytes for s in _specs())
        assert m.num_tensors == len({e.name for e in entries}) == 60
        assert m.wire_bytes == sum(max(e.bucket_offset + e.chunk_size for e in b.entries) for b in m.buckets)
        per = m.bytes_per_sender()
        assert per == [sum(e.chunk_size for b in m.buckets if b.sender == s for e in b.entries) for s in range(2)]
        per.append(-1)  # the caller's own list: the manifest's figure does not change
    assert m.bytes_per_sender() == per[:2] and sum(per[:2]) == m.total_bytes


def test_a_check_that_is_not_due_arms_nothing_and_a_due_one_arms_the_manifests_names_and_wire_dtypes() -> None:
    m = plan_buckets(_specs(), 4096)
    checks = InstalledChecks(2, 64, "warn")  # due at the first sync (none completed), then every 2nd
    checks.arm_manifest([], m, [None], 1)
    assert checks.request is not None and checks.request.names == [s.name for s in m.specs]
    assert checks._dtypes == {s.name: getattr(torch, s.dtype) for s in m.specs}
    checks.completed = True
    checks.arm_manifest([], m, [None], 1)  # sync 2: due (2 % 2 == 0)
    assert checks.request is not None
    checks.arm_manifest([], m, [None], 1)  # sync 3: not due
    assert checks.request is None and checks._dtypes == {}
    other = plan_buckets(_specs()[:5], 4096)
    checks.arm_manifest([], other, [None], 1)  # sync 4, another plan: its own names
    assert checks.request is not None and checks.request.names == [s.name for s in other.specs]


def test_the_weights_mode_is_checked_again_whenever_the_specs_change() -> None:
    """A session scans its source's specs for the weights mode only when they differ from the last
    that passed; any other list is scanned and refused as the plain check refuses it."""
    from ckpt_engine.lora_format import ADAPTER_CONFIG

    check, specs = WeightsModeCheck(), _specs()
    adapter = [*specs, TensorSpec(ADAPTER_CONFIG, "uint8", (10,))]
    for _ in range(2):
        check("full", specs, [])
        check("full", list(specs), [])  # another list of the same specs
        with pytest.raises(ValueError, match="sends a LoRA adapter"):
            check("full", adapter, [])
        with pytest.raises(ValueError, match="does not send one LoRA adapter"):
            check("adapters", specs, [])


CFG = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.0625, timeout_s=20)


def _weights(seed: int) -> dict[str, torch.Tensor]:
    """Float32 tensors filling whole buckets of one dtype, one square matrix, and a bf16 tensor
    sharing a bucket with float32 ones."""
    g = torch.Generator().manual_seed(seed)
    sd = {f"e.{i}": torch.randn(64 + i, generator=g) for i in range(120)}
    sd["square"] = torch.randn(24, 24, generator=g)
    sd["half"] = torch.randn(300, generator=g).bfloat16()
    sd.update({f"tail.{i}": torch.randn(5, generator=g) for i in range(10)})
    return sd


@pytest.fixture
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TorchRefRollout]:
    path = tmp_path_factory.mktemp("spec") / "spec.msgpack"
    write_spec_file(path, StateDictSource(_weights(0)).metadata())
    e = spawn_engine("host-cost", spec_file=str(path), timeout_s=30)
    yield e
    e.close()


def test_a_source_whose_tensors_change_in_place_between_syncs_is_planned_and_sent_afresh(engine: TorchRefRollout) -> None:
    """One StateDictSource over the same tensor objects, synced again after each kind of change the
    sender's and the planner's per-plan records must notice: new values, a new object, a new layout
    of the same shape, a new dtype and a new shape in place (the last two: a fresh plan, refused
    by the engine by name before anything is paused)."""
    sd = _weights(1)
    src = StateDictSource(sd)
    session = WeightSyncSession([engine], CFG)
    try:
        assert any(len({e.dtype for e in b.entries}) == 1 and len(b.entries) > 1 for b in plan_buckets(src.metadata(), CFG.bucket_size_bytes).buckets)
        for step in range(2):  # the second sync takes the known tensors' path
            for n, t in _weights(2 + step).items():
                sd[n].copy_(t)
            session.sync(src)
            assert holds(engine, sd) == [], step
        src.weights["e.3"] = _weights(5)["e.3"]  # another object at the same name
        session.sync(src)
        assert holds(engine, src.weights) == []
        square = src.weights["square"]
        square.data = torch.randn(24, 24).t()  # the same object, now a transposed layout of the same shape
        session.sync(src)
        assert not square.is_contiguous() and holds(engine, src.weights) == []
        digest = session.manifest.digest  # type: ignore[union-attr]
        held = {n: t.clone() for n, t in src.weights.items()}
        bad = src.weights["e.7"]
        for change, undo in ((lambda: setattr(bad, "data", bad.data.double()), lambda: setattr(bad, "data", bad.data.float())),
                             (lambda: bad.resize_(bad.numel() + 1), lambda: bad.resize_(bad.numel() - 1))):
            change()
            with pytest.raises(ManifestRejectedError, match=r"e\.7"):
                session.sync(src)
            assert session.manifest.digest != digest  # type: ignore[union-attr]  # planned afresh
            assert serving(engine.health()) and holds(engine, held) == []
            undo()
            bad.add_(1)
            session.sync(src)
            assert session.manifest.digest == digest and holds(engine, src.weights) == []  # type: ignore[union-attr]
            held = {n: t.clone() for n, t in src.weights.items()}
    finally:
        session.close()


def test_a_state_dicts_layout_is_kept_only_while_torchs_check_of_every_tensor_passes() -> None:
    """New sources over one dict each sync (as a trainer loop makes them): from the second walk
    with the same specs the specs come from the kept layout (the same objects, no walk), and every
    kind of change walks again and reads the new specs and device."""
    sd = _weights(3)
    walked: list[int] = []

    def walk() -> Layout:
        walked.append(1)
        return StateDictSource(sd)._walk()

    for _ in range(4):
        layout_of(tuple(sd), list(sd.values()), "test", walk)
    assert len(walked) == 2  # the same specs twice, then torch's check alone
    sd["e.1"] = sd["e.1"].clone()
    layout_of(tuple(sd), list(sd.values()), "test", walk)
    assert len(walked) == 2  # a new tensor of the same layout: the same specs
    sd["e.1"].data = torch.zeros(3)
    layout_of(tuple(sd), list(sd.values()), "test", walk)
    assert len(walked) == 3
    walks = [StateDictSource(sd).metadata() for _ in range(3)]
    assert walks[0] == walks[1] == walks[2]
    kept = StateDictSource(sd)
    assert kept.metadata() == walks[0] and kept.device == torch.device("cpu")
    square = sd["square"]
    changes = [
        lambda: sd.__setitem__("e.3", torch.zeros(70)),  # another object, another shape
        lambda: setattr(square, "data", torch.zeros(12, 48)),  # in place: a new shape
        lambda: setattr(square, "data", square.data.double()),  # in place: a new dtype
        lambda: square.resize_(24, 25),  # in place: resized storage
        lambda: sd.__setitem__("square", torch.zeros(24, 25, device="meta")),  # another device (`.data =` refuses one)
    ]
    for change in changes:
        change()
        src = StateDictSource(sd)
        specs = {s.name: s for s in src.metadata()}
        assert [(n, s.dtype, s.shape) for n, s in specs.items()] == [(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in sd.items()]
        assert src.device == sd["square"].device  # the host, then the meta device (host tensors beside it)
    renamed = {f"x.{n}": t for n, t in sd.items()}
    assert [s.name for s in StateDictSource(renamed).metadata()] == list(renamed)
    cast = StateDictSource(sd, dtype=torch.bfloat16)
    assert {s.dtype for s in cast.metadata()} == {"bfloat16"}  # the wire dtype rule is part of the key


def test_a_reallocated_or_reshaped_tensor_after_kept_syncs_is_planned_afresh_and_lands_exactly(engine: TorchRefRollout) -> None:
    """The trainer loop's pattern: a new StateDictSource over one dict each sync. Once its layout is
    kept (three syncs), a re-allocated tensor of the same layout lands exactly on the kept plan; a
    new shape, by a new tensor or in place, is planned afresh and refused by the engine by name
    before anything is paused (it keeps serving what it held), and the next good sync lands exactly."""
    sd = _weights(4)
    session = WeightSyncSession([engine], CFG)
    try:
        for step in range(3):
            for n, t in _weights(5 + step).items():
                sd[n].copy_(t)
            session.sync(StateDictSource(sd))
            assert holds(engine, sd) == [], step
        digest = session.manifest.digest  # type: ignore[union-attr]
        sd["e.5"] = _weights(9)["e.5"].clone()  # re-allocated: same layout, new storage and values
        sd["square"].data = torch.randn(24, 24)  # re-allocated in place
        session.sync(StateDictSource(sd))
        assert session.manifest.digest == digest and holds(engine, sd) == []  # type: ignore[union-attr]
        held = {n: t.clone() for n, t in sd.items()}
        good = sd["e.8"]
        for bad in (torch.randn(good.numel() + 3), torch.randn(2, good.numel() // 2)):
            for in_place in (False, True):
                if in_place:
                    sd["e.8"] = good
                    good.data, saved = bad, good.data
                else:
                    sd["e.8"] = bad
                with pytest.raises(ManifestRejectedError, match=r"e\.8"):
                    session.sync(StateDictSource(sd))
                assert session.manifest.digest != digest  # type: ignore[union-attr]  # planned afresh
                assert serving(engine.health()) and holds(engine, held) == []
                if in_place:
                    good.data = saved
                sd["e.8"] = good
        good.add_(1)
        session.sync(StateDictSource(sd))
        assert session.manifest.digest == digest and holds(engine, sd) == []  # type: ignore[union-attr]
    finally:
        session.close()
