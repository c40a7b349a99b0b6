"""On a GPU both sides of an installed-weight check fold in one launch (issue 42 item 5): the
reference receiver's rank folds every tensor it holds once the last one landed (`HeldLaunch`), and
again at its report if one lands after that; the trainer folds a stable walk's tensors in one launch
after its send (`InstalledChecks.fold_noted`). Their digests must equal `installed.digest` key by key
(several element widths, a region held as its own tensor, a view of a region on the trainer's side),
a tensor written again after the launch counts as last written, and a loader that transposes a
tensor or skips one must still fail the compare by name. Each case 3 times.

    .venv/bin/python -m pytest -m gpu tests/test_installed_gpu_one_launch.py -q
"""

from __future__ import annotations

import concurrent.futures as cf

import pytest
import torch

from ckpt_engine.installed import InstalledReport, InstalledRequest, digest, region_view
from ckpt_engine.installed_held import HeldDigests, HeldLaunch
from ckpt_engine.planning.regions import ReceivePlan, Region
from ckpt_engine.rollout_adapters.capabilities import EngineCapabilities
from ckpt_engine.sync.installed import InstalledChecks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

REPEAT = 3
SAMPLES = 512
QKV = Region(0, 64, 128)
"""The rows of `qkv` the engine rank holds (a TP slice of a fused tensor)."""


def source(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(1000, 64, generator=g).bfloat16(),
        "qkv.weight": torch.randn(192, 64, generator=g).bfloat16(),
        "norm.weight": torch.randn(64, generator=g),  # fp32: a second element width
        "tiny.bias": torch.randn(3, generator=g).bfloat16(),  # fewer elements than samples
    }


class Rank:
    """A reference-receiver rank on the GPU: `receive` writes the source's tensors the way its
    loaders do, telling the check what landed (`fault` plants one; "again": a tensor first written
    wrong, then right after every tensor landed), its report comes from `HeldDigests` after the loads."""

    capabilities = EngineCapabilities(installed=True)
    timeout_s = None  # `RolloutAdapter.timeout_s`: calls bound by the session's pool

    def __init__(self, name: str, held: dict[str, torch.Tensor], regions: dict[str, Region | None]) -> None:
        self.name, self.held, self.held_digests = name, held, HeldDigests(held, regions)
        self.report: InstalledReport | None = None

    def receive(self, request: InstalledRequest, new: dict[str, torch.Tensor], fault: str | None) -> None:
        check = self.held_digests.begin(request)
        assert isinstance(check, HeldLaunch)  # on a GPU: one launch over every tensor
        for name, t in new.items():
            src = region_view(t, QKV) if name == "qkv.weight" else t
            if fault == "transpose" and name == "embed.weight":
                src = src.t().contiguous().view(src.shape)
            if fault == "again" and name == "embed.weight":
                src = torch.zeros_like(src)
            if not (fault == "skip" and name == "embed.weight"):
                self.held[name].copy_(src)
            check.landed([name, "not.held"])
        if fault == "again":  # after the launch: the last landing counts
            self.held["embed.weight"].copy_(new["embed.weight"])
            check.landed(["embed.weight"])
        self.report = check.report()

    def installed_digests(self, request: InstalledRequest) -> list[InstalledReport]:
        assert self.report is not None
        return [self.report]


