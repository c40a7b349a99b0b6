"""The compiled CPU loops of the delta codec (host_kernels.py) against torch and numpy.

numba is installed by scripts/setup.sh, so these run the compiled code, not a fallback.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("numba")

from ckpt_engine.delta import accel, host, host_kernels  # noqa: E402
from ckpt_engine.delta.direct import BucketDiff, out_bytes  # noqa: E402
from ckpt_engine.delta.mixing import mix, table_a  # noqa: E402


def _table() -> np.ndarray:
    return table_a(torch.device("cpu")).numpy()


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), n=st.integers(0, 3000), first=st.integers(0, 1 << 20), cap=st.integers(0, 3000))
def test_diff_into_records_what_numpy_and_torch_would(seed: int, n: int, first: int, cap: int) -> None:
    """Every changed word in order (up to `cap` recorded, all counted), the base brought up to
    date, and the checksum change of the full mix."""
    rng = np.random.default_rng(seed)
    want = torch.from_numpy(rng.integers(-(2**15), 2**15, n, dtype=np.int64).astype(np.int16))
    new = want.numpy()
    base = want.numpy().copy()
    flip = rng.random(n) < 0.1
    base[flip] ^= 1 + rng.integers(0, 100, int(flip.sum())).astype(np.int16)
    before = base.copy()
    positions = np.zeros(max(cap, 1), np.int32)
    values = np.zeros(max(cap, 1), np.int16)
    count, total = host_kernels.diff_into(new, base, first, positions, values, 0, cap, _table())
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
        monkeypatch.setattr(accel, "numba_on", lambda: compiled)
        out = torch.zeros(out_bytes(2 * n, 2, 0.25), dtype=torch.uint8)
        diff = BucketDiff(out, 2 * n, 2, 0.25)
        for master, first in pieces:
            new = master.to(torch.bfloat16).view(torch.int16)
            base = new.clone()
            base[:: 7] += 1
            diff.add(new, base, first)
            assert torch.equal(base, new)
        size, delta, count = diff.finish()
        outs.append((size, int(delta), count, out[:size].clone()))
    assert outs[0][0] is not None and outs[0][2] > 0
    assert outs[0][:3] == outs[1][:3] and torch.equal(outs[0][3], outs[1][3])

