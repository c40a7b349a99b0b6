"""A bucket image spread over a receiver's own tensors (ckpt_engine.delta.pieces): words are read
and written by bucket position in the right tensor, and positions in padding are refused."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt_engine.delta.mixing import mix
from ckpt_engine.delta.pieces import ScatteredImage, pair_delta


def _layout(sizes: list[int], gaps: list[int], dtype: torch.dtype, seed: int) -> tuple[list[tuple[int, torch.Tensor]], torch.Tensor, int]:
    """Regions of `sizes` words separated by `gaps` words of padding, and the flat reference image
    (padding zero)."""
    g = torch.Generator().manual_seed(seed)
    regions, flat, at = [], [], 0
    for size, gap in zip(sizes, gaps):
        at += gap
        flat.append(torch.zeros(gap, dtype=dtype))
        t = torch.randint(-100, 100, (size,), dtype=torch.int64, generator=g).to(dtype)
        regions.append((at, t))
        flat.append(t.clone())
        at += size
    return regions, torch.cat(flat) if flat else torch.zeros(0, dtype=dtype), at


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 300), min_size=1, max_size=8),
    gap=st.integers(0, 5),
    dtype=st.sampled_from([torch.int8, torch.int16, torch.int32, torch.int64]),
    seed=st.integers(0, 2**20),
    data=st.data(),
)
def test_gather_and_scatter_address_the_right_tensor(sizes: list[int], gap: int, dtype: torch.dtype, seed: int, data: st.DataObject) -> None:
    regions, ref, num_words = _layout(sizes, [gap] * len(sizes), dtype, seed)
    if num_words == 0:
        return
    image = ScatteredImage(regions, num_words)
    inside = [f + i for f, t in regions for i in range(t.numel())]
    if not inside:
        return
    pos = torch.tensor(data.draw(st.lists(st.sampled_from(inside), min_size=1, max_size=50, unique=True)), dtype=torch.int32)
    old, bad = image.gather(pos)
    assert int(bad) == 0 and torch.equal(old, ref[pos.long()])
    new = (old.to(torch.int64) + 1).to(dtype)
    image.scatter(pos, new)
    ref[pos.long()] = new
    assert torch.equal(torch.cat([t for _f, t in regions]), torch.cat([ref[f : f + t.numel()] for f, t in regions]))


def test_positions_in_padding_or_out_of_range_are_counted_not_touched() -> None:
    regions, _ref, num_words = _layout([5, 7], [2, 3], torch.int16, seed=1)
    image = ScatteredImage(regions, num_words + 4)
    before = [t.clone() for _f, t in regions]
    old, bad = image.gather(torch.tensor([0, 1, 7, 8, num_words, num_words + 3, 2], dtype=torch.int32))
    assert int(bad) == 6 and int(old[-1]) == int(regions[0][1][0])
    image.scatter(torch.tensor([0, 8, 2], dtype=torch.int32), torch.tensor([9, 9, 9], dtype=torch.int16))
    assert int(regions[0][1][0]) == 9 and torch.equal(regions[1][1], before[1])


def test_pair_delta_is_the_position_weighted_change() -> None:
    pos = torch.tensor([70000, 3, 65536, 9], dtype=torch.int32)
    new = torch.tensor([5, -2, 7, 0], dtype=torch.int16)
    old = torch.tensor([1, 4, 7, -3], dtype=torch.int16)
    want = int((mix(pos.long()) * (new.long() - old.long())).sum())
    assert int(pair_delta(pos, new, old)) == want


def test_overlapping_or_mixed_regions_are_value_errors() -> None:
    a, b = torch.zeros(10, dtype=torch.int16), torch.zeros(10, dtype=torch.int16)
    with pytest.raises(ValueError, match="overlaps"):
        ScatteredImage([(0, a), (5, b)], 20)
    with pytest.raises(ValueError, match="contiguous 1-D"):
        ScatteredImage([(0, a), (10, b.to(torch.int32))], 20)


_INTERPRETED = textwrap.dedent(
    """
    import math, torch
    from ckpt_engine.delta.pieces import ScatteredImage
    g = torch.Generator().manual_seed(3)
    for dt in (torch.int8, torch.int16, torch.int32, torch.int64):
        sizes, firsts, at = (7, 1000, 3, 5000, 1, 64), [], 0
        ts = []
        for n in sizes:
            at += 2  # padding before every region
            firsts.append(at)
            ts.append(torch.randint(-50, 50, (n,), dtype=torch.int64, generator=g).to(dt))
            at += n
        img = ScatteredImage(list(zip(firsts, ts)), at + 5)
        # the CUDA path, run by Triton's interpreter on CPU tensors
        img._fused = True
        img._anchor = min(ts, key=lambda t: t.data_ptr())
        img._starts_d, img._ends_d = img.starts, img.ends
        img._rel_d = torch.tensor([(t.data_ptr() - img._anchor.data_ptr()) // t.element_size() - f for f, t in zip(firsts, ts)])
        img._steps = max(1, math.ceil(math.log2(len(ts))) + 1)
        ref = torch.zeros(at + 5, dtype=dt)
        for f, t in zip(firsts, ts):
            ref[f : f + t.numel()] = t
        inside = torch.tensor([f + i for f, t in zip(firsts, ts) for i in range(0, t.numel(), 3)], dtype=torch.int32)
        old, bad = img.gather(inside)
        assert int(bad) == 0 and torch.equal(old, ref[inside.long()]), dt
        _, bad = img.gather(torch.tensor([0, 1, firsts[1] - 1, at, at + 4], dtype=torch.int32))
        assert int(bad) == 5, int(bad)
        vals = (old.long() + 1).to(dt)
        img.scatter(inside, vals)
        ref[inside.long()] = vals
        for f, t in zip(firsts, ts):
            assert torch.equal(t, ref[f : f + t.numel()]), dt
    print("interpreted ok")
    """
)


def test_the_triton_kernel_run_by_the_interpreter_addresses_the_right_tensor() -> None:
    """The CUDA kernel (binary search over region starts, one base pointer with per-region
    offsets), executed by Triton's CPU interpreter."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "interpreted ok" in proc.stdout, proc.stderr[-3000:]
