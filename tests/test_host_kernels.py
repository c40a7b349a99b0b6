"""The compiled CPU loops of the delta codec (host_kernels.py) against torch and numpy.

numba is installed by scripts/setup.sh, so these run the compiled code, not a fallback.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt_engine.delta import host, host_kernels
from ckpt_engine.delta.direct import BucketDiff, out_bytes
from ckpt_engine.delta.mixing import mix, table_a

pytestmark = pytest.mark.skipif(not host_kernels.available(), reason="numba is not installed")


def _table() -> np.ndarray:
    return table_a(torch.device("cpu")).numpy()


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), n=st.integers(0, 3000), first=st.integers(0, 1 << 20), cast=st.booleans(), cap=st.integers(0, 3000))
def test_diff_into_records_what_numpy_and_torch_would(seed: int, n: int, first: int, cast: bool, cap: int) -> None:
    """Every changed word in order (up to `cap` recorded, all counted), the base brought up to
    date, and the checksum change of the full mix; a cast rounds any fp32 bits as torch does
    (NaN aside: CUDA's canonical 0x7FFF, as the CUDA kernel writes)."""
    rng = np.random.default_rng(seed)
    if cast:
        bits = rng.integers(-(2**31), 2**31, n, dtype=np.int64).astype(np.int32)
        bits[rng.random(n) < 0.3] = np.float32(0.02).view(np.int32)  # many words unchanged
        tie = rng.random(n) < 0.1  # exactly halfway between two bf16 values: round to even
        bits[tie] = (bits[tie] & ~np.int32(0xFFFF)) | np.int32(0x8000)
        master = torch.from_numpy(bits).view(torch.float32)
        want = master.to(torch.bfloat16).view(torch.int16).clone()
        want[master.isnan()] = 0x7FFF
        new = bits
    else:
        want = torch.from_numpy(rng.integers(-(2**15), 2**15, n, dtype=np.int64).astype(np.int16))
        new = want.numpy()
    base = want.numpy().copy()
    flip = rng.random(n) < 0.1
    base[flip] ^= 1 + rng.integers(0, 100, int(flip.sum())).astype(np.int16)
    before = base.copy()
    positions = np.zeros(max(cap, 1), np.int32)
    values = np.zeros(max(cap, 1), np.int16)
    count, total = host_kernels.diff_into(new, base, first, positions, values, 0, cap, _table(), cast=cast)
    changed = np.flatnonzero(before != want.numpy())
    assert count == changed.size and np.array_equal(base, want.numpy())
    kept = min(count, cap)
    assert np.array_equal(positions[:kept], changed[:kept] + first) and np.array_equal(values[:kept], want.numpy()[changed[:kept]])
    p = torch.from_numpy(changed + first)
    expect = int((mix(p) * (want.long()[changed] - torch.from_numpy(before).long()[changed])).sum())
    assert host.wrap64(total) == expect


def test_a_bucket_diff_on_the_cpu_agrees_with_the_numpy_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """BucketDiff over several pieces: the compiled pass and numpy give the same patch bytes."""
    g = torch.Generator().manual_seed(1)
    n = 50_000
    pieces = [(torch.randn(k, generator=g) * 0.02, first) for k, first in ((10_000, 0), (25_000, 10_000), (15_000, 35_000))]
    outs = []
    for compiled in (True, False):
        monkeypatch.setattr(host_kernels, "available", lambda: compiled)
        out = torch.zeros(out_bytes(2 * n, 2, 0.25), dtype=torch.uint8)
        diff = BucketDiff(out, 2 * n, 2, 0.25)
        for master, first in pieces:
            base = master.to(torch.bfloat16).view(torch.int16).clone()
            base[:: 7] += 1
            diff.add_cast(master, base, first)
            assert torch.equal(base, master.to(torch.bfloat16).view(torch.int16))
        size, delta, count = diff.finish()
        outs.append((size, int(delta), count, out[:size].clone()))
    assert outs[0][0] is not None and outs[0][2] > 0
    assert outs[0][:3] == outs[1][:3] and torch.equal(outs[0][3], outs[1][3])


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), a=st.integers(0, 300), b=st.integers(0, 300), span=st.integers(1, 400), shuffle=st.booleans())
def test_merge_last_merges_two_sorted_runs_keeping_the_later_value(seed: int, a: int, b: int, span: int, shuffle: bool) -> None:
    """Two strictly ascending runs (a patch, then a cast's new words) merge into one, each word
    once with the later run's value, as a dict of the last value per position says; anything
    that is not two ascending runs is refused (-1) and left as it was."""
    rng = np.random.default_rng(seed)
    runs = [np.sort(rng.choice(span, min(k, span), replace=False)).astype(np.int32) for k in (a, b)]
    pos = np.concatenate(runs)
    if shuffle and pos.size > 2:
        rng.shuffle(pos)
    vals = rng.integers(-(2**15), 2**15, pos.size).astype(np.int16)
    want = dict(zip(pos.tolist(), vals.tolist()))
    p, v = pos.copy(), vals.copy()
    n = host_kernels.merge_last(p, v)
    descents = int((np.diff(pos.astype(np.int64)) <= 0).sum())
    if descents > 1:
        assert n == -1 and np.array_equal(p, pos) and np.array_equal(v, vals)
        return
    keys = sorted(want)
    assert n == len(keys)
    assert p[:n].tolist() == keys and v[:n].tolist() == [want[k] for k in keys]


def test_merge_repeats_after_each_of_three_diffs_keeps_each_word_once_with_its_last_value() -> None:
    """BucketDiff.merge_repeats on a CPU (the compiled merge of the patch and the new run) after
    each of three diffs into one patch, some words changed again."""
    n = 1 << 16  # the patch area holds the 3 x 200 changes
    diff = BucketDiff(torch.empty(out_bytes(2 * n, 2), dtype=torch.uint8), 2 * n, 2)
    base = torch.zeros(n, dtype=torch.int16)
    rng = np.random.default_rng(1)
    want: dict[int, int] = {}
    for _ in range(3):
        new = base.clone()
        hit = torch.from_numpy(rng.choice(n, 200, replace=False))
        new[hit] = torch.from_numpy(rng.integers(1, 2**15, 200).astype(np.int16))
        diff.add(new, base, 0)  # writes new into base
        want.update({int(i): int(new[i]) for i in (new != 0).nonzero().reshape(-1)})
        diff.merge_repeats()
    count = diff._count
    assert count <= diff.cap
    assert diff._positions[:count].tolist() == sorted(want)
    assert diff._values[:count].tolist() == [want[k] for k in sorted(want)]
