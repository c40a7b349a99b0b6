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


def _reference_swap(regions: list[tuple[int, torch.Tensor]], pos: torch.Tensor, vals: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(old words, 0 outside every region; count outside; wrapped sum of h(p) * (new - old)) from
    the regions as they are, before any write: the independent reference for swap_in."""
    p = pos.long()
    old = torch.zeros(p.numel(), dtype=vals.dtype)
    inside = torch.zeros(p.numel(), dtype=torch.bool)
    for f, t in regions:
        m = (p >= f) & (p < f + t.numel())
        old[m] = t[p[m] - f]
        inside |= m
    return old, int((~inside).sum()), int((mix(p) * (vals.long() - old.long())).sum())


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 200), min_size=1, max_size=6),
    gap=st.integers(0, 4),
    dtype=st.sampled_from([torch.int8, torch.int16, torch.int32, torch.int64]),
    seed=st.integers(0, 2**20),
    data=st.data(),
)
def test_swap_in_is_gather_then_scatter_then_pair_delta(sizes: list[int], gap: int, dtype: torch.dtype, seed: int, data: st.DataObject) -> None:
    """Old words are the ones before any write (repeated positions included), positions in padding
    or past the bucket are counted and untouched, and the change is pair_delta's."""
    regions, ref, num_words = _layout(sizes, [gap] * len(sizes), dtype, seed)
    twin = [(f, t.clone()) for f, t in regions]
    pos_list = data.draw(st.lists(st.integers(-3, num_words + 3), min_size=0, max_size=60))
    if data.draw(st.booleans()):  # sorted, repeats allowed (what a CPU encoder writes): no sort in _groups
        pos_list.sort()
    pos = torch.tensor(pos_list, dtype=data.draw(st.sampled_from([torch.int32, torch.int64])))
    vals = torch.randint(-100, 100, (pos.numel(),), dtype=torch.int64, generator=torch.Generator().manual_seed(seed)).to(dtype)
    want_old, want_bad, want_delta = _reference_swap(regions, pos, vals)

    old, bad, delta = ScatteredImage(regions, num_words).swap_in(pos, vals)
    assert torch.equal(old, want_old) and int(bad) == want_bad and int(delta) == want_delta
    assert delta.dim() == 0 and delta.dtype == torch.int64

    image = ScatteredImage(twin, num_words)
    g_old, g_bad = image.gather(pos)
    image.scatter(pos, vals)
    assert torch.equal(old, g_old) and int(bad) == int(g_bad) and int(delta) == int(pair_delta(pos, vals, g_old))
    for (_f, a), (_g, b) in zip(regions, twin):
        assert torch.equal(a, b)
    once = [i for i, q in enumerate(pos_list) if pos_list.count(q) == 1 and 0 <= q < num_words]
    for i in once:  # a word written once holds its new value (a repeated one: either, as on CUDA)
        q = pos_list[i]
        for f, t in regions:
            if f <= q < f + t.numel():
                assert t[q - f] == vals[i]


def test_swap_in_refuses_values_that_do_not_match() -> None:
    image = ScatteredImage([(0, torch.zeros(4, dtype=torch.int16))], 4)
    with pytest.raises(ValueError, match="values of torch.int32"):
        image.swap_in(torch.tensor([0, 1]), torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="3 values"):
        image.swap_in(torch.tensor([0, 1]), torch.zeros(3, dtype=torch.int16))


def _payload(positions: list[int], values: list[int], num_words: int, pad: int = 0, kind: str = "scatter32", word: torch.dtype = torch.int32) -> torch.Tensor:
    """A patch of int32 positions and `word` values, written field by field (layout.py's format)."""
    from ckpt_engine.delta.layout import FORMAT_VERSION, HEADER, KIND_IDS, MAGIC, align8

    n = len(positions)
    head = HEADER.pack(MAGIC, FORMAT_VERSION, KIND_IDS[kind], torch.tensor([], dtype=word).element_size(), 0, num_words, n, 0)
    index = torch.tensor(positions, dtype=torch.int32).view(torch.uint8)
    padding = torch.full((align8(4 * n) - 4 * n,), pad, dtype=torch.uint8)
    vals = torch.tensor(values, dtype=word).view(torch.uint8)
    return torch.cat([torch.frombuffer(bytearray(head), dtype=torch.uint8), index, padding, vals])


def test_decode_without_the_range_check_leaves_out_of_range_positions_to_the_regions() -> None:
    """check_range=False skips only the range pass of a patch: its positions come back
    as the payload's int32 words, and swap_in counts the ones outside the bucket."""
    from ckpt_engine.delta.decoder import decode
    from ckpt_engine.delta.layout import PatchError

    num_words = 12
    payload = _payload([3, num_words + 5, -2], [7, 8, 9], num_words)
    with pytest.raises(PatchError, match="a position is negative"):
        decode(payload, 4 * num_words, 4)
    patch = decode(payload, 4 * num_words, 4, check_range=False)
    assert patch.positions.dtype == torch.int32 and patch.positions.tolist() == [3, num_words + 5, -2]
    assert patch.values.tolist() == [7, 8, 9]
    in_range = decode(_payload([3, 0, 11], [7, 8, 9], num_words), 4 * num_words, 4)
    unchecked = decode(_payload([3, 0, 11], [7, 8, 9], num_words), 4 * num_words, 4, check_range=False)
    assert torch.equal(in_range.positions, unchecked.positions.long()) and torch.equal(in_range.values, unchecked.values)

    region = torch.arange(num_words, dtype=torch.int32)
    old, bad, _delta = ScatteredImage([(0, region)], num_words).swap_in(patch.positions, patch.values)
    assert int(bad) == 2 and old.tolist() == [3, 0, 0] and region.tolist() == [0, 1, 2, 7] + list(range(4, num_words))
    with pytest.raises(PatchError, match="padding after the positions is not zero"):
        decode(_payload([3, 4, 5], [7, 8, 9], num_words, pad=1), 4 * num_words, 4)
    # without the range pass the padding is left to the caller: a device count it must see at 0
    assert int(decode(_payload([3, 4, 5], [7, 8, 9], num_words, pad=1), 4 * num_words, 4, check_range=False).unchecked) > 0
    assert int(decode(_payload([3, 4, 5], [7, 8, 9], num_words), 4 * num_words, 4, check_range=False).unchecked) == 0
    assert in_range.unchecked is None


_INTERPRETED_SWAP = textwrap.dedent(
    """
    import torch
    from ckpt_engine.delta import scatter_kernels
    from ckpt_engine.delta.pieces import ScatteredImage
    scatter_kernels.BLOCK = 16  # many blocks: most in one region, some across two
    g = torch.Generator().manual_seed(5)

    def fused(img, ts, firsts):
        img._table = scatter_kernels.RegionTable.of(img.regions)  # the CUDA path, run by Triton's interpreter on CPU tensors
        return img

    for dt in (torch.int16, torch.int32, torch.int64):
        sizes, firsts, at, ts = (40, 3, 100, 1, 70), [], 0, []
        for n in sizes:
            at += 3  # padding before every region
            firsts.append(at)
            ts.append(torch.randint(-50, 50, (n,), dtype=torch.int64, generator=g).to(dt))
            at += n
        num_words = at + 4
        twin = [t.clone() for t in ts]
        gpu = fused(ScatteredImage(list(zip(firsts, ts)), num_words), ts, firsts)
        cpu = ScatteredImage(list(zip(firsts, twin)), num_words)
        r2 = list(range(firsts[2], firsts[2] + 100))
        pos = (
            r2[:32]                                            # two blocks inside region 2
            + list(range(firsts[0] + 30, firsts[1] + 3))       # region 0, its 3 padding words, region 1
            + [firsts[4] + 5] * 3 + [firsts[4] + 6] * 13       # repeated positions in one block
            + [0, 1, firsts[3] - 1, at, num_words + 7, -4]     # padding, past the regions, out of range: 9 outside
            + r2[60:76][::-1]                                   # one region, descending
        )
        pos_t = torch.tensor(pos, dtype=torch.int32)
        vals = torch.randint(-50, 50, (len(pos),), dtype=torch.int64, generator=g).to(dt)
        before = {q: int(t[q - f]) for f, t in zip(firsts, ts) for q in pos if f <= q < f + t.numel()}
        old, bad, delta = gpu.swap_in(pos_t, vals)
        c_old, c_bad, c_delta = cpu.swap_in(pos_t, vals)
        assert torch.equal(old, c_old) and int(bad) == int(c_bad) == 9 and int(delta) == int(c_delta), dt
        assert all(int(old[i]) == before[q] for i, q in enumerate(pos) if q in before), "an old word was read after a write"
        single = [i for i, q in enumerate(pos) if pos.count(q) == 1]
        for f, t, u in zip(firsts, ts, twin):
            for i in single:
                if f <= pos[i] < f + t.numel():
                    assert int(t[pos[i] - f]) == int(u[pos[i] - f]) == int(vals[i]), dt
        for f, t in zip(firsts, ts):  # a repeated word holds one of its new values
            for q in set(q for q in pos if pos.count(q) > 1 and f <= q < f + t.numel()):
                assert int(t[q - f]) in [int(vals[i]) for i, p in enumerate(pos) if p == q], dt
        # the plain gather/scatter kernel
        g_old, g_bad = gpu.gather(pos_t)
        c_old, c_bad = cpu.gather(pos_t)
        assert torch.equal(g_old, c_old) and int(g_bad) == int(c_bad) == 9, dt
        back = torch.tensor(sorted(set(pos)), dtype=torch.int64)
        w = torch.randint(-50, 50, (back.numel(),), dtype=torch.int64, generator=g).to(dt)
        gpu.scatter(back, w)
        cpu.scatter(back, w)
        for t, u in zip(ts, twin):
            assert torch.equal(t, u), dt
    print("swap interpreted ok")
    """
)


def test_swap_in_run_by_the_interpreter_matches_the_cpu_path() -> None:
    """The two swap_in kernels (read + checksum change, then write), executed by Triton's CPU
    interpreter, against the numpy path on a twin image."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", _INTERPRETED_SWAP], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "swap interpreted ok" in proc.stdout, proc.stderr[-3000:]
