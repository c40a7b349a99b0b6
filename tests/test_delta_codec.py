"""Delta codec (ckpt_engine.delta.codec): round trips, checksum identity, hostile payloads (CPU)."""

from __future__ import annotations

import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckpt_engine.delta import codec, layout
from ckpt_engine.delta.codec import PATCH_HEADER_BYTES, PatchError
from ckpt_engine.delta.direct import capacity

WORD_BYTES = [1, 2, 4, 8]
IMPLS = ["auto", "torch"]  # both plain torch ops on a CPU: auto must resolve to it
MASK64 = (1 << 64) - 1


def _h(i: int) -> int:
    """Reference h(i) in Python ints: A(i mod 2**16) * B(i div 2**16) mod 2**64, both odd; A from
    32-bit arithmetic, B a 64-bit xorshift-multiply mix."""
    a = ((((i & 0xFFFF) + 1) * 0x9E3779B1 & 0xFFFFFFFF) >> 1) | 1
    x = ((i >> 16) + 1) * 0xBF58476D1CE4E5B9 & MASK64
    signed = x - (1 << 64) if x >> 63 else x
    b = (x ^ ((signed >> 31) & MASK64)) | 1
    return a * b & MASK64


def _signed(x: int) -> int:
    x &= MASK64
    return x - (1 << 64) if x >> 63 else x


def changed_images(word_bytes: int, num_words: int, frac: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(base, new) bytes of `num_words` words with a `frac` of them changed (seeded)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, 256, (num_words * word_bytes,), dtype=torch.uint8, generator=g)
    new = base.clone()
    words = new.view(codec.word_dtype(word_bytes))
    changed = torch.rand(num_words, generator=g) < frac
    words[changed] ^= torch.randint(1, 127, (int(changed.sum()),), generator=g).to(words.dtype)
    return base, new


def _roundtrip(base: torch.Tensor, new: torch.Tensor, word_bytes: int, impl: str) -> int | None:
    """Encode, decode, check the checksum identity and apply; returns the patch size."""
    out = torch.empty(codec.max_patch_bytes(new.numel(), word_bytes), dtype=torch.uint8)
    n = codec.encode(base, new, word_bytes, out)
    num_changed = int((base.view(codec.word_dtype(word_bytes)) != new.view(codec.word_dtype(word_bytes))).sum())
    expect = PATCH_HEADER_BYTES + (num_changed * 4 + 7) // 8 * 8 + num_changed * word_bytes  # int32 positions, then values
    if n is None:  # more changed words than a patch smaller than the image may carry
        assert num_changed > capacity(new.numel(), word_bytes, 1.0) or expect >= new.numel()
        return None
    assert n == expect < new.numel()
    patch = codec.decode(out[:n], new.numel(), word_bytes)
    assert patch.positions.numel() == num_changed
    delta = codec.delta_checksum(base, patch, impl=impl)
    assert int(delta) == patch.delta_sum
    assert int(codec.checksum(base, word_bytes, impl=impl) + delta) == int(codec.checksum(new, word_bytes, impl=impl))
    image = base.clone()
    codec.apply(image, patch)
    assert torch.equal(image, new)
    return n


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    word_bytes=st.sampled_from(WORD_BYTES),
    num_words=st.integers(0, 700),
    frac=st.sampled_from([0.0, 0.001, 0.02, 0.1, 0.3, 0.6, 0.9, 1.0]) | st.floats(0, 1),
    seed=st.integers(0, 2**31),
    impl=st.sampled_from(IMPLS),
)
def test_roundtrip_is_bit_exact(word_bytes: int, num_words: int, frac: float, seed: int, impl: str) -> None:
    base, new = changed_images(word_bytes, num_words, frac, seed)
    _roundtrip(base, new, word_bytes, impl)


@settings(max_examples=40, deadline=None)
@given(word_bytes=st.sampled_from(WORD_BYTES), num_words=st.integers(1, 400), frac=st.sampled_from([0.05, 0.5, 1.0]), seed=st.integers(0, 2**31))
def test_encode_into_base_updates_the_base_patch_or_dense(word_bytes: int, num_words: int, frac: float, seed: int) -> None:
    base, new = changed_images(word_bytes, num_words, frac, seed)
    out = torch.zeros(codec.max_patch_bytes(new.numel(), word_bytes), dtype=torch.uint8)
    want = codec.encode(base, new, word_bytes, out.clone())
    kept = base.clone()
    assert codec.encode_into_base(kept, new, word_bytes, out) == want
    assert torch.equal(kept, new)  # patch or dense, the sender's base is now the new image


