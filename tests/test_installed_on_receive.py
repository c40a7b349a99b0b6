"""What keeps a checked sync's extra work small (issue 42 item 5: a check <= 5 % of a dense sync):
the reference receiver answers an unstaged check in its receive's reply (no round trip of its own; a
staged one is asked after the swap), a rank's layout and a stable walk's keys are worked out once,
the trainer's folds of a stable walk run once its send went through, and reports travel as columns
(msgpack and JSON alike). The checks stay as strict: the same digests, a wrong tensor still named."""

from __future__ import annotations

import json
from typing import Any

import msgpack
import pytest
import torch

from ckpt_engine import CheckpointEngineConfig, SyncError, WeightSyncSession
from ckpt_engine.installed import InstalledReport, InstalledRequest, digest, region_view
from ckpt_engine.installed_held import HeldDigests
from ckpt_engine.planning.regions import ReceivePlan, Region
from ckpt_engine.rollout_adapters.torch_ref import TorchRefRollout
from ckpt_engine.sources.base import StateDictSource
from ckpt_engine.sync.installed import InstalledChecks
from refengines import holds, spawn_engine, state
from test_installed_checks import spawn_faulty

pytestmark = pytest.mark.timeout(300)

TIMEOUT_S = 20.0


def tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"wq": torch.randn(64, 32, generator=g).bfloat16(), "wo": torch.randn(32, 64, generator=g), "norm": torch.randn(32, generator=g)}


def test_reports_travel_as_columns_through_msgpack_and_json_and_bad_ones_are_refused() -> None:
    sliced = InstalledReport({("a", None): 3, ("b", Region(1, 2, 4)): -(1 << 63)}, ["buf"], ["w13 (why)"], ["c: missing"], 0.25)
    whole = InstalledReport({("a", None): 1, ("b", None): (1 << 63) - 1}, [], [])
    assert whole.to_wire()["regions"] is None  # every key whole: no column of Nones
    for rep in (sliced, whole):
        assert InstalledReport.from_wire(msgpack.unpackb(msgpack.packb(rep.to_wire()))) == rep
        assert InstalledReport.from_wire(json.loads(json.dumps(rep.to_wire()))) == rep
    good = sliced.to_wire()
    for change, what in (
        ({"digests": [3]}, "as long as digests"), ({"names": ["a", 7]}, "names must be a list of strings"),
        ({"digests": [3, True]}, "digests must be ints"), ({"digests": [3, "9"]}, "digests must be ints"),
        ({"regions": [None]}, "one per name"), ({"regions": [None, [1, 2]]}, r"\[dim, start, length\]"),
        ({"unwritten": "buf"}, "lists of strings"),
    ):
        with pytest.raises(ValueError, match=what):
            InstalledReport.from_wire({**good, **change})
    with pytest.raises(ValueError, match="a map of digests, names, regions"):
        InstalledReport.from_wire({"digests": [["a", None, 3]], "unwritten": [], "unchecked": []})  # rows: not this wire


def test_a_ranks_kept_layout_reads_the_live_values_and_follows_the_names() -> None:
    held = tensors(1)
    held["wq"] = held["wq"][:, 16:].contiguous()  # this rank holds columns 16:32 of wq
    regions = {"wq": Region(1, 16, 16)}
    ranks = HeldDigests(held, regions)
    for seed in (5, 6):
        report = ranks.report(InstalledRequest(["wq", "wo", "norm"], seed, 16))
        assert report.digests == {(n, regions.get(n)): int(digest(t, seed, 16)) for n, t in held.items()}
        assert report.unwritten == []
        held["wo"].add_(1.0)  # in place: the next check reads the new values
    report = ranks.report(InstalledRequest(["norm"], 7, 0))
    assert report.digests == {("norm", None): int(digest(held["norm"], 7, 0))} and report.unwritten == ["wo", "wq"]


