"""The one-pass bucket diff (ckpt_engine.delta.direct): patches built piece by piece from source
tensors, without packing the bucket first, decode to exactly the changed words of the bucket."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckpt_engine.delta import codec
from ckpt_engine.delta.direct import BucketDiff, capacity, out_bytes
from ckpt_engine.delta.layout import PATCH_HEADER_BYTES


def _images(word_bytes: int, num_words: int, frac: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    dtype = codec.word_dtype(word_bytes)
    base = torch.randint(-100, 100, (num_words,), dtype=torch.int64, generator=g).to(dtype)
    new = base.clone()
    changed = torch.rand(num_words, generator=g) < frac
    new[changed] += 1
    if word_bytes >= 2 and num_words:  # NaN payloads and -0.0 as bf16 / fp32 bits
        new[0] = torch.tensor(-32768 if word_bytes == 2 else -(2**31) if word_bytes == 4 else -(2**63), dtype=torch.int64).to(dtype)
    return base, new


def _diff(base: torch.Tensor, new: torch.Tensor, word_bytes: int, cuts: list[int]) -> tuple[torch.Tensor, int | None, int, torch.Tensor]:
    """Diff `new` against a copy of `base` in pieces cut at `cuts`; returns (the base afterwards,
    patch size, changed count, out)."""
    work = base.clone()
    nbytes = base.numel() * word_bytes
    out = torch.empty(out_bytes(nbytes, word_bytes), dtype=torch.uint8)
    diff = BucketDiff(out, nbytes, word_bytes)
    edges = [0, *sorted(set(cuts)), base.numel()]
    for lo, hi in zip(edges, edges[1:]):
        diff.add(new[lo:hi], work[lo:hi], lo)
    size, delta, count = diff.finish()
    if size is not None:
        assert int(delta) == codec.decode(out[:size], nbytes, word_bytes).delta_sum
    return work, size, count, out


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    word_bytes=st.sampled_from([1, 2, 4, 8]),
    num_words=st.integers(0, 3000),
    frac=st.sampled_from([0.0, 0.001, 0.01, 0.03, 0.2, 1.0]),
    seed=st.integers(0, 2**31),
    data=st.data(),
)
def test_pieces_make_the_patch_of_the_whole_bucket(word_bytes: int, num_words: int, frac: float, seed: int, data: st.DataObject) -> None:
    base, new = _images(word_bytes, num_words, frac, seed)
    cuts = data.draw(st.lists(st.integers(0, num_words), max_size=6))
    after, size, count, out = _diff(base, new, word_bytes, cuts)
    assert torch.equal(after, new)  # the base is current whether the bucket goes as a patch or dense
    changed = (base != new).nonzero().reshape(-1)
    assert count == changed.numel()
    nbytes = num_words * word_bytes
    expect = PATCH_HEADER_BYTES + (4 * count + 7) // 8 * 8 + count * word_bytes
    if count > capacity(nbytes, word_bytes) or expect >= nbytes:
        assert size is None
        return
    assert size == expect
    patch = codec.decode(out[:size], nbytes, word_bytes)
    assert patch.kind == "scatter32"
    assert torch.equal(patch.positions.sort().values, changed)
    raw_base, raw_new = base.view(torch.uint8), new.view(torch.uint8)
    got = codec.checksum(raw_base, word_bytes) + codec.delta_checksum(raw_base, patch)
    assert int(got) == int(codec.checksum(raw_new, word_bytes))
    image = raw_base.clone()
    codec.apply(image, patch)
    assert torch.equal(image, raw_new)


def test_a_bucket_that_changed_a_lot_goes_dense_with_its_base_current() -> None:
    base, new = _images(2, 4096, 0.2, seed=3)  # 20 % > 1 in 32: a bitmask would be smaller
    after, size, count, _ = _diff(base, new, 2, [1000])
    assert size is None and count == int((base != new).sum()) and torch.equal(after, new)


def test_scatter_positions_out_of_range_are_named() -> None:
    base, new = _images(2, 4096, 0.01, seed=4)
    _after, size, _count, out = _diff(base, new, 2, [])
    assert size is not None
    bad = out[:size].clone()
    bad[PATCH_HEADER_BYTES : PATCH_HEADER_BYTES + 4].view(torch.int32).fill_(4096)
    with pytest.raises(codec.PatchError, match="num_words=4096"):
        codec.decode(bad, 4096 * 2, 2)


def test_pieces_outside_the_bucket_are_value_errors() -> None:
    out = torch.empty(out_bytes(64, 2), dtype=torch.uint8)
    diff = BucketDiff(out, 64, 2)
    with pytest.raises(ValueError, match="bytes starting 8-byte aligned"):
        BucketDiff(out[:-8], 64, 2)
    with pytest.raises(ValueError, match="outside the bucket"):
        diff.add(torch.zeros(10, dtype=torch.int16), torch.zeros(10, dtype=torch.int16), 25)
    with pytest.raises(ValueError, match="differ in length"):
        diff.add(torch.zeros(10, dtype=torch.int16), torch.zeros(9, dtype=torch.int16), 0)


_INTERPRETED = textwrap.dedent(
    """
    import torch
    from ckpt_engine.delta import codec
    from ckpt_engine.delta.direct import BucketDiff, out_bytes
    g = torch.Generator().manual_seed(7)
    for wb in (1, 2, 4, 8):
        dt = codec.word_dtype(wb)
        n = 2 * 65536 + 999  # several h groups, a partial last tile
        old = torch.randint(-100, 100, (n,), dtype=torch.int64, generator=g).to(dt)
        new = old.clone()
        new[torch.rand(n, generator=g) < 0.02] += 1
        for fused in (False, True):
            work = old.clone()
            out = torch.empty(out_bytes(n * wb, wb), dtype=torch.uint8)
            diff = BucketDiff(out, n * wb, wb)
            if fused:  # the Triton kernel, run by Triton's interpreter on CPU tensors
                diff._fused, diff._counter = True, torch.zeros(1, dtype=torch.int32)
            diff.add(new[:70001], work[:70001], 0)
            diff.add(new[70001:], work[70001:], 70001)
            size, delta, count = diff.finish()
            if fused:  # one launch through a table: aligned pieces (hinted) and odd ones together
                work2 = old.clone()
                out2 = torch.empty(out_bytes(n * wb, wb), dtype=torch.uint8)
                diff2 = BucketDiff(out2, n * wb, wb)
                diff2._fused, diff2._counter = True, torch.zeros(1, dtype=torch.int32)
                cuts = [0, 64, 5000, 70001, 70002, 100000, n]
                news = [new[a:b].clone() for a, b in zip(cuts, cuts[1:])]
                rows = [(t.data_ptr(), t.numel(), a) for t, a in zip(news, cuts)]
                cache = {}
                diff2.add_pieces(rows, work2, cache)
                assert len(cache["launches"]) == 2 and all(cache["launches"].values())  # aligned and odd pieces both ran
                size2, delta2, count2 = diff2.finish()
                assert torch.equal(work2, new) and count2 == int((old != new).sum()) and size2 == size
                assert int(delta2) == int(delta)
                p2 = codec.decode(out2[:size2], n * wb, wb)
                assert torch.equal(p2.positions.sort().values, codec.decode(out[:size], n * wb, wb).positions.sort().values)
            assert torch.equal(work, new) and count == int((old != new).sum())
            patch = codec.decode(out[:size], n * wb, wb)
            image = old.view(torch.uint8).clone()
            got = codec.checksum(image, wb) + codec.delta_checksum(image, patch)
            assert int(delta) == patch.delta_sum
            codec.apply(image, patch)
            assert torch.equal(image, new.view(torch.uint8))
            assert int(got) == int(codec.checksum(new.view(torch.uint8), wb))
            # the kernel's own delta sum (added up in the walk, one atomic per tile) is the true change
            old_sum = codec.checksum(old.view(torch.uint8).clone(), wb)
            assert int(old_sum + delta.reshape(())) == int(got)
            if fused:
                assert int(old_sum + delta2.reshape(())) == int(got)
    print("interpreted ok")
    """
)


def test_the_triton_kernel_run_by_the_interpreter_writes_a_correct_patch() -> None:
    """The CUDA kernel's logic (tiles, popcount ranks, one atomic per block), executed by Triton's
    CPU interpreter; on a GPU, tests/test_gpu_delta_codec.py runs it compiled."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "interpreted ok" in proc.stdout, proc.stderr[-3000:]