def test_chunked_paths_cross_chunk_and_group_boundaries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Small chunks force many chunks (some empty); 140k words cross two of h's 2**16-word groups."""
    monkeypatch.setattr(layout, "CHUNK_WORDS", 4096)
    from ckpt_engine.delta import checksums

    monkeypatch.setattr(checksums, "CHUNK_WORDS", 4096)
    base, new = changed_images(2, 140_003, 0.0, 1)
    words = new.view(torch.int16)
    words[[0, 5, 4095, 4096, 65535, 65536, 70000, 140_002]] += 1
    words[100_000:101_000] -= 3
    for impl in IMPLS:
        assert _roundtrip(base, new, 2, impl) is not None


@pytest.mark.parametrize("word_bytes", WORD_BYTES)
def test_checksum_matches_its_definition_and_leaves_data_alone(word_bytes: int) -> None:
    base, _ = changed_images(word_bytes, 66_000, 0.0, 3)  # one full 2**16-word group and a partial one
    words = base.view(codec.word_dtype(word_bytes)).tolist()
    want = _signed(sum(w * _h(i) for i, w in enumerate(words)))
    kept = base.clone()
    for impl in IMPLS:
        assert int(codec.checksum(base, word_bytes, impl=impl)) == want
        assert torch.equal(base, kept)
    assert all(_h(i) & 1 for i in range(0, 200_000, 997))


@settings(max_examples=60, deadline=None)
@given(word_bytes=st.sampled_from(WORD_BYTES), num_words=st.integers(1, 300), seed=st.integers(0, 2**31), data=st.data())
def test_any_single_word_change_changes_the_checksum(word_bytes: int, num_words: int, seed: int, data: st.DataObject) -> None:
    base, _ = changed_images(word_bytes, num_words, 0.0, seed)
    new = base.clone()
    i = data.draw(st.integers(0, num_words - 1))
    new.view(codec.word_dtype(word_bytes))[i] ^= data.draw(st.integers(1, 127))
    assert int(codec.checksum(new, word_bytes)) != int(codec.checksum(base, word_bytes))


def test_empty_image_and_all_changed_go_dense() -> None:
    empty = torch.empty(0, dtype=torch.uint8)
    assert codec.encode(empty, empty, 2, empty) is None
    base = torch.zeros(4096, dtype=torch.uint8)
    for word_bytes in WORD_BYTES:
        assert codec.encode(base, torch.ones_like(base), word_bytes, torch.empty_like(base)) is None
    unchanged = codec.encode(base, base.clone(), 2, out := torch.empty_like(base))
    assert unchanged == PATCH_HEADER_BYTES and codec.decode(out[:unchanged], 4096, 2).positions.numel() == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("impl", IMPLS)
def test_nan_payloads_and_signed_zeros_round_trip(dtype: torch.dtype, impl: str) -> None:
    """Values that compare equal as floats (0.0 / -0.0) or unequal to themselves (NaN) are
    compared and restored as bits."""
    specials = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1.5, -2.25], dtype=dtype)
    base = specials.repeat(64)
    new = base.clone()
    new[0::7], new[1::7] = base[1::7], base[0::7]  # swap 0.0 and -0.0: equal as floats
    wb = dtype.itemsize
    bits = new.view(codec.word_dtype(wb))
    bits[2::14] ^= 1  # another NaN payload: still NaN
    bits[9::14] |= 1 << (8 * wb - 1)  # negative NaN
    same = torch.randn(4000, generator=torch.Generator().manual_seed(0)).to(dtype)  # unchanged words
    base_b, new_b = (torch.cat([same, t]).view(torch.uint8).clone() for t in (base, new))
    assert not torch.equal(base_b, new_b)
    assert _roundtrip(base_b, new_b, wb, impl) is not None


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    word_bytes=st.sampled_from(WORD_BYTES),
    num_words=st.integers(1, 300),
    frac=st.sampled_from([0.01, 0.05, 0.2, 0.5]),
    seed=st.integers(0, 2**31),
    impl=st.sampled_from(IMPLS),
    data=st.data(),
)
def test_a_flipped_byte_is_rejected_or_caught_by_the_checksum(
    word_bytes: int, num_words: int, frac: float, seed: int, impl: str, data: st.DataObject
) -> None:
    base, new = changed_images(word_bytes, num_words, frac, seed)
    out = torch.empty(codec.max_patch_bytes(new.numel(), word_bytes), dtype=torch.uint8)
    n = codec.encode(base, new, word_bytes, out)
    if n is None:
        return
    payload = out[:n].clone()
    at = data.draw(st.integers(0, n - 1))
    payload[at] ^= data.draw(st.integers(1, 255))
    announced = int(codec.checksum(new, word_bytes))  # what the sender sends beside the patch
    try:
        patch = codec.decode(payload, new.numel(), word_bytes)
    except PatchError:
        return
    got = int(codec.checksum(base, word_bytes) + codec.delta_checksum(base, patch, impl=impl))
    image = base.clone()
    codec.apply(image, patch)
    # Either the receiver's own check fails, or the flip was harmless (the header's delta_sum).
    assert got != announced or torch.equal(image, new)
    assert torch.equal(image, new) == (got == announced)