@pytest.mark.parametrize("device", ["cpu"] + ([pytest.param("cuda", marks=pytest.mark.gpu)] if torch.cuda.is_available() else []))
def test_a_rank_folds_its_tensors_as_they_land_and_a_tensor_landing_again_is_read_again(device: str) -> None:
    """`HeldDigests.begin` (a receive starting): each bucket's tensors are folded once `landed`, a
    batch at a time; a tensor landing again after its batch was folded is read again (its last
    landing counts), a name the rank does not hold is passed over, a held tensor no load named is
    folded at the report (it holds what it held): the digests of what the rank holds at the end."""
    held = {f"w{i}": torch.randn(40, 24, generator=torch.Generator().manual_seed(i)).to(device) for i in range(20)}
    regions = {"w3": Region(0, 8, 40)}
    rank = HeldDigests(held, regions)
    request = InstalledRequest(sorted(held) + ["elsewhere"], 11, 32)
    for _ in range(2):  # the kept names and images serve the next check
        fold = rank.begin(request)
        for bucket in (["w0", "w1", "elsewhere"], ["w10", "w11", "w12"], ["w13"], ["w14", "w15", "w16", "w17"]):
            for n in bucket:
                if n in held:
                    held[n].add_(1.0)  # the loader writes, then the bucket has landed
            fold.landed(bucket)
        held["w0"].add_(1.0)
        fold.landed(["w0"])  # landed again, after its batch was read
        report = fold.report()
        assert report.digests == {(n, regions.get(n)): int(digest(t, 11, 32)) for n, t in held.items()}
        assert report.unwritten == [] and report.seconds > 0


def test_a_stable_walk_is_folded_when_asked_with_its_layout_kept_across_checks() -> None:
    """The trainer's side: noted as walked, folded by `fold_noted` (the send's end) as regions of
    the walked tensors at their wire dtype, the same at a later check with another seed; a walk
    released unfolded leaves nothing; an image no digest can fold fails at the compare, not the send."""
    walked = tensors(2)
    plans = [ReceivePlan({"wq": (Region(1, 0, 16),), "wo": None, "norm": None}), ReceivePlan({"wq": (Region(1, 16, 16),)})]
    wire = {"wq": "bfloat16", "wo": "bfloat16", "norm": "float32"}
    checks = InstalledChecks(1, 64, "warn")
    for _ in range(2):
        checks.arm([], list(walked), plans, 1, dtypes=wire)
        request = checks.request
        assert request is not None
        assert [n for n, _ in checks.tap(iter(walked.items()), stable=True)] == list(walked)
        checks.fold_noted()
        want = {
            (n, r): int(digest(region_view(t, r), request.seed, 64, getattr(torch, wire[n])))
            for n, t in walked.items() for r in ((Region(1, 0, 16), Region(1, 16, 16)) if n == "wq" else (None,))
        }
        assert checks.source_digests() == want
    checks.arm([], list(walked), plans, 1, dtypes=wire)
    list(checks.tap(iter(walked.items()), stable=True))
    checks.release()
    assert checks.source_digests() == {}
    checks.arm([], ["z"], [None], 1)
    list(checks.tap(iter([("z", torch.zeros(4, dtype=torch.complex64))]), stable=True))
    checks.fold_noted()  # never raises: the receives are in flight
    with pytest.raises(ValueError, match="no installed-weight digest for dtype torch.complex64"):
        checks.source_digests()


def test_a_long_stable_walk_of_regions_and_casts_is_folded_after_the_send_with_the_same_digests() -> None:
    """A stable walk of many tensors (whole and as a rank's region, one cast on the wire) is folded
    by `fold_noted`, read back by `source_digests`: the digests of each key; a walk released part-way
    leaves no digest behind."""
    walked = {f"w{i}": torch.randn(24, 16, generator=torch.Generator().manual_seed(i)).bfloat16() for i in range(30)}
    plans = [ReceivePlan({"w4": (Region(1, 0, 8),), "w5": None}), None]
    checks = InstalledChecks(1, 16, "warn")
    checks.arm([], list(walked), plans, 1, dtypes={n: "float32" if n == "w7" else "bfloat16" for n in walked})
    request = checks.request
    assert request is not None
    assert [n for n, _ in checks.tap(iter(walked.items()), stable=True)] == list(walked)
    checks.fold_noted()
    want = {(n, None): int(digest(t, request.seed, 16, torch.float32 if n == "w7" else None)) for n, t in walked.items()}
    want[("w4", Region(1, 0, 8))] = int(digest(region_view(walked["w4"], Region(1, 0, 8)), request.seed, 16))
    assert checks.source_digests() == want
    checks.arm([], list(walked), [None], 1)
    walk = checks.tap(iter(walked.items()), stable=True)
    for _ in range(10):
        next(walk)
    checks.release()
    assert checks.source_digests() == {}


