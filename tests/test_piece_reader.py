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
from ckpt_engine.engine import SendStats
from ckpt_engine.manifest import TensorSpec

_SHAPES = {"a.weight": (8, 4), "b.bias": (4,), "c.weight": (4, 4)}


def _walk(sched: Schedule, weights: list[tuple[str, torch.Tensor]], known: dict) -> list[tuple[torch.Tensor, bool]]:
    reader = PieceReader(iter(weights), sched, 0, torch.device("cpu"), SendStats(), known)
    return [reader.source(e) for step in sched.steps for e in step.bucket.entries]


@pytest.fixture()
def sched() -> Schedule:
    specs = [TensorSpec(n, "float32", s) for n, s in _SHAPES.items()]
    return Schedule(plan_buckets(specs, 256), 2)


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


def test_a_square_tensor_turned_into_its_own_transpose_is_checked_again(sched: Schedule) -> None:
    """Same object, pointer and shape, other strides: not the tensor checked last time. It is no
    longer in the wire layout, so its bytes are taken through a contiguous copy (sending its
    storage as it lies would send the old orientation)."""
    tensors = {n: torch.randn(s) for n, s in _SHAPES.items()}
    known: dict = {}
    assert all(own for _t, own in _walk(sched, list(tensors.items()), known))
    tensors["c.weight"].data = tensors["c.weight"].data.t()
    again = dict(zip(_SHAPES, _walk(sched, list(tensors.items()), known)))
    assert again["c.weight"][1] is False and again["a.weight"][1] is True


def test_a_tensor_re_viewed_as_another_dtype_of_its_size_is_checked_again(sched: Schedule) -> None:
    """Same object, pointer, shape and strides, another dtype (`.data` re-viewed as int32): the walk
    checks it again and refuses it by name, and a bucket's one-pass take does not reuse it."""
    tensors = {n: torch.randn(s) for n, s in _SHAPES.items()}
    known: dict = {}
    _walk(sched, list(tensors.items()), known)
    seen = PieceReader.remember(list(tensors.values()))
    tensors["c.weight"].data = tensors["c.weight"].data.view(torch.int32)
    with pytest.raises(ValueError, match="c.weight: the weight source yielded int32"):
        _walk(sched, list(tensors.items()), known)
    r = PieceReader(iter(list(tensors.items())), sched, 0, torch.device("cpu"), SendStats(), {})
    assert not r.same_as_last(_entries(sched), seen)


def test_the_reader_keeps_no_yielded_tensor_alive(sched: Schedule) -> None:
    known: dict = {}
    _walk(sched, [(n, torch.randn(s)) for n, s in _SHAPES.items()], known)
    gc.collect()
    assert all(st[0]() is None for st, _own in known.values())


def _entries(sched: Schedule) -> list:
    return [e for step in sched.steps for e in step.bucket.entries]


def test_a_bucket_of_the_same_tensors_is_taken_whole_and_anything_else_walks(sched: Schedule) -> None:
    """`same_as_last`: the very tensors recorded last time, at the same pointers and shapes, are
    taken in one pass; on any difference nothing is taken and the usual walk (with its checks)
    sees every tensor in order."""
    tensors = {n: torch.randn(s) for n, s in _SHAPES.items()}
    entries = _entries(sched)
    seen = PieceReader.remember(list(tensors.values()))

    def reader(weights: dict[str, torch.Tensor]) -> PieceReader:
        return PieceReader(iter(list(weights.items()) + [("tail", torch.zeros(1))]), sched, 0, torch.device("cpu"), SendStats(), {})

    r = reader(tensors)
    assert r.same_as_last(entries, seen) and next(r.it)[0] == "tail"  # taken, and nothing more
    assert not reader(tensors).same_as_last(entries, None) and not reader(tensors).same_as_last([], [])

    def walks_in_order(weights: dict[str, torch.Tensor]) -> None:
        r = reader(weights)
        assert not r.same_as_last(entries, seen)
        assert [r.source(e)[0] for e in entries] == list(weights.values())

    walks_in_order({**tensors, "b.bias": torch.randn(4)})  # another object
    moved = dict(tensors)
    moved["c.weight"] = tensors["c.weight"]
    moved["c.weight"].data = torch.randn(4, 4)  # the same object, its storage replaced
    walks_in_order(moved)
    tensors = {n: torch.randn(s) for n, s in _SHAPES.items()}
    seen = PieceReader.remember(list(tensors.values()))
    tensors["c.weight"].resize_(2, 8)  # the same object and pointer, another shape: refused by the walk
    r = reader(tensors)
    assert not r.same_as_last(entries, seen)
    with pytest.raises(ValueError, match=r"c.weight: the weight source yielded shape \(2, 8\)"):
        [r.source(e) for e in entries]
    tensors = {n: torch.randn(s) for n, s in _SHAPES.items()}
    seen = PieceReader.remember(list(tensors.values()))
    tensors["c.weight"].data = tensors["c.weight"].data.t()  # square: the same object, pointer and shape, other strides
    walks_in_order(tensors)
    renamed = [("x.weight" if n == "a.weight" else n, t) for n, t in tensors.items()]
    r = PieceReader(iter(renamed), sched, 0, torch.device("cpu"), SendStats(), {})
    assert not r.same_as_last(entries, PieceReader.remember([t for _n, t in renamed]))


def test_the_sender_keeps_the_longest_stretch_of_its_own_whole_tensors() -> None:
    """A bucket's first and last entries are often pieces of split tensors: the stretch between
    them, not the bucket, is what the next sync may take in one pass."""
    from ckpt_engine.pipeline.delta_send import _longest_run

    ts = [torch.zeros(1) for _ in range(7)]
    owned = [(i, ts[i], (i, 1, i)) for i in (0, 1, 3, 4, 5, 6)]
    run = _longest_run(owned)
    assert run is not None and (run.lo, run.hi) == (3, 7) and run.rows == [(i, 1, i) for i in (3, 4, 5, 6)]
    assert [st[0]() for st in run.seen] == ts[3:7]
    assert _longest_run([(2, ts[2], (2, 1, 2))]) is None and _longest_run([]) is None
