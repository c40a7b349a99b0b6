"""The footprint of a strided view as regions of its tensor, checked against enumerating the elements."""

from __future__ import annotations

from math import prod

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt_engine.planning.regions import ReceivePlan, Region
from ckpt_engine.rollout_adapters.region_assembler import RegionAssembler, held_bytes
from ckpt_engine.manifest import TensorSpec
from ckpt_engine.rollout_adapters.region_footprint import box_of_view, regions_of_boxes


def _elements(shape: tuple[int, ...], view_of: object) -> set[tuple[int, ...]]:
    """The coordinates (in the tensor) of every element a view reads, by enumeration."""
    idx = torch.arange(prod(shape)).reshape(shape)
    flat = view_of(idx).reshape(-1).tolist()  # type: ignore[operator]
    return {tuple(int(c) for c in torch.unravel_index(torch.tensor(f), shape)) for f in flat}


def _box(shape: tuple[int, ...], view_of: object):  # noqa: ANN202
    v = view_of(torch.empty(shape, device="meta"))  # type: ignore[operator]
    return box_of_view(shape, tuple(v.shape), tuple(v.stride()), v.storage_offset())


def _in_box(box, coords) -> bool:  # noqa: ANN001
    return all(lo <= c < hi for (lo, hi), c in zip(box, coords))


VIEWS = {
    "narrow0": lambda t: t.narrow(0, 3, 5),
    "narrow1": lambda t: t.narrow(1, 2, 4),
    "t": lambda t: t.narrow(0, 1, 4).t(),
    "chunk-narrow": lambda t: t.chunk(2, dim=0)[1].narrow(0, 1, 2),
    "select": lambda t: t[2],
    "heads": lambda t: t.view(4, 3, 6)[1:3].reshape(6, 6),
    "flat-rows": lambda t: t.narrow(0, 4, 2).reshape(-1),
    "flat-all": lambda t: t.view(-1)[6:18],
    "expand": lambda t: t[1:2].expand(5, 6),
    "block": lambda t: t[2:5, 1:3],
}


def test_boxes_cover_exactly_the_elements_read() -> None:
    shape = (12, 6)
    for label, view_of in VIEWS.items():
        box = _box(shape, view_of)
        assert box is not None, label
        read = _elements(shape, view_of)
        assert all(_in_box(box, c) for c in read), label
        # the box is the bounding box: each of its edges is touched
        for d, (lo, hi) in enumerate(box):
            assert min(c[d] for c in read) == lo and max(c[d] for c in read) == hi - 1, label


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(2, 9), cols=st.integers(1, 7),
    a=st.integers(0, 8), b=st.integers(1, 9), transpose=st.booleans(), flat=st.booleans(),
)
def test_any_narrowed_view_is_bounded(rows: int, cols: int, a: int, b: int, transpose: bool, flat: bool) -> None:
    shape = (rows, cols)
    start, length = a % rows, max(1, min(b, rows - a % rows))

    def view_of(t: torch.Tensor) -> torch.Tensor:
        v = t.narrow(0, start, length)
        v = v.t() if transpose else v
        return v.reshape(-1) if flat and not transpose else v

    box = _box(shape, view_of)
    assert box == ((start, start + length), (0, cols))
    assert all(_in_box(box, c) for c in _elements(shape, view_of))


def test_regions_pick_the_cheapest_dimension_and_merge() -> None:
    shape = (8, 4)
    assert regions_of_boxes(shape, [((0, 4), (0, 4))]) == (Region(0, 0, 4),)
    assert regions_of_boxes(shape, [((0, 8), (2, 4))]) == (Region(1, 2, 2),)
    assert regions_of_boxes(shape, [((0, 2), (0, 4)), ((2, 3), (0, 4)), ((6, 8), (0, 4))]) == (Region(0, 0, 3), Region(0, 6, 2))
    assert regions_of_boxes(shape, [((0, 4), (0, 4)), ((4, 8), (0, 4))]) is None  # the whole tensor
    assert regions_of_boxes(shape, [((0, 0), (0, 4))]) == ()  # an empty read holds nothing


def test_assembler_fills_regions_and_refuses_strangers() -> None:
    import pytest

    from ckpt_engine.planning.regions import ReceivePlanError

    specs = {"w": TensorSpec("w", "float32", (6, 4)), "n": TensorSpec("n", "float32", (4,))}
    plan = ReceivePlan({"w": (Region(0, 0, 2), Region(0, 4, 2)), "n": None})
    assert held_bytes(plan, specs) == (4 * 4 + 4) * 4
    full = torch.arange(24.0).reshape(6, 4)
    asm = RegionAssembler(plan, specs, torch.device("cpu"), poison=True)
    ((name, got),) = asm.add("n", None, full[0])
    assert name == "n" and torch.equal(got, full[0])
    assert asm.add("w", Region(0, 4, 2), full[4:6]) == []
    assert asm.incomplete() == ["w"]
    with pytest.raises(ReceivePlanError, match=r"region \[0, 0, 2\] of .w. with shape \[3, 4\]"):
        asm.add("w", Region(0, 0, 2), full[0:3])
    with pytest.raises(ReceivePlanError, match=r"does not hold"):
        asm.add("w", Region(0, 1, 2), full[1:3])
    ((name, got),) = asm.add("w", Region(0, 0, 2), full[0:2])
    assert name == "w" and torch.equal(got[:2], full[:2]) and torch.equal(got[4:], full[4:]) and got[2:4].isnan().all()
    assert asm.incomplete() == []