@pytest.mark.parametrize("rep", range(REPEAT))
@pytest.mark.parametrize("fault", [None, "again", "transpose", "skip"])
def test_one_launch_folds_on_both_sides_agree_and_catch_a_fault(fault: str | None, rep: int) -> None:
    old = {n: t.cuda() for n, t in source(1000 + rep).items()}
    new = {n: t.cuda() for n, t in source(rep).items()}
    held = {n: (region_view(t, QKV) if n == "qkv.weight" else t).clone() for n, t in old.items()}
    rank = Rank("gpu-ref", held, {"qkv.weight": QKV})
    plan = ReceivePlan({n: (QKV,) if n == "qkv.weight" else None for n in new})
    checks = InstalledChecks(1, SAMPLES, "warn")
    checks.arm([rank], list(new), [plan], 1)  # type: ignore[list-item]
    request = checks.request
    assert request is not None
    for _ in checks.tap(iter(new.items()), stable=True):  # a stable walk: folded after the send
        pass
    rank.receive(request, new, fault)
    checks.fold_noted()
    with cf.ThreadPoolExecutor(1) as pool:
        expected = checks.source_digests()
        failed = checks.verify(pool, [rank], 60.0)  # type: ignore[list-item]
    keys = {(n, QKV if n == "qkv.weight" else None) for n in new}
    assert set(expected) == keys
    for name, region in keys:
        assert expected[(name, region)] == int(digest(region_view(new[name], region), request.seed, SAMPLES)), name
    assert rank.report is not None and set(rank.report.digests) == keys
    if fault in (None, "again"):
        assert failed == {}, failed
        assert rank.report.digests == expected
    else:
        assert set(failed) == {"gpu-ref"}, failed
        assert "embed.weight" in failed["gpu-ref"] and "differ from the source" in failed["gpu-ref"], failed
        assert "qkv.weight" not in failed["gpu-ref"] and "norm.weight" not in failed["gpu-ref"], failed


def test_a_tensor_cast_on_the_wire_is_folded_as_the_wire_carries_it_on_a_gpu() -> None:
    """A source tensor of another dtype than the wire's is not one the kernel reads as sent: the
    trainer folds it by torch ops (cast words), the others in one launch; all equal `digest`."""
    new = {n: t.cuda() for n, t in source(7).items()}
    checks = InstalledChecks(1, SAMPLES, "warn")
    checks.arm([], list(new), [None], 1, dtypes={"embed.weight": "bfloat16", "qkv.weight": "bfloat16", "norm.weight": "bfloat16", "tiny.bias": "bfloat16"})
    request = checks.request
    assert request is not None
    for _ in checks.tap(iter(new.items()), stable=True):
        pass
    checks.fold_noted()
    got = checks.source_digests()
    assert got == {(n, None): int(digest(t, request.seed, SAMPLES, torch.bfloat16)) for n, t in new.items()}


@pytest.mark.parametrize("rep", range(REPEAT))
@pytest.mark.parametrize("fault", [None, "transpose"])
def test_a_source_noted_ahead_and_folded_first_by_verify_is_checked(fault: str | None, rep: int) -> None:
    """A stable source noted before the stream (`fold_ahead`) is folded at the engine's receive
    (`expected_report`) where the engine checks there; a staged sync swaps after the stream, so no
    receive asks and `verify` folds it first, after taking the armed request: the fold must keep the
    armed check's seed (it asserted on the request here, failing every staged checked colocated sync
    into vLLM on a GPU), agree on a clean sync and name a transposed tensor."""
    from ckpt_engine.sources.base import StateDictSource

    whole = [n for n in source(0) if n != "qkv.weight"]  # whole tensors only: `Rank` writes qkv as a region
    old = {n: source(2000 + rep)[n].cuda() for n in whole}
    new = {n: source(rep)[n].cuda() for n in whole}
    rank = Rank("gpu-ref", {n: t.clone() for n, t in old.items()}, {})
    checks = InstalledChecks(1, SAMPLES, "warn")
    checks.arm([rank], list(new), [None], 1)  # type: ignore[list-item]
    request = checks.request
    assert request is not None
    checks.fold_ahead(StateDictSource(new))
    assert checks.ahead
    rank.receive(request, new, fault)
    checks.sent()  # the stream's end leaves a source noted ahead to its receive, which never asks here
    with cf.ThreadPoolExecutor(1) as pool:
        failed = checks.verify(pool, [rank], 60.0)  # type: ignore[list-item]
    expected = checks.source_digests()
    assert expected == {(n, None): int(digest(t, request.seed, SAMPLES)) for n, t in new.items()}
    if fault is None:
        assert failed == {}, failed
    else:
        assert set(failed) == {"gpu-ref"} and "embed.weight" in failed["gpu-ref"], failed
