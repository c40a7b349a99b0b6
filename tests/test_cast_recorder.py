"""Delta syncs whose patches the trainer's fp32 -> bf16 cast records (`delta_base="cast"`):
real AdamW steps, real gloo groups, receivers bit-exact, every fallback dense and exact."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from cast_ranks import cast_rank
from ckpt_engine.delta.recorder import CastBucket, CastRecorder, CastSlice
from ranks import run_ranks


def _receivers_exact(results: list[dict]) -> None:
    for r in results:
        assert r["bad"] == [] and r["errors"] == [], (r["bad"], r["errors"])


@pytest.mark.parametrize("senders,in_place", [(1, False), (1, True), (2, True)])
def test_recorded_patches_keep_every_receiver_bit_exact(senders: int, in_place: bool) -> None:
    """Six versions of real AdamW steps at lr 1e-5 (bf16 weights written only by the recorder, an
    fp32 router and an int buffer sent as they are, NaN / -0.0 / inf, a tensor larger than a
    bucket, row shards with two senders): the seed is dense, every later sync sends the recorded
    patches, the senders' weights equal torch's cast of their masters, and the sender keeps no
    base image (only patch areas, smaller than the bytes it sends)."""
    results = run_ranks(cast_rank, senders + 2, num_senders=senders, versions=6, lr=1e-5, in_place=in_place)
    _receivers_exact(results)
    for s in results[:senders]:
        seed, patches = s["stats"][0], s["stats"][1:]
        assert seed["patch_buckets"] == 0 and seed["wire_bytes"] == seed["dense_bytes"]
        assert all(p["recorded_buckets"] > 0 and p["recorded_buckets"] == p["patch_buckets"] for p in patches)
        assert sum(p["wire_bytes"] for p in patches) < 0.6 * sum(p["dense_bytes"] for p in patches)
        assert 0 < s["base_bytes"] < seed["dense_bytes"]


@pytest.mark.parametrize("steps", [2, 3])
def test_several_casts_between_syncs_send_one_merged_patch(steps: int) -> None:
    """Two or three optimizer steps (casts) before one sync, at lr 1e-6 (a trainer that syncs
    every k steps): each cast records on top of the last, so that sync still sends patches, each
    word once, and the receivers end exact; the syncs before and after patch as usual."""
    results = run_ranks(cast_rank, 3, versions=4, lr=1e-6, double_cast=2, steps_then=steps, in_place=True)
    _receivers_exact(results[1:])
    stats = results[0]["stats"]
    bound = results[0]["bound_buckets"]
    assert all(stats[v]["recorded_buckets"] == bound > 0 for v in (1, 2, 3))
    assert stats[1]["changed_fraction"] < stats[2]["changed_fraction"]  # more steps, more words
    assert stats[2]["wire_bytes"] < 0.5 * stats[2]["dense_bytes"]


def test_changes_past_the_patch_area_send_that_bucket_dense() -> None:
    """Four steps at lr 1e-5 before one sync change more words than the patch areas hold (a
    quarter of each bucket's words): those buckets go dense, the receivers stay exact, and the
    next sync (one step) patches again."""
    results = run_ranks(cast_rank, 3, versions=4, lr=1e-5, double_cast=2, steps_then=4, in_place=True)
    _receivers_exact(results[1:])
    stats = results[0]["stats"]
    assert stats[2]["recorded_buckets"] < results[0]["bound_buckets"]
    assert stats[3]["recorded_buckets"] > 0


def test_a_sync_without_a_step_sends_empty_patches() -> None:
    """Two syncs with no optimizer step between them: the second sends every recorded bucket as an
    empty patch (a header and nothing else), and the receivers stay exact."""
    results = run_ranks(cast_rank, 2, versions=4, lr=1e-5, idle=3, in_place=True)
    _receivers_exact(results[1:])
    stats = results[0]["stats"]
    assert stats[3]["recorded_buckets"] == results[0]["bound_buckets"] > 0
    assert stats[3]["changed_fraction"] < 0.05 and stats[3]["wire_bytes"] < 0.2 * stats[3]["dense_bytes"]  # only the router bucket is dense


@pytest.mark.parametrize("senders", [1, 2])
def test_a_source_that_names_its_anchors_is_walked_once(senders: int) -> None:
    """A sharded source names the tensors its pieces are views of: after the seed the sender
    replays its sources per bucket without walking them; a weight moved to new memory (and bound
    again) makes it walk anew, that sync goes dense, and the next replays again; all exact."""
    results = run_ranks(cast_rank, senders + 1, num_senders=senders, versions=5, lr=1e-5, walk=True, move=3, in_place=True)
    _receivers_exact(results)
    for s in results[:senders]:
        st = s["stats"]
        assert [x["walk_skipped"] for x in st] == [0.0, 1.0, 1.0, 0.0, 1.0]
        assert st[2]["recorded_buckets"] > 0 and st[3]["recorded_buckets"] == 0 and st[4]["recorded_buckets"] > 0


def test_a_weight_written_outside_the_recorder_is_sent_dense() -> None:
    """A bf16 weight changed by a torch op after the cast (torch's version counter moves): its
    bucket's recorded patch would miss that word, so that bucket goes dense and the receivers get
    the touched word; the other buckets still travel as patches."""
    results = run_ranks(cast_rank, 3, versions=5, lr=1e-5, touch=3, in_place=True)
    _receivers_exact(results[1:])
    stats = results[0]["stats"]
    assert stats[2]["recorded_buckets"] == results[0]["bound_buckets"]  # after Adam's first step, every bucket fits
    assert stats[3]["recorded_buckets"] == stats[2]["recorded_buckets"] - 1
    assert stats[4]["recorded_buckets"] == stats[2]["recorded_buckets"]


def test_a_sender_that_never_binds_its_recorder_sends_dense() -> None:
    """delta_base="cast" without a bound recorder: nothing is recorded, every bucket is dense
    (wire bytes = dense bytes), and the receivers are exact."""
    results = run_ranks(cast_rank, 2, versions=3, lr=1e-5, bind=False)
    _receivers_exact(results[1:])
    assert all(s["recorded_buckets"] == 0 and s["wire_bytes"] == s["dense_bytes"] for s in results[0]["stats"])


def test_a_corrupt_recorded_patch_is_caught_and_the_old_weights_stay() -> None:
    """A byte flipped in a recorded patch on the wire: in-place receivers name the checksum
    mismatch (or the malformed patch) and still hold the previous version exactly."""
    results = run_ranks(cast_rank, 3, versions=4, lr=1e-5, corrupt=2, in_place=True)
    for r in results[1:]:
        assert len(r["errors"]) == 1 and r["errors"][0].startswith("v2:")
        assert any(w in r["errors"][0] for w in ("checksum mismatch", "malformed patch", "outside every tensor"))
        assert r["bad"] == [] and r["kept"] == []


def _recorder(n: int = 100) -> CastRecorder:
    b = CastBucket(0, 2 * n, 2, (CastSlice("w", (n,), "bfloat16", 0, 0, 2 * n, 0),))
    return CastRecorder([b], torch.device("cpu"), 0.25)


@pytest.mark.parametrize(
    "pairs,match",
    [
        ({}, "not bound"),
        ({"w": (torch.zeros(100), torch.zeros(100, dtype=torch.bfloat16)), "x": (torch.zeros(1), torch.zeros(1, dtype=torch.bfloat16))}, "hold no bf16 bytes"),
        ({"w": (torch.zeros(100, dtype=torch.float64), torch.zeros(100, dtype=torch.bfloat16))}, "casts float32 to bfloat16"),
        ({"w": (torch.zeros(100), torch.zeros(100))}, "casts float32 to bfloat16"),
        ({"w": (torch.zeros(10, 10), torch.zeros(100, dtype=torch.bfloat16))}, "of one shape"),
        ({"w": (torch.zeros(50), torch.zeros(50, dtype=torch.bfloat16))}, "holds 50 words"),
        ({"w": (torch.zeros(100), "weights")}, "pair of tensors"),
    ],
)
def test_bad_bindings_are_refused_by_name(pairs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _recorder().bind(pairs)


def test_cast_before_bind_is_a_call_order_error() -> None:
    with pytest.raises(RuntimeError, match="bind"):
        _recorder().cast_()


_INTERPRETED = textwrap.dedent(
    """
    import torch
    from ckpt_engine.delta import codec, kernels
    from ckpt_engine.delta.recorder import CastBucket, CastRecorder, CastSlice

    g = torch.Generator().manual_seed(3)
    sizes = [70001, 64, 4096, 7, 65536 + 3]  # odd and aligned pieces, across h groups
    n = sum(sizes)
    slices, at = [], 0
    for i, k in enumerate(sizes):
        slices.append(CastSlice(f"t{i}", (k,), "bfloat16", 0, 0, 2 * k, 2 * at))
        at += k
    bucket = CastBucket(0, 2 * n, 2, tuple(slices))
    masters0 = [torch.randn(k, generator=g) * 0.02 for k in sizes]
    masters0[3][:4] = torch.tensor([5.0, -0.0, float("inf"), 3.0e38])
    masters1 = [m.clone() for m in masters0]
    for m in masters1:
        m.add_(torch.randn(m.shape, generator=g) * 1e-4 * (torch.rand(m.shape, generator=g) < 0.05))
    masters1[3][4] = float("-inf")
    masters1[3][0] = float("nan")  # torch's CPU cast writes 0x7FC0 or 0xFFFF by code path, the kernel CUDA's 0x7FFF
    results = []
    for fused in (False, True):
        kernels.available = (lambda device: True) if fused else (lambda device: False)  # the interpreter runs CPU tensors
        rec = CastRecorder([bucket], torch.device("cpu"), 0.25)
        wires = [m.to(torch.bfloat16) for m in masters0]
        ms = [m.clone() for m in masters0]
        rec.bind({f"t{i}": (ms[i], wires[i]) for i in range(len(sizes))})
        assert (rec._states[0].tables is not None) == fused
        for m, m1 in zip(ms, masters1):
            m.copy_(m1)
        before = torch.cat([w.view(torch.int16) for w in wires]).view(torch.uint8)
        rec.cast_()
        after = torch.cat([w.view(torch.int16) for w in wires]).view(torch.uint8)
        rec._states[0].base_id = 1
        diff = rec.take(0, 1)
        size, delta, count = diff.finish()
        assert torch.equal(codec.checksum(before, 2) + delta, codec.checksum(after, 2)), "delta sum"
        for w, m1 in zip(wires, masters1):  # torch's own CPU cast writes 0x7FC0 or 0xFFFF for a NaN, by code path
            want = m1.to(torch.bfloat16)
            nan = want.isnan()
            assert torch.equal(w.isnan(), nan) and torch.equal(w.view(torch.int16)[~nan], want.view(torch.int16)[~nan]), "cast differs"
            if fused:
                assert bool((w.view(torch.int16)[nan] == 0x7FFF).all())
        patch = codec.decode(diff.out[:size], 2 * n, 2)
        order = patch.positions.argsort()
        results.append((count, int(delta), patch.positions[order], patch.values[order]))
    (c0, d0, p0, v0), (c1, d1, p1, v1) = results
    nan_at = sizes[0] + sizes[1] + sizes[2]  # the NaN word: changed in both, to different NaN bits
    assert c0 == c1 > 0, (c0, c1)
    assert torch.equal(p0.long(), p1.long()) and nan_at in p0.tolist()
    keep = p0.long() != nan_at
    assert torch.equal(v0[keep], v1[keep]) and int(v1[~keep]) == 0x7FFF
    print("interpreted ok", c0)
    """
)


def test_the_recording_cast_kernel_run_by_the_interpreter_matches_the_host_path() -> None:
    """The CUDA recording cast (one launch per bucket through a piece table, aligned and odd
    pieces), executed by Triton's CPU interpreter: the same bf16 words as torch's cast (-0.0, inf,
    overflow to inf; a NaN as CUDA's canonical 0x7FFF) and the same patch, count and delta sum as
    the host path (whose NaN is torch's CPU one: the NaN word is in both patches)."""
    pytest.importorskip("triton")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "interpreted ok" in proc.stdout, proc.stderr[-3000:]
