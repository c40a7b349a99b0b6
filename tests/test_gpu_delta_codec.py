"""Delta codec on CUDA: the one-pass Triton diff writes patches that decode, check and apply like
the CPU path's (same size and checksum; positions in tile order), round-trip bit-exactly, and stay
within their host-sync budget. Run on the GPU machine: -m gpu."""

from __future__ import annotations

import warnings

import pytest
import torch

from ckpt_engine.delta import accel, codec
from ckpt_engine.delta.codec import PatchError
from test_delta_codec import changed_images

pytestmark = pytest.mark.gpu


def _impls() -> list[str]:
    return ["triton", "torch"] if accel.triton_on(torch.device("cuda")) else ["torch"]


def _cpu_patch(base: torch.Tensor, new: torch.Tensor, word_bytes: int) -> int | None:
    out = torch.empty(codec.max_patch_bytes(new.numel(), word_bytes), dtype=torch.uint8)
    return codec.encode(base, new, word_bytes, out)


def _gpu_roundtrip(base: torch.Tensor, new: torch.Tensor, word_bytes: int, impl: str) -> int | None:
    """Encode on the GPU, decode, check with `impl`'s checksums and apply; returns the patch size."""
    b, nw = base.cuda(), new.cuda()
    out = torch.empty(codec.max_patch_bytes(new.numel(), word_bytes), dtype=torch.uint8, device="cuda")
    n = codec.encode(b, nw, word_bytes, out)
    if n is None:
        return None
    patch = codec.decode(out[:n], new.numel(), word_bytes)
    delta = codec.delta_checksum(b, patch, impl=impl)
    assert int(delta) == patch.delta_sum
    got = int(codec.checksum(b, word_bytes, impl=impl) + delta)
    assert got == int(codec.checksum(new, word_bytes, impl="torch"))
    image = b.clone()
    codec.apply(image, patch)
    assert torch.equal(image.cpu(), new)
    kept = b.clone()
    assert codec.encode_into_base(kept, nw, word_bytes, torch.empty_like(out)) == n
    assert torch.equal(kept, nw)
    return n


@pytest.mark.parametrize("word_bytes", [1, 2, 4, 8])
@pytest.mark.parametrize("frac", [0.0, 0.003, 0.3, 0.97])
def test_gpu_patches_match_cpu_patches(word_bytes: int, frac: float) -> None:
    num_words = 3 * 65536 + 4099  # several h groups and Triton tiles, a partial last tile
    base, new = changed_images(word_bytes, num_words, frac, seed=int(frac * 1000) + word_bytes)
    want = _cpu_patch(base, new, word_bytes)
    for impl in _impls():
        assert _gpu_roundtrip(base, new, word_bytes, impl) == want, impl


def test_gpu_nan_and_signed_zero_bits_round_trip() -> None:
    x = torch.randn(100_000).to(torch.bfloat16)
    x[::50] = 0.0
    x[1::50] = float("nan")
    y = x.clone()
    y[::100] = -0.0  # equal as floats, different bits
    yb = y.view(torch.int16)
    yb[1::100] ^= 1  # another NaN payload
    base, new = x.view(torch.uint8), y.view(torch.uint8)
    for impl in _impls():
        assert _gpu_roundtrip(base, new, 2, impl) == _cpu_patch(base, new, 2)


def test_gpu_checksum_and_encode_host_syncs() -> None:
    """With the Triton kernels, checksum never waits for the device and encode waits once (the
    changed count)."""
    if not accel.triton_on(torch.device("cuda")):
        pytest.skip("needs Triton")
    base, new = changed_images(2, 1 << 20, 0.02, 7)
    b, nw = base.cuda(), new.cuda()
    out = torch.empty(codec.max_patch_bytes(b.numel(), 2), dtype=torch.uint8, device="cuda")
    for impl in ["triton"]:
        codec.encode_into_base(b.clone(), nw, 2, out)  # warm up (Triton compiles, caching allocator)
        codec.checksum(b, 2, impl=impl)
        kept = b.clone()
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                codec.checksum(b, 2, impl=impl)
                after_checksum = len(_syncs(caught))
                codec.encode_into_base(kept, nw, 2, out)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        assert after_checksum == 0, (impl, _syncs(caught))
        assert len(_syncs(caught)) == 1, (impl, _syncs(caught))


