"""The planner: every byte of every tensor covered exactly once, no overlap, deterministic."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt_engine.planning.buckets import plan_buckets
from ckpt_engine.manifest import DTYPE_ITEMSIZE, ManifestError, TensorSpec

dtypes = st.sampled_from(sorted(DTYPE_ITEMSIZE))
shapes = st.lists(st.integers(0, 40), min_size=0, max_size=3).map(tuple)


@st.composite
def spec_lists(draw):
    n = draw(st.integers(0, 40))
    return [TensorSpec(f"t{i}", draw(dtypes), draw(shapes)) for i in range(n)]


@settings(max_examples=100, deadline=None)  # hypothesis default; 300 took 9.4 s against 3.3 s on the 2-core box
@given(
    spec_lists(), st.sampled_from([256, 512, 1024, 4096]), st.sampled_from([1, 8, 256]), st.sampled_from([None, 1, 64, 300])
)
def test_every_byte_exactly_once(specs, bucket_size, alignment, solo) -> None:
    if bucket_size < alignment:
        return
    m = plan_buckets(specs, bucket_size, alignment, solo_bytes=solo)
    covered: dict[str, list[tuple[int, int]]] = {}
    for b in m.buckets:
        spans = sorted((e.bucket_offset, e.bucket_offset + e.chunk_size) for e in b.entries)
        assert all(s1 >= e0 for (_, e0), (s1, _) in zip(spans, spans[1:])), "chunks overlap in a bucket"
        assert b.nbytes <= bucket_size
        for e in b.entries:
            covered.setdefault(e.name, []).append((e.chunk_offset, e.chunk_offset + e.chunk_size))
            if e.is_whole:
                assert e.bucket_offset % alignment == 0
    assert [s.name for s in m.specs] == [s.name for s in specs]  # send order = source order
    for s in specs:
        ranges = sorted(covered[s.name])
        assert ranges[0][0] == 0 and ranges[-1][1] == s.nbytes
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), "gap or overlap inside a tensor"
    assert m.total_bytes == sum(s.nbytes for s in specs)
    assert plan_buckets(specs, bucket_size, alignment, solo_bytes=solo).digest == m.digest  # stable
    if solo is not None:
        for b in m.buckets:
            if any(e.nbytes >= solo or not e.is_whole for e in b.entries):
                assert len(b.entries) == 1, "a tensor of at least solo_bytes, or a chunk, shares its bucket"


def test_solo_tensors_get_their_own_bucket_and_small_ones_still_pack() -> None:
    specs = [TensorSpec("a", "float32", (4,)), TensorSpec("big", "float32", (100,)), TensorSpec("b", "float32", (4,)),
             TensorSpec("c", "float32", (4,)), TensorSpec("huge", "float32", (300,))]
    m = plan_buckets(specs, 1024, 16, solo_bytes=400)
    assert [[e.name for e in b.entries] for b in m.buckets] == [["a"], ["big"], ["b", "c"], ["huge"], ["huge"]]
    m = plan_buckets([*specs, TensorSpec("d", "float32", (4,))], 1024, 16, solo_bytes=400)
    assert [[e.name for e in b.entries] for b in m.buckets][-2:] == [["huge"], ["d"]]  # the last chunk is alone too
    assert [[e.name for e in b.entries] for b in plan_buckets(specs, 1024, 16).buckets] == [
        ["a", "big", "b", "c"], ["huge"], ["huge"]
    ]
    with pytest.raises(ValueError, match="solo_bytes"):
        plan_buckets(specs, 1024, solo_bytes=0)


def test_large_tensor_is_chunked_and_next_tensor_follows() -> None:
    m = plan_buckets([TensorSpec("big", "float32", (1000,)), TensorSpec("small", "float32", (4,))], 1024)
    big = [e for b in m.buckets for e in b.entries if e.name == "big"]
    assert [e.chunk_size for e in big] == [1024, 1024, 1024, 928]
    assert [b.index for b in m.buckets for e in b.entries if e.name == "big"] == [0, 1, 2, 3]
    # 928 bytes aligned up to 1024 leaves no room in bucket 3: the small tensor opens bucket 4.
    assert m.buckets[4].entries[0].name == "small" and m.buckets[4].entries[0].bucket_offset == 0
    m2 = plan_buckets([TensorSpec("big", "float32", (900,)), TensorSpec("small", "float32", (4,))], 1024)
    assert m2.buckets[-1].entries[-1].name == "small" and m2.buckets[-1].entries[-1].bucket_offset == 768


def test_known_digest_is_stable_across_runs() -> None:
    specs = [TensorSpec("w", "bfloat16", (3, 5)), TensorSpec("b", "float32", ())]
    assert plan_buckets(specs, 4096).digest == plan_buckets(list(specs), 4096).digest


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="positive multiple of the alignment"):
        plan_buckets([], 100)
    with pytest.raises(ManifestError, match="appears twice"):
        plan_buckets([TensorSpec("x", "float32", (1,))] * 2, 1024)
