"""The sender's walk over its weight source (backends/piece_reader.py): a tensor checked at the
last sync of the same plan is not checked again, and anything else still is."""

from __future__ import annotations

import gc

import pytest
import torch

from ckpt_engine.pipeline import piece_reader
from ckpt_engine.pipeline.piece_reader import PieceReader
from ckpt_engine.pipeline.schedule import Schedule
from ckpt_engine.planning.buckets import plan_buckets
from ckpt_engine.transports.base import SendStats
from ckpt_engine.manifest import TensorSpec

_SHAPES = {"a.weight": (8, 4), "b.bias": (4,), "c.weight": (4, 4)}


def _walk(sched: Schedule, weights: list[tuple[str, torch.Tensor]], known: dict) -> list[tuple[torch.Tensor, bool]]:
    reader = PieceReader(iter(weights), sched, 0, torch.device("cpu"), SendStats(), known)
    return [reader.source(e) for step in sched.steps for e in step.bucket.entries]


@pytest.fixture()
def sched() -> Schedule:
    specs = [TensorSpec(n, "float32", s) for n, s in _SHAPES.items()]
    return Schedule(plan_buckets(specs, 256), 2, 1)


def test_the_same_tensors_are_not_checked_twice(sched: Schedule, monkeypatch: pytest.MonkeyPatch) -> None:
    tensors = {n: torch.randn(s) for n, s in _SHAPES.items()}
    calls: list[str] = []
    real = piece_reader.checked_weight
    monkeypatch.setattr(piece_reader, "checked_weight", lambda name, t, e, *a: (calls.append(name), real(name, t, e, *a))[1])
    known: dict = {}
    first = _walk(sched, list(tensors.items()), known)
    assert [t for t, _own in first] == list(tensors.values()) and all(own for _t, own in first)
    assert sorted(calls) == sorted(_SHAPES) and set(known) == set(_SHAPES)
    calls.clear()
    again = _walk(sched, list(tensors.items()), known)
    assert calls == [] and all(t is tensors[n] and own for (t, own), n in zip(again, _SHAPES))
    tensors["b.bias"] = torch.randn(4)  # a new object: checked
    _walk(sched, list(tensors.items()), known)
    assert calls == ["b.bias"]


def test_what_changed_since_the_last_sync_is_still_refused(sched: Schedule) -> None:
    tensors = {n: torch.randn(s) for n, s in _SHAPES.items()}
    known: dict = {}
    _walk(sched, list(tensors.items()), known)
    swapped = list(tensors.items())
    swapped[0], swapped[1] = swapped[1], swapped[0]
    with pytest.raises(ValueError, match="yielded 'b.bias' where its metadata put 'a.weight'"):
        _walk(sched, swapped, known)
    tensors["c.weight"].resize_(2, 8)  # the same object, another shape
    with pytest.raises(ValueError, match=r"c.weight: the weight source yielded shape \(2, 8\)"):
        _walk(sched, list(tensors.items()), known)
    tensors["c.weight"] = torch.zeros(4, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="c.weight: the weight source yielded int32"):
        _walk(sched, list(tensors.items()), known)


def test_the_reader_keeps_no_yielded_tensor_alive(sched: Schedule) -> None:
    known: dict = {}
    _walk(sched, [(n, torch.randn(s)) for n, s in _SHAPES.items()], known)
    gc.collect()
    assert all(ref() is None for ref, _ptr, _own in known.values())
