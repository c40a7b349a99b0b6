"""The recording cast on real GPUs (`delta_base="cast"`); run on the GPU machine with -m gpu."""

from __future__ import annotations

import pytest
import torch

from cast_ranks import cast_rank
from ckpt_engine.delta import codec
from ckpt_engine.delta.recorder import CastBucket, CastRecorder, CastSlice
from ranks import run_ranks

pytestmark = pytest.mark.gpu


def _one_bucket(sizes: list[int], dev: torch.device) -> CastRecorder:
    """A recorder of one bucket holding bf16 tensors t0, t1, ... of `sizes` words, in order."""
    slices, at = [], 0
    for i, k in enumerate(sizes):
        slices.append(CastSlice(f"t{i}", (k,), "bfloat16", 0, 0, 2 * k, 2 * at))
        at += k
    return CastRecorder([CastBucket(0, 2 * at, 2, tuple(slices))], dev, 0.25)


def test_the_recording_cast_writes_what_torch_casts_and_records_every_changed_word() -> None:
    """Compiled on the GPU: the recorder's bf16 words equal torch's CUDA cast bit for bit (NaN,
    -0.0, inf, overflow, subnormals), and its patch holds exactly the changed words, with the
    delta sum that turns the old image's checksum into the new one's."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(5)
    sizes = [3 * 65536 + 17, 8192, 5, 4096 * 3]
    n = sum(sizes)
    rec = _one_bucket(sizes, dev)
    masters = [torch.randn(k, generator=g, device=dev) * 0.02 for k in sizes]
    masters[2][:] = torch.tensor([float("nan"), -0.0, float("inf"), 3.4e38, 1e-40], device=dev)
    wires = [m.to(torch.bfloat16) for m in masters]
    rec.bind({f"t{i}": (m, w) for i, (m, w) in enumerate(zip(masters, wires))})
    for m in masters:
        m.add_(torch.randn(m.shape, generator=g, device=dev) * 2e-4 * (torch.rand(m.shape, generator=g, device=dev) < 0.03))
    masters[2][1] = 0.0
    before = torch.cat([w.view(torch.int16) for w in wires])
    rec.cast_()
    after = torch.cat([w.view(torch.int16) for w in wires])
    assert torch.equal(after, torch.cat([m.to(torch.bfloat16).view(torch.int16) for m in masters]))
    rec._states[0].base_id = 1
    size, delta, count = rec.take(0, 1).finish()
    changed = (before != after).nonzero().reshape(-1)
    assert count == changed.numel() > 0 and size is not None
    patch = codec.decode(rec._states[0].out[:size], 2 * n, 2)
    assert torch.equal(patch.positions.long().sort().values, changed)
    assert torch.equal(codec.checksum(before.view(torch.uint8), 2) + delta, codec.checksum(after.view(torch.uint8), 2))


def test_three_compiled_casts_between_syncs_merge_into_one_patch_of_last_values() -> None:
    """Compiled on the GPU: three casts since the sync append to one patch and the torch merge
    keeps each changed word once, ascending, with its last value, including words that moved and
    moved back (not in the patch: equal to the base again, or in it with the base's value is also
    exact, so only the image after apply and the checksum are asserted)."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(7)
    sizes = [2 * 65536 + 3, 4096, 11]
    n = sum(sizes)
    rec = _one_bucket(sizes, dev)
    masters = [torch.randn(k, generator=g, device=dev) * 0.02 for k in sizes]
    wires = [m.to(torch.bfloat16) for m in masters]
    rec.bind({f"t{i}": (m, w) for i, (m, w) in enumerate(zip(masters, wires))})
    rec.synced(1, {0})
    base = torch.cat([w.view(torch.int16) for w in wires]).clone()
    saved = [m.clone() for m in masters]
    for step in range(3):
        for m, m0 in zip(masters, saved):
            hit = torch.rand(m.shape, generator=g, device=dev) < 0.02
            m.add_(torch.randn(m.shape, generator=g, device=dev) * 2e-4 * hit)
            if step == 2:  # some words go back to where they were at the sync
                back = torch.rand(m.shape, generator=g, device=dev) < 0.005
                m[back] = m0[back]
        rec.cast_()
    after = torch.cat([w.view(torch.int16) for w in wires])
    assert torch.equal(after, torch.cat([m.to(torch.bfloat16).view(torch.int16) for m in masters]))
    size, delta, count = rec.take(0, 1).finish()
    assert size is not None
    patch = codec.decode(rec._states[0].out[:size], 2 * n, 2)
    pos = patch.positions.long()
    assert pos.numel() == count and torch.equal(pos, pos.unique())  # once each, ascending
    image = base.clone()
    image[pos] = patch.values.view(torch.int16)
    assert torch.equal(image, after)
    assert (base != after).sum() > 0
    assert torch.equal(codec.checksum(base.view(torch.uint8), 2) + delta, codec.checksum(after.view(torch.uint8), 2))


@pytest.mark.parametrize("in_place", [False, True])
def test_nccl_recorded_patches_are_bit_exact(in_place: bool) -> None:
    """Two GPUs over NCCL: real AdamW steps cast through the recorder, recorded patches sent, the
    receiver exact after each; two casts between syncs record one merged patch, a weight written
    outside the recorder goes dense, and both stay exact."""
    results = run_ranks(cast_rank, 2, backend="nccl", versions=5, lr=1e-5, in_place=in_place)
    assert all(r["bad"] == [] and r["errors"] == [] for r in results), [(r["bad"], r["errors"]) for r in results]
    assert all(p["recorded_buckets"] > 0 for p in results[0]["stats"][1:])
    results = run_ranks(cast_rank, 2, backend="nccl", versions=5, lr=1e-5, in_place=in_place, double_cast=2, touch=3)
    assert all(r["bad"] == [] and r["errors"] == [] for r in results), [(r["bad"], r["errors"]) for r in results]
    stats = results[0]["stats"]
    assert 0 < stats[3]["recorded_buckets"] < stats[4]["recorded_buckets"]
    results = run_ranks(cast_rank, 2, backend="nccl", versions=4, lr=1e-6, in_place=in_place, double_cast=2, steps_then=3)
    assert all(r["bad"] == [] and r["errors"] == [] for r in results), [(r["bad"], r["errors"]) for r in results]
    assert all(s["recorded_buckets"] == results[0]["bound_buckets"] > 0 for s in results[0]["stats"][1:])  # three casts, one patch


def test_fsdp2_shadows_record_two_steps_into_one_patch_on_a_gpu() -> None:
    """The FSDP2 adapter's shadows on a GPU: its pieces are the shadows, each step's cast writes
    what torch's cast of the fp32 shard gives, and the patch after two steps turns the bf16
    weights of the sync into those of now, checksum included."""
    from cast_ranks import fsdp2_shadows_rank
    from tests._trainer_mp import run_ranks as run_trainer_ranks

    (r,) = run_trainer_ranks(fsdp2_shadows_rank, 1, backend="nccl", device="cuda")
    assert r["cast_exact"], r
    assert 0 < r["changed"] <= r["count"] < r["words"] // 4, r  # a word may move and move back: in the patch, at its old value
    assert r.get("patch_exact") and r.get("sum_exact"), r
