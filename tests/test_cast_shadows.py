"""A trainer adapter's bf16 shadows of its own pieces, bound to a real cast recorder (CPU): what
they hold, when they bind anew, and what they refuse, by name. The full path (FSDP2 ranks, the
daemon, reference engines) is in test_daemon_senders.py."""

from __future__ import annotations

import pytest
import torch

from ckpt_engine.delta import codec
from ckpt_engine.delta.recorder import CastBucket, CastRecorder, CastSlice
from ckpt_engine.trainer_adapters.cast_shadows import CastShadows

SIZES = {"a": 4096, "b": 300}


def _recorder() -> CastRecorder:
    slices, at = [], 0
    for name, n in SIZES.items():
        slices.append(CastSlice(name, (n,), "bfloat16", 0, 0, 2 * n, 2 * at))
        at += n
    return CastRecorder([CastBucket(0, 2 * at, 2, tuple(slices))], torch.device("cpu"), 0.25)


def _masters(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(n, generator=g) * 0.02 for name, n in SIZES.items()}


def _cast(masters: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([masters[n].to(torch.bfloat16).view(torch.int16) for n in SIZES])


def test_shadows_hold_the_cast_and_a_step_records_what_changed() -> None:
    masters, rec, shadows = _masters(), _recorder(), CastShadows()
    assert shadows.piece("a") is None and not shadows.active
    assert shadows.bind(rec, masters.__getitem__)
    assert shadows.active and shadows.nbytes == 2 * sum(SIZES.values())
    before = torch.cat([shadows.piece(n).view(torch.int16) for n in SIZES]).clone()
    assert torch.equal(before, _cast(masters))
    rec.synced(1, {0})
    masters["a"][::7] += 1e-3  # an optimizer step
    shadows.cast_()
    after = torch.cat([shadows.piece(n).view(torch.int16) for n in SIZES])
    assert torch.equal(after, _cast(masters))
    size, _delta, count = rec.take(0, 1).finish()
    patch = codec.decode(rec._states[0].out[:size], 2 * sum(SIZES.values()), 2)
    assert torch.equal(patch.positions.long(), (before != after).nonzero().reshape(-1)) and count > 0
    assert not shadows.bind(rec, masters.__getitem__)  # nothing moved: no new binding, the patch stays
    assert rec.take(0, 1) is not None


def test_a_master_written_outside_the_step_is_cast_before_the_sync() -> None:
    masters, rec, shadows = _masters(), _recorder(), CastShadows()
    shadows.bind(rec, masters.__getitem__)
    rec.synced(1, {0})
    with torch.no_grad():
        masters["b"][:3] = 1.0  # in place: the version counter moves, the storage does not
    assert not shadows.bind(rec, masters.__getitem__)
    assert torch.equal(torch.cat([shadows.piece(n).view(torch.int16) for n in SIZES]), _cast(masters))
    size, _delta, count = rec.take(0, 1).finish()
    assert size is not None and count == 3  # recorded as a patch of the three words


def test_moved_masters_or_a_new_recorder_bind_anew() -> None:
    masters, rec, shadows = _masters(), _recorder(), CastShadows()
    shadows.bind(rec, masters.__getitem__)
    rec.synced(1, {0})
    moved = {n: t.clone() for n, t in masters.items()}  # a checkpoint loaded into new storage
    assert shadows.bind(rec, moved.__getitem__)
    assert rec.take(0, 1) is None  # the next sync is dense
    other = _recorder()  # a new plan
    assert shadows.bind(other, moved.__getitem__) and other.binding == 1


def test_masters_that_cannot_be_recorded_are_refused_by_name() -> None:
    shadows = CastShadows()
    masters = _masters()
    masters["b"] = masters["b"].to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"'b' is held in torch.bfloat16, not float32"):
        shadows.bind(_recorder(), masters.__getitem__)
    masters = _masters()
    masters["a"] = torch.randn(2 * SIZES["a"])[::2]
    with pytest.raises(ValueError, match=r"piece of 'a' is not contiguous"):
        shadows.bind(_recorder(), masters.__getitem__)
    assert not shadows.active and shadows.piece("a") is None


def test_fsdp2_shadows_record_two_steps_into_one_patch() -> None:
    """The FSDP2 adapter on one gloo rank: its pieces are the shadows, each step's cast writes
    what torch's cast of the fp32 shard gives, and the patch after two steps turns the bf16
    weights of the sync into those of now, checksum included (the GPU twin is in
    test_gpu_cast_recorder.py)."""
    from cast_ranks import fsdp2_shadows_rank
    from tests._trainer_mp import run_ranks

    (r,) = run_ranks(fsdp2_shadows_rank, 1, device="cpu")
    assert r["cast_exact"], r
    assert 0 < r["changed"] <= r["count"] < r["words"] // 4, r  # a word may move and move back: in the patch, at its old value
    assert r.get("patch_exact") and r.get("sum_exact"), r
