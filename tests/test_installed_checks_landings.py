"""Where checkpoint regions land in an engine's layout (issue 42 item 5, `vllm/installed.py`), on a toy
loader with no vLLM: the recorder follows a copy of a box into a view of a fused parameter and
refuses a transposed read (named, not guessed); the worker's digests of the fused parameter's views
equal the trainer's digests of the source tensors, whole and as a TP row slice assembled from two
boxes; a fault in one slot of the fused parameter moves exactly that tensor's digest; a layer whose
tensor is still on `meta` (its loader skipped it) has the name `missing`; a buffer no landing
writes is `unwritten`."""

from __future__ import annotations

import pytest
import torch

from ckpt_engine.installed import InstalledRequest, digest
from ckpt_engine.manifest import TensorSpec
from ckpt_engine.planning.regions import ReceivePlan, Region
from ckpt_engine.rollout_adapters.vllm.installed import InstalledCapture, LandingMap
from ckpt_engine.rollout_adapters.vllm.regions import PlanRecording, trace_loader

SPECS = {"q": TensorSpec("q", "float32", (4, 6)), "k": TensorSpec("k", "float32", (2, 6)), "o": TensorSpec("o", "float32", (6, 6)),
         "n": TensorSpec("n", "float32", (6,))}


def _layout(device: str) -> torch.nn.Module:
    model = torch.nn.Module()
    for name, shape in (("qkv", (6, 6)), ("o", (6, 6)), ("norm", (6,))):
        sub = torch.nn.Module()
        sub.weight = torch.nn.Parameter(torch.zeros(shape, device=device), requires_grad=False)
        model.add_module(name, sub)
    model.norm.register_buffer("stale", torch.ones(3, device=device))
    return model


def _record(model: torch.nn.Module, rows: bool = False) -> PlanRecording:
    """A loader in vLLM's manner: q and k into slots of a fused qkv (`rows`: the second TP rank's rows,
    each copied in two boxes), o read transposed, n whole."""
    rec = PlanRecording(SPECS)
    for path, module in model.named_modules():
        for attr, t in [*module._parameters.items(), *module._buffers.items()]:
            rec.targets[t.untyped_storage()._cdata] = (f"{path}.{attr}", t)

    def load(weights: object) -> None:
        for name, w in weights:  # type: ignore[attr-defined]
            if name == "q" and rows:
                model.qkv.weight.narrow(0, 0, 1).copy_(w.narrow(0, 2, 1))
                model.qkv.weight.narrow(0, 1, 1).copy_(w.narrow(0, 3, 1))
            elif name == "q":
                model.qkv.weight.narrow(0, 0, 4).copy_(w)
            elif name == "k":
                model.qkv.weight.narrow(0, 4, 2).copy_(w)
            elif name == "o":
                model.o.weight.copy_(w.t())
            else:
                model.norm.weight.copy_(w)

    return trace_loader(load, SPECS, rec)


def _source() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {n: torch.randn(s.shape, generator=g) for n, s in SPECS.items()}


def _loaded() -> tuple[dict[str, torch.Tensor], PlanRecording, torch.nn.Module]:
    """The source, the dry run's record, and a layout holding the source as the loader put it."""
    src = _source()
    rec = _record(_layout("meta"))
    model = _layout("cpu")
    with torch.no_grad():
        model.qkv.weight.copy_(torch.cat([src["q"], src["k"]]))
        model.norm.weight.copy_(src["n"])
    return src, rec, model


def test_landings_follow_fused_slots_and_name_a_transposed_read() -> None:
    rec = _record(_layout("meta"))
    assert sorted(la.name for la in rec.landings) == ["k", "n", "q"]
    assert "o" in rec.unfollowed and "not a box in C order" in rec.unfollowed["o"]
    k = next(la for la in rec.landings if la.name == "k")
    assert (k.target, k.sizes, k.offset) == ("qkv.weight", (2, 6), 24)


def test_the_worker_digests_views_of_the_fused_parameter_as_the_trainer_digests_the_source() -> None:
    src, rec, model = _loaded()
    layout = ["qkv.weight", "o.weight", "norm.weight", "norm.stale"]
    lmap = LandingMap(rec.landings, layout, rec.unfollowed, rec.touched, None)
    for samples in (0, 5):
        request = InstalledRequest(list(SPECS), seed=99, samples=samples)
        report = InstalledCapture(model, lmap, request).report()
        assert report.digests == {(n, None): int(digest(src[n], 99, samples)) for n in ("q", "k", "n")}
        assert report.unwritten == ["norm.stale"]
        assert [u.split(" ")[0] for u in report.unchecked] == ["o"]
    with torch.no_grad():
        model.qkv.weight[5, 5] += 1  # a fault in k's slot
    report = InstalledCapture(model, lmap, InstalledRequest(list(SPECS), seed=7, samples=0)).report()
    assert report.digests[("q", None)] == int(digest(src["q"], 7, 0))
    assert report.digests[("k", None)] != int(digest(src["k"], 7, 0))


