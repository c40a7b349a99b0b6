"""A fresh walk's bucket is checked and sorted in one loop (`PieceReader.fresh_entries`).

The FP8 wire yields new tensors (codes, scales) that the sender always copies; the sender checks
each against its manifest entry on name, shape and dtype only, and splits the copies by dtype pair
as it goes. What this must keep: every wrong name, shape or dtype kind is refused by name as
`source` refuses it, a float tensor of another format is cast on the copy, and the copies land
the yielded bytes in the entry's place.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from ckpt_engine.engine import SendStats
from ckpt_engine.manifest import TensorSpec
from ckpt_engine.pipeline.piece_reader import PieceReader
from ckpt_engine.pipeline.plan_state import PlanState
from ckpt_engine.planning.buckets import plan_buckets

Items = list[tuple[str, torch.Tensor]]

_SPECS = [
    TensorSpec("a.weight", "float8_e4m3fn", (8, 16)),
    TensorSpec("a.weight_scale_inv", "float32", (1, 1)),
    TensorSpec("norm.weight", "bfloat16", (16,)),
    TensorSpec("b.weight", "float8_e4m3fn", (4, 16)),
    TensorSpec("b.weight_scale_inv", "float32", (1, 1)),
]


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    out = {}
    for s in _SPECS:
        dtype = getattr(torch, s.dtype)
        out[s.name] = torch.randn(s.shape, generator=g).to(dtype)
    return out


def _pack(items: Items) -> tuple[torch.Tensor, PlanState]:
    """One sender's bucket of the specs, packed from `items` through `fresh_entries`."""
    manifest = plan_buckets(_SPECS, 4096)
    assert len(manifest.buckets) == 1
    state = PlanState(manifest, 2)
    buf = torch.zeros(4096, dtype=torch.uint8)
    views = state.bucket_views(manifest, [buf, torch.zeros(4096, dtype=torch.uint8)], 4096, True)[0]
    reader = PieceReader(iter(items), state.schedule, 0, torch.device("cpu"), SendStats())
    groups = reader.fresh_entries(manifest.buckets[0].entries, views)
    for dsts, srcs in groups:
        torch._foreach_copy_(dsts, srcs)
    return buf, state


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def test_the_bucket_holds_the_yielded_bytes_and_copies_go_by_dtype_pair() -> None:
    tensors = _tensors()
    manifest = plan_buckets(_SPECS, 4096)
    buf, _ = _pack(list(tensors.items()))
    for e in manifest.buckets[0].entries:
        assert torch.equal(buf[e.bucket_offset : e.bucket_offset + e.chunk_size], _bytes(tensors[e.name])), e.name
    items = list(tensors.items())
    reader = PieceReader(iter(items), PlanState(manifest, 2).schedule, 0, torch.device("cpu"), SendStats())
    dsts = [torch.empty(s.shape, dtype=getattr(torch, s.dtype)) for s in _SPECS]
    groups = reader.fresh_entries(manifest.buckets[0].entries, dsts)
    assert sorted(len(d) for d, _ in groups) == [1, 2, 2]  # codes, scales, the norm: one list each


def test_a_float_of_another_format_is_cast_on_the_copy() -> None:
    tensors = _tensors()
    wide = tensors["norm.weight"].float()  # an fp32 master where the wire says bf16
    buf, _ = _pack([(n, wide if n == "norm.weight" else t) for n, t in tensors.items()])
    e = next(e for e in plan_buckets(_SPECS, 4096).buckets[0].entries if e.name == "norm.weight")
    assert torch.equal(buf[e.bucket_offset : e.bucket_offset + e.chunk_size], _bytes(wide.bfloat16()))


@pytest.mark.parametrize(
    "change, error",
    [
        (lambda items: [items[1], items[0], *items[2:]], "yielded 'a.weight_scale_inv' where its metadata put 'a.weight'"),
        (lambda items: [(n, t.reshape(16, 8) if n == "a.weight" else t) for n, t in items], r"a.weight: the weight source yielded shape \(16, 8\)"),
        (lambda items: [(n, torch.zeros(16, dtype=torch.int32) if n == "norm.weight" else t) for n, t in items], "norm.weight: the weight source yielded int32"),
        (lambda items: items[:3], "the weight source ended before 'b.weight'"),
    ],
    ids=["order", "shape", "dtype", "short"],
)
def test_what_does_not_match_the_manifest_is_refused_by_name(change: Callable[[Items], Items], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        _pack(change(list(_tensors().items())))