def _header(kind: int = 4, word_bytes: int = 2, num_words: int = 64, num_changed: int = 2, magic: int = 0x50444B43, version: int = 1) -> bytes:
    return struct.pack("<IBBBBqqq", magic, version, kind, word_bytes, 0, num_words, num_changed, 0)


def _payload(*parts: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8)


def _pos32(*positions: int) -> bytes:
    raw = struct.pack(f"<{len(positions)}i", *positions)
    return raw + bytes(-len(raw) % 8)


@pytest.mark.parametrize(
    "case",
    [
        (_payload(b"\x00" * 8), "shorter than the 32-byte header"),
        (_payload(_header(magic=0x12345678), _pos32(1, 2), b"\x00" * 4), "bad magic"),
        (_payload(_header(version=9), _pos32(1, 2), b"\x00" * 4), "format version 9"),
        (_payload(_header(kind=7), _pos32(1, 2), b"\x00" * 4), "unknown patch kind 7"),
        (_payload(_header(word_bytes=4), _pos32(1, 2), b"\x00" * 8), "word_bytes=4"),
        (_payload(_header(num_words=65), _pos32(1, 2), b"\x00" * 4), "patch is for 65 words, the image has 64"),
        (_payload(_header(num_changed=2**62), _pos32(1, 2), b"\x00" * 4), "outside"),
        (_payload(_header(num_changed=-1)), "outside"),
        (_payload(_header(num_changed=64), _pos32(1, 2), b"\x00" * 4), "needs exactly"),
        (_payload(_header(), _pos32(1, 2), b"\x00" * 3), "needs exactly"),
        (_payload(_header(), _pos32(1, 2), b"\x00" * 5), "needs exactly"),
        (_payload(_header(), _pos32(1, 64), b"\x00" * 4), "position is >= num_words=64"),
        (_payload(_header(), _pos32(-5, 2), b"\x00" * 4), "negative"),
        (_payload(_header(num_changed=1), struct.pack("<i", 1) + b"\x01\x00\x00\x00", b"\x00" * 2), "padding"),
        (_payload(_header(kind=1), _pos32(1, 2), b"\x00" * 4), "unknown patch kind 1"),
    ],
)
def test_hostile_payloads_are_named(case: tuple) -> None:
    payload, match, nbytes = case if len(case) == 3 else (*case, 128)
    with pytest.raises(PatchError, match=match):
        codec.decode(payload, nbytes, 2)


@settings(max_examples=200, deadline=None)
@given(
    kind=st.integers(0, 4),
    num_words=st.sampled_from([0, 1, 63, 64, 64, 64, 2**31, 2**62]),
    num_changed=st.integers(-(2**63), 2**63 - 1) | st.integers(0, 70),
    body=st.binary(max_size=600),
)
def test_random_headers_and_bodies_never_crash_or_overallocate(kind: int, num_words: int, num_changed: int, body: bytes) -> None:
    payload = _payload(_header(kind=kind, num_words=num_words, num_changed=num_changed), body)
    try:
        patch = codec.decode(payload, 128, 2)
    except PatchError:
        return
    p = patch.positions
    assert p.numel() == patch.values.numel() <= 64
    assert p.numel() == 0 or (0 <= int(p.min()) and int(p.max()) < 64)


def test_bad_arguments_are_value_errors() -> None:
    a = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="word_bytes must be one of 1, 2, 4, 8, got 3"):
        codec.encode(a, a, 3, a.clone())
    with pytest.raises(ValueError, match="must match"):
        codec.encode(a, a[:32], 2, a.clone())
    with pytest.raises(ValueError, match="not a multiple of word_bytes=8"):
        codec.encode(a[:60], a[:60], 8, a.clone())
    with pytest.raises(ValueError, match="contiguous 1-D uint8"):
        codec.encode(a.view(torch.int16), a.view(torch.int16), 2, a.clone())
    b = a.clone()
    b[0] = 1
    assert codec.encode(a, b, 1, torch.empty(16, dtype=torch.uint8)) is None  # no patch fits `out`: dense
    with pytest.raises(ValueError, match="starting 8-byte aligned"):
        codec.encode(a, a, 2, torch.empty(80, dtype=torch.uint8)[1:])
    with pytest.raises(ValueError, match="impl='triton' needs CUDA"):
        codec.checksum(a, 2, impl="triton")
    out = a.clone()
    patch = codec.decode(out[: codec.encode(a, a, 2, out)], 64, 2)
    with pytest.raises(ValueError, match="base has 64 words on cpu, the patch is for 32 words"):
        codec.apply(torch.zeros(128, dtype=torch.uint8), patch)
