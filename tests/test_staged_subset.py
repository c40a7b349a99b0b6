"""A sync whose source carries only some of the engine's tensors (frozen tensors left out, a name
filter, a one-layer sync) into reference engines in their own processes (issue 45, item 1): the
tensors it leaves out keep their bits exactly, staged or not, and a staged dense sync's staging
copy holds (and `staging_room` was asked for) only the tensors the manifest carries.

Before the fix a staged dense subset copied a staging copy of *every* live tensor in at the swap:
the first one wrote uninitialised memory over the tensors it did not carry, a later one the
version the copy held from an earlier staged sync (after a staged seed and a staged patch: the
version before last)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import pytest
import torch

from ckpt_engine import CheckpointEngineConfig, WeightSyncSession
from ckpt_engine.rollout_adapters.torch_ref import TorchRefRollout, write_spec_file
from ckpt_engine.sources.base import StateDictSource
from multisender import model_state, wire
from refengines import holds, spawn_engine
from roundtrip import same_bits

DEFAULTS = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.0625, timeout_s=30)
"""The defaults a user gets: `delta: off`, `stage: auto`."""
SUBSET = ("wide", "small.3")
"""What the trainer syncs: 2 of the engine's tensors (its trainable ones, say)."""


def version(v: int) -> dict[str, torch.Tensor]:
    return wire(model_state(v, lr=1e-3))


def subset(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: sd[n] for n in SUBSET}


def nbytes(sd: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())


@pytest.fixture(scope="module")
def spec_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("subset") / "spec.msgpack"
    write_spec_file(path, StateDictSource(version(0)).metadata())
    return str(path)


@pytest.fixture
def spawn(spec_file: str) -> Iterator[Callable[[int | None], TorchRefRollout]]:
    """Fresh engines (forked: milliseconds) with a staging budget (None: the free memory decides)."""
    started: list[TorchRefRollout] = []

    def make(budget_bytes: int | None) -> TorchRefRollout:
        started.append(spawn_engine(f"subset{len(started)}", spec_file=spec_file, timeout_s=60, staging_budget_bytes=budget_bytes))
        return started[-1]

    yield make
    for e in started:
        e.close()


def _load(engine: TorchRefRollout, sd: dict[str, torch.Tensor]) -> None:
    """The engine holds `sd` as one loaded from a checkpoint would (a sync that is not staged)."""
    session = WeightSyncSession([engine], dataclasses.replace(DEFAULTS, stage="off"))
    try:
        assert session.sync(StateDictSource(sd)).staged == "off"
    finally:
        session.close()
    assert holds(engine, sd) == []


def _differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], names: list[str]) -> list[str]:
    return [n for n in names if not same_bits(a[n], b[n])]


@pytest.mark.parametrize("stage", ["auto", "off"])
def test_a_subset_sync_under_the_defaults_leaves_the_tensors_it_does_not_carry_their_bits(
    spawn: Callable[[int | None], TorchRefRollout], stage: str,
) -> None:
    """The engine (room for a staging copy of the subset, not of the model) holds v1; two syncs send
    2 of its tensors (v2, then v3): staged under the defaults (`full`, room asked for the subset
    only) or not (`stage: off`, the parity case), the other tensors keep v1's bits and the subset
    is the last sync's. Staged, the staging copy holds the subset's bytes, no more."""
    assert DEFAULTS.delta == "off" and DEFAULTS.stage == "auto"
    v1 = version(1)
    budget = 2 * nbytes(subset(v1))
    assert budget < nbytes(v1) // 2  # a staging copy of the model would not fit
    engine = spawn(budget)
    _load(engine, v1)
    untouched = [n for n in v1 if n not in SUBSET]
    session = WeightSyncSession([engine], dataclasses.replace(DEFAULTS, stage=stage))
    try:
        for v in (2, 3):
            sent = subset(version(v))
            assert _differ(v1, sent, list(SUBSET)) == list(SUBSET)
            report = session.sync(StateDictSource(sent))
            assert report.staged == ("full" if stage == "auto" else "off") and report.bytes == nbytes(sent)
            assert holds(engine, {**v1, **sent}) == [], f"sync {v}"
            h = engine.health()
            assert (h["version"], h["stale"], h["paused"], h["staged"]) == (report.version, False, False, False)
            assert h["staging_copy_bytes"] == (nbytes(sent) if stage == "auto" else 0)
        assert len(untouched) > 40
    finally:
        session.close()


@pytest.mark.parametrize("stage", ["auto", "off"])
def test_after_a_staged_seed_and_a_staged_patch_a_subset_sync_keeps_the_patched_bits(
    spawn: Callable[[int | None], TorchRefRollout], stage: str,
) -> None:
    """Delta on: a seed (v1, every tensor), a patch sync (v2, every tensor), then a sync of 2 tensors
    (v3; a new manifest: a seed again). The other tensors hold v2 (before the fix, staged: v1, the
    version before last, from the staging copy the seed had left) and the subset v3."""
    engine = spawn(None)
    session = WeightSyncSession([engine], dataclasses.replace(DEFAULTS, delta="on", stage=stage))
    v1, v2, v3 = version(1), version(2), subset(version(3))
    untouched = [n for n in v1 if n not in SUBSET]
    assert len(_differ(v1, v2, untouched)) > 10  # a rollback to v1 would show
    try:
        kinds = []
        for sd in (v1, v2, v3):
            report = session.sync(StateDictSource(sd))
            kinds.append((report.delta, report.staged))
        assert holds(engine, {**v2, **v3}) == []
    finally:
        session.close()
    want = [("seed", "full"), ("patch", "patches"), ("seed", "full")] if stage == "auto" else [("seed", "off"), ("patch", "off"), ("seed", "off")]
    assert kinds == want