def _syncs(caught: list) -> list[str]:
    """The sync-debug warnings (not the one-time notice that the mode is a prototype)."""
    return [str(w.message) for w in caught if str(w.message).startswith("called a synchronizing")]


def test_gpu_flipped_bytes_are_rejected_or_caught() -> None:
    base, new = changed_images(2, 50_000, 0.02, 11)
    b, nw = base.cuda(), new.cuda()
    announced = int(codec.checksum(nw, 2))
    g = torch.Generator().manual_seed(5)
    for impl in _impls():
        for kind in ("scatter32",):
            out = torch.empty(codec.max_patch_bytes(b.numel(), 2), dtype=torch.uint8, device="cuda")
            n = codec.encode(b, nw, 2, out)
            assert n is not None
            outcomes = {"rejected": 0, "caught": 0, "harmless": 0}
            for at in torch.randint(0, n, (60,), generator=g).tolist():
                payload = out[:n].clone()
                payload[at] ^= 0x5A
                try:
                    patch = codec.decode(payload, b.numel(), 2)
                except PatchError:
                    outcomes["rejected"] += 1
                    continue
                got = int(codec.checksum(b, 2) + codec.delta_checksum(b, patch, impl=impl))
                image = b.clone()
                codec.apply(image, patch)
                exact = torch.equal(image, nw)
                assert exact == (got == announced), (impl, kind, at)
                outcomes["harmless" if exact else "caught"] += 1
            assert outcomes["rejected"] + outcomes["caught"] > 0


@pytest.mark.parametrize("word_bytes", [1, 2, 4, 8])
@pytest.mark.parametrize("frac", [0.0, 0.004, 0.02, 0.2])
@pytest.mark.parametrize("below", [1 / 32, 1 / 4])
def test_gpu_one_pass_bucket_diff_matches_the_cpu_diff(word_bytes: int, frac: float, below: float) -> None:
    """direct.BucketDiff compiled on the GPU (one kernel per piece, blocks claiming room with an
    atomic) writes the same changed words as the CPU path, in block order, and the same sums."""
    from ckpt_engine.delta.direct import BucketDiff, out_bytes

    if not accel.triton_on(torch.device("cuda")):
        pytest.skip("needs Triton")
    num_words = 3 * 65536 + 4099
    base, new = changed_images(word_bytes, num_words, frac, seed=11 + word_bytes)
    nbytes = num_words * word_bytes
    cuts = [0, 1, 70001, 70001 + 2048 * 3, 150000, num_words]
    results = []
    for device in ("cpu", "cuda"):
        work = base.to(device).clone()
        fresh = new.to(device)
        out = torch.empty(out_bytes(nbytes, word_bytes, below), dtype=torch.uint8, device=device)
        diff = BucketDiff(out, nbytes, word_bytes, below)
        assert diff._fused == (device == "cuda")
        wdt = codec.word_dtype(word_bytes)
        for lo, hi in zip(cuts, cuts[1:]):
            diff.add(fresh.view(wdt)[lo:hi], work.view(wdt)[lo:hi], lo)
        size, delta, count = diff.finish()
        assert torch.equal(work.cpu(), new)
        if device == "cuda":  # the same pieces in one launch through a table (odd cuts included)
            work2 = base.to(device).clone()
            out2 = torch.empty_like(out)
            diff2 = BucketDiff(out2, nbytes, word_bytes, below)
            news = [fresh.view(wdt)[lo:hi].clone() for lo, hi in zip(cuts, cuts[1:])]
            diff2.add_pieces([(t.data_ptr(), t.numel(), lo) for t, lo in zip(news, cuts)], work2.view(wdt))
            size2, delta2, count2 = diff2.finish()
            assert torch.equal(work2.cpu(), new) and (size2, int(delta2), count2) == (size, int(delta), count)
            if size is not None:
                assert torch.equal(out2[:32].cpu(), out[:32].cpu())
                got = codec.decode(out2[:size2].cpu(), nbytes, word_bytes).positions.sort().values
                assert torch.equal(got, codec.decode(out[:size].cpu(), nbytes, word_bytes).positions.sort().values)
        patch = None if size is None else codec.decode(out[:size].cpu(), nbytes, word_bytes)
        if patch is not None:
            order = patch.positions.argsort()
            results.append((count, int(delta), patch.positions[order], patch.values[order]))
        else:
            results.append((count, None, None, None))
    (c0, d0, p0, v0), (c1, d1, p1, v1) = results
    assert c0 == c1 == int((base.view(codec.word_dtype(word_bytes)) != new.view(codec.word_dtype(word_bytes))).sum())
    assert (p0 is None) == (p1 is None)
    if p0 is not None:
        assert d0 == d1 and torch.equal(p0, p1) and torch.equal(v0, v1)