class Calls(TorchRefRollout):
    """A reference receiver's handle that notes the engine methods it calls (the engine is real)."""

    calls: list[str]

    def _call(self, method: str, timeout_s: float | None = None, **params: Any) -> Any:
        self.calls = [*getattr(self, "calls", []), method]
        return super()._call(method, timeout_s, **params)


@pytest.mark.parametrize("stage", ["off", "full"])
def test_an_unstaged_check_rides_on_the_receive_and_a_staged_one_is_asked_after_the_swap(spec_file: str, stage: str) -> None:
    engine = spawn_engine("ride", spec_file=spec_file, timeout_s=TIMEOUT_S, handle=Calls)
    bad = spawn_faulty(spec_file, "bad", "transpose:fp32")
    try:
        cfg = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.0625, timeout_s=TIMEOUT_S, stage=stage, verify_installed=1)
        session = WeightSyncSession([engine], cfg)
        try:
            for i in range(3):
                engine.calls = []
                report = session.sync(StateDictSource(state(60 + i)))
                assert "installed_check" in report.seconds and holds(engine, state(60 + i)) == []
                assert ("installed" in engine.calls) == (stage == "full"), engine.calls
        finally:
            session.close()
        session = WeightSyncSession([engine, bad], cfg)
        try:
            with pytest.raises(SyncError) as info:
                session.sync(StateDictSource(state(70)))
            assert info.value.stage == "verify" and set(info.value.failed) == {"bad"}, str(info.value)
            assert "fp32" in info.value.failed["bad"] and "differ from the source" in info.value.failed["bad"], str(info.value)
        finally:
            session.close()
    finally:
        bad.close()
        engine.close()


def test_tp_ranks_holding_slices_answer_with_the_receive_and_pass(tmp_path: Any) -> None:
    """Two TP ranks of reference engines each hold their rows / columns of the projections (regions
    of the checkpoint tensors) and answer the check in the receive's reply: clean syncs pass."""
    from ckpt_engine.rollout_adapters.torch_ref import write_spec_file
    from ckpt_engine.sources.base import spec_of

    g = torch.Generator().manual_seed(4)
    p = "model.layers.0.self_attn"
    sd = {f"{p}.q_proj.weight": torch.randn(64, 32, generator=g), f"{p}.o_proj.weight": torch.randn(32, 64, generator=g), "model.norm.weight": torch.randn(32, generator=g)}
    path = tmp_path / "tp.msgpack"
    write_spec_file(path, [spec_of(n, t) for n, t in sd.items()])
    engines = [spawn_engine(f"tp{r}", spec_file=str(path), timeout_s=TIMEOUT_S, layout={"tp_size": 2, "tp_rank": r}, handle=Calls) for r in range(2)]
    try:
        assert all(e.receive_plans()[0].holds[f"{p}.q_proj.weight"] is not None for e in engines)  # type: ignore[union-attr]  # slices, not whole
        cfg = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.0625, timeout_s=TIMEOUT_S, stage="off", verify_installed=1, verify_installed_samples=16)
        session = WeightSyncSession(engines, cfg)
        try:
            for v in range(2):
                for e in engines:
                    e.calls = []
                report = session.sync(StateDictSource({n: t + v for n, t in sd.items()}))
                assert "installed_check" in report.seconds and not any("installed" in e.calls for e in engines)
        finally:
            session.close()
    finally:
        for e in engines:
            e.close()