def test_a_tp_row_slice_made_of_two_boxes_is_assembled_and_a_skipped_layer_is_missing() -> None:
    src = _source()
    rec = _record(_layout("meta"), rows=True)
    plan = ReceivePlan({"q": (Region(0, 2, 2),), "k": None, "n": None})
    model = _layout("cpu")
    with torch.no_grad():
        model.qkv.weight[:2].copy_(src["q"][2:])
        model.qkv.weight[4:].copy_(src["k"])
    model.norm.weight = torch.nn.Parameter(torch.empty(6, device="meta"), requires_grad=False)  # its loader never ran
    lmap = LandingMap(rec.landings, ["qkv.weight", "norm.weight"], rec.unfollowed, rec.touched, plan)
    report = InstalledCapture(model, lmap, InstalledRequest(["q", "k", "n"], seed=5, samples=3)).report()
    assert report.digests == {("q", Region(0, 2, 2)): int(digest(src["q"][2:], 5, 3)), ("k", None): int(digest(src["k"], 5, 3))}
    assert len(report.missing) == 1 and report.missing[0].startswith("n: norm.weight is not loaded")


def test_views_kept_across_checks_follow_a_parameter_the_engine_replaced() -> None:
    """The live views a check reads are kept from one check to the next; what a load wrote in place
    since is read, and a parameter replaced since (a reload, `param.data = ...`) is read where it now
    is, not where it was."""
    src, rec, model = _loaded()
    lmap = LandingMap(rec.landings, ["qkv.weight", "o.weight", "norm.weight"], rec.unfollowed, rec.touched, None)
    request = InstalledRequest(list(SPECS), seed=3, samples=4)
    assert InstalledCapture(model, lmap, request).report().digests[("n", None)] == int(digest(src["n"], 3, 4))
    kept = lmap.check(request.names).live(model, set())
    renewed = src["n"] + 1
    model.norm.weight = torch.nn.Parameter(renewed.clone(), requires_grad=False)  # a new tensor at a new address
    with torch.no_grad():
        model.qkv.weight[0, 0] += 1  # written in place, as a load does
        src["q"][0, 0] += 1
    report = InstalledCapture(model, lmap, request).report()
    assert report.digests == {(n, None): int(digest(t, 3, 4)) for n, t in (("q", src["q"]), ("k", src["k"]), ("n", renewed))}
    assert lmap.check(request.names).live(model, set()) is not kept


class _Readback:
    """`installed_kernel.Readback` on the host: the views' digests as they are when read back."""

    def __init__(self, views: list[torch.Tensor], seed: int, samples: int) -> None:
        self.views, self.seed, self.samples = views, seed, samples

    def values(self) -> list[int]:
        return [int(digest(v, self.seed, self.samples)) for v in self.views]


class _Folder:
    """`installed_kernel.Folder` on the host (the one-launch path runs on a GPU only)."""

    def __init__(self, views: list[torch.Tensor]) -> None:
        self.views = views

    def launch_behind(self, seed: int, samples: int) -> _Readback:
        return _Readback(self.views, seed, samples)

    def fold(self, seed: int, samples: int) -> list[int]:
        return _Readback(self.views, seed, samples).values()


def test_a_worker_told_the_source_digests_answers_agreed_and_its_digests_where_one_differs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The one-launch fold launched behind the copies, then told the source's digests (`expect`, in
    the receive's last call): the report compares them as it reads its own back and answers
    `agreed` without digests; a byte changed after the launch, or source digests of other keys,
    and it answers its digests for the controller to compare, naming the tensor."""
    from ckpt_engine.installed import InstalledReport, agreeing
    from ckpt_engine.rollout_adapters.vllm.installed import LiveImages

    monkeypatch.setattr(LiveImages, "on_gpu", lambda self: True)
    monkeypatch.setattr(LiveImages, "folder", lambda self: _Folder(self.views))
    src, rec, model = _loaded()
    lmap = LandingMap(rec.landings, ["qkv.weight", "norm.weight"], rec.unfollowed, rec.touched, None)
    names = ["q", "k", "n"]
    for fault in (None, "byte", "keys"):
        request = InstalledRequest(names, seed=11, samples=4)
        source = InstalledReport({(n, None): int(digest(src[n], 11, 4)) for n in (names[::-1] if fault == "keys" else names)}).to_wire()
        capture = InstalledCapture(model, lmap, request)
        capture.launch()
        capture.expect(source)
        kept = model.qkv.weight.clone()
        if fault == "byte":
            with torch.no_grad():
                model.qkv.weight[5, 5] += 1  # in k's slot, after the launch: read back as it is now
        report = capture.report()
        wire = report.to_wire()
        if fault is None:
            assert report.agreed and report.digests == {} and wire["agreed"] is True and agreeing(wire, source) is True
            assert InstalledReport.from_wire(wire).within({})  # the controller takes it as agreed
            continue
        assert not report.agreed and "agreed" not in wire
        assert report.digests == {(n, None): int(digest(model.qkv.weight[4:] if n == "k" else src[n], 11, 4)) for n in names}
        assert InstalledReport.from_wire(wire).agrees(InstalledReport.from_wire(source)) is (fault == "keys")
        with torch.no_grad():
            model.qkv.weight.copy_(kept)
