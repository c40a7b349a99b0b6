"""Manifest encoding: exact round trip, and every malformed or hostile input refused cleanly."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt_engine.planning.buckets import plan_buckets
from ckpt_engine.manifest import ManifestError, TensorSpec, decode_manifest, encode_manifest


def _manifest():
    specs = [TensorSpec("a", "float32", (10, 3)), TensorSpec("c", "bool", ()), TensorSpec("b", "bfloat16", (5000,))]
    return plan_buckets(specs, 4096)


def _raw(manifest):
    return msgpack.unpackb(encode_manifest(manifest), raw=False)


def _encode(raw):
    return msgpack.packb(raw, use_bin_type=True)


def test_round_trip_is_exact() -> None:
    m = _manifest()
    assert decode_manifest(encode_manifest(m)) == m


def test_truncated_input_is_refused() -> None:
    data = encode_manifest(_manifest())
    for cut in (0, 1, len(data) // 2, len(data) - 1):
        with pytest.raises(ManifestError):
            decode_manifest(data[:cut])


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_only_raise_manifest_error(data: bytes) -> None:
    with pytest.raises(ManifestError):
        decode_manifest(data)


@settings(max_examples=200, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=8), lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4), max_leaves=20))
def test_random_msgpack_documents_only_raise_manifest_error(doc) -> None:
    with pytest.raises(ManifestError):
        decode_manifest(_encode(doc))


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda r: r["buckets"][0][1][0].__setitem__(1, "float128"), "unknown dtype 'float128'"),
        (lambda r: r["buckets"][0][1][0].__setitem__(5, 4080), "lies outside bucket"),
        (lambda r: r["buckets"][0][1][0].__setitem__(5, 2), "not aligned for float32"),
        (lambda r: r["buckets"][0][1][0].__setitem__(4, -1), "chunk_size must be a non-negative int"),
        (lambda r: r["buckets"][0][1][0].__setitem__(2, [10, True]), "shape dims must be non-negative ints"),
        (lambda r: r["buckets"][0][1][1].__setitem__(5, 8), "overlap"),
        (lambda r: r["buckets"][0][1].append(list(r["buckets"][0][1][0])), "appears twice"),
        (lambda r: r.__setitem__("format", 99), "unsupported manifest format"),
        (lambda r: r.__setitem__("evil", 1), "manifest keys must be"),
        (lambda r: r.__setitem__("alignment", r.pop("alignment")), "in this order"),
        (lambda r: r.__setitem__("bucket_size", "big"), "bucket_size must be an int"),
        (lambda r: r["buckets"].append([0, []]), "is empty"),
        (lambda r: r["buckets"][0].__setitem__(0, 1), "sender must be an int in"),
        (lambda r: r.__setitem__("num_senders", 0), "num_senders must be an int"),
        (lambda r: r["buckets"].pop(), "ends before the tensor.s last chunk"),
    ],
)
def test_inconsistent_manifests_are_refused(mutate, match: str) -> None:
    raw = _raw(_manifest())
    mutate(raw)
    with pytest.raises(ManifestError, match=match):
        decode_manifest(_encode(raw))


def test_tampered_content_fails_the_digest() -> None:
    raw = _raw(_manifest())
    raw["buckets"][0][1][0][0] = "renamed"
    with pytest.raises(ManifestError, match="digest does not match"):
        decode_manifest(_encode(raw))


def test_oversized_and_extension_input_refused() -> None:
    with pytest.raises(ManifestError, match="more than the limit"):
        decode_manifest(b"\x00" * (64 * 1024 * 1024 + 1))
    with pytest.raises(ManifestError, match="not valid msgpack"):
        decode_manifest(msgpack.packb({"format": msgpack.ExtType(1, b"x"), **{k: 0 for k in "abcde"}}))


def test_tensor_spec_validation() -> None:
    with pytest.raises(ManifestError, match="unknown dtype"):
        TensorSpec("x", "float7", (1,))
    with pytest.raises(ManifestError, match="non-empty str"):
        TensorSpec("", "float32", (1,))
    with pytest.raises(ManifestError, match="non-negative ints"):
        TensorSpec("x", "float32", (-1,))


def _hostile(num: int) -> bytes:
    """A manifest whose header is fine and whose one bucket claims `num` entries of little bytes."""
    head = msgpack.packb({"format": 2, "bucket_size": 4096, "alignment": 256, "num_senders": 1}, use_bin_type=True)[1:]
    entry = msgpack.packb(["a", "bool", [], 0, 0, 0], use_bin_type=True)
    body = b"".join([b"\x86", head, msgpack.packb("buckets"), b"\x91\x92\x00", b"\xdd" + num.to_bytes(4, "big")])
    return body + entry * 3 + msgpack.packb("digest") + msgpack.packb("0" * 64)


def test_hostile_entry_counts_are_refused_before_building_anything() -> None:
    """A 10 MB manifest of tiny arrays (or one that claims millions of entries it does not hold) is
    refused within a fraction of a second, reading only its first few entries."""
    import time
    import tracemalloc

    tracemalloc.start()
    t0 = time.perf_counter()
    with pytest.raises(ManifestError, match="more than the limit"):
        decode_manifest(_hostile(3_000_000_000))
    flood = msgpack.packb({"format": 2, "bucket_size": 4096, "alignment": 256, "num_senders": 1,
                           "buckets": [[0, [[]] * 5_000_000]], "digest": "0" * 64}, use_bin_type=True)
    assert len(flood) > 5_000_000
    with pytest.raises(ManifestError):
        decode_manifest(flood)
    elapsed = time.perf_counter() - t0
    _cur, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 64 * 1024 * 1024, f"refusing hostile manifests took {peak / 2**20:.0f} MiB"
    del elapsed  # the time is a benchmark figure (bench/RESULTS.md), not an assertion


def _claiming(senders: int, entries: int) -> bytes:
    """A well-formed manifest of `entries` tiny entries whose header names `senders` senders."""
    entry = ["layer0.weight", "float32", [64, 256], 0, 4, 0]
    return msgpack.packb({"format": 2, "bucket_size": 4096, "alignment": 256, "num_senders": senders,
                          "buckets": [[0, [entry] * entries]], "digest": "0" * 64}, use_bin_type=True)


def test_the_decode_budget_comes_from_the_receivers_group_never_the_manifests_claim() -> None:
    """Issue 45: a hostile manifest naming 65536 senders sized its own budget (29-77 s and +312 MiB a
    validate); the budget is the receiver's tensors and its group's senders, and a claim of more
    senders than the group has is refused from the header."""
    from ckpt_engine.manifest import ManifestBudget

    specs = [TensorSpec(f"layer{i}.weight", "float32", (64, 256)) for i in range(4)]
    with pytest.raises(ManifestError, match="names 65536 senders; this receiver's weight-sync group has 2"):
        decode_manifest(_claiming(65536, 20_000), ManifestBudget.expecting(specs, senders=2))
    budget = ManifestBudget.expecting(specs, senders=2)
    assert budget.entries(4096, budget.senders) < 20_000 < ManifestBudget.expecting(specs, senders=65536).entries(4096, 65536)
    with pytest.raises(ManifestError, match="more than the limit"):  # within the group's senders, the entries are bounded by them
        decode_manifest(_claiming(2, 20_000), budget)