@pytest.mark.parametrize("rows, num_warps", [(256, 8), (128, 4), (64, 4), (64, 2)])
def test_gpu_diff_writes_the_same_patch_and_sums_for_every_tile_shape(rows: int, num_warps: int) -> None:
    """The one-pass diff's count, base, delta sum and patch do not depend on how Triton lays a tile
    over its threads. Without the barrier before each round's base writes, 64 rows over 4 warps put
    a row's copies in two warps and the delta sum came out wrong at every rate (1×H200)."""
    from ckpt_engine.delta import kernels
    from ckpt_engine.delta.mixing import mix

    if not accel.triton_on(torch.device("cuda")):
        pytest.skip("needs Triton")
    n, first = 8192 * 40 + 77, 65536 - 4099  # spans two checksum groups
    for frac in (0.005, 0.02, 0.11):
        base, new = changed_images(2, n, frac, seed=int(frac * 1000))
        old_w, new_w = base.view(torch.int16), new.view(torch.int16)
        cap = n // 4
        local = torch.ne(new_w, old_w).nonzero().reshape(-1)  # the reference: torch ops on the CPU
        count = local.numel()
        want_pos, want_val = (local + first).to(torch.int32), new_w[local]
        total = int(mix(local + first).mul_(want_val.to(torch.int64) - old_w[local].to(torch.int64)).sum())
        for _ in range(3):  # a race shows in some runs only
            work = old_w.cuda().clone()
            state = torch.zeros(2, dtype=torch.int64, device="cuda")
            pos = torch.zeros(cap, dtype=torch.int32, device="cuda")
            val = torch.zeros(cap, dtype=torch.int16, device="cuda")
            kernels.diff_into(new_w.cuda(), work, first, state.view(torch.int32)[:1], state[1], pos, val, rows=rows, num_warps=num_warps)
            got_count = int(state.view(torch.int32)[0])
            assert (got_count, int(state[1])) == (count, total), (frac, rows, num_warps)
            assert torch.equal(work.cpu(), new_w)
            order = pos[:got_count].cpu().argsort()
            want_order = want_pos[:count].argsort()
            assert torch.equal(pos[:got_count].cpu()[order], want_pos[:count][want_order])
            assert torch.equal(val[:got_count].cpu()[order], want_val[:count][want_order])


def test_gpu_kernels_launch_on_their_tensors_device_not_the_current_one() -> None:
    """A sender's tensors on cuda:1 while cuda:0 is current (an engine in the same process, or the
    trainer's own choice): the join's warm-up and a patch round-trip run on cuda:1 (Triton launched
    on the current device refused them: 'Pointer argument cannot be accessed from Triton')."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    from ckpt_engine.delta import warm

    torch.cuda.set_device(0)
    warm.warm_up(torch.device("cuda:1"))
    assert "cuda:1" in warm.warmed()
    base, new = changed_images(2, 1 << 16, 0.05, seed=3)
    with torch.cuda.device(1):
        want = _gpu_roundtrip(base, new, 2, _impls()[0])
    torch.cuda.set_device(0)
    b, nw = base.to("cuda:1"), new.to("cuda:1")
    out = torch.empty(codec.max_patch_bytes(nw.numel(), 2), dtype=torch.uint8, device="cuda:1")
    assert codec.encode(b, nw, 2, out) == want
    assert torch.cuda.current_device() == 0
