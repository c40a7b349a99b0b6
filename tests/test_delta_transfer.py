"""Delta syncs over real gloo groups: only changed words travel, receivers end bit-exact."""

from __future__ import annotations

import pytest

from multisender import shard_rank
from ranks import run_ranks


@pytest.mark.parametrize("senders", [1, 2])
def test_chain_of_patches_is_bit_exact(senders: int) -> None:
    """Seven versions from real AdamW steps at an RL learning rate (bf16 wire, fp32 router kept,
    int and bool buffers, NaN / -0.0 / inf values, a tensor larger than a bucket): version 0 seeds
    the bases, the next six travel as patches; every receiver equals the sender byte for byte
    after each, and far fewer bytes travel than a dense sync's."""
    results = run_ranks(shard_rank, senders + 2, num_senders=senders, versions=7, lr=1e-5, delta="on")
    for r in results[senders:]:
        assert r["bad"] == [] and r["errors"] == []
        seed, patches = r["stats"][0], r["stats"][1:]
        assert seed["patch_buckets"] == 0 and seed["wire_bytes"] == seed["dense_bytes"]
        assert all(p["patch_buckets"] > 0 for p in patches)
        assert sum(p["wire_bytes"] for p in patches) < 0.6 * sum(p["dense_bytes"] for p in patches)
    total_base = sum(r["base_bytes"] for r in results[:senders])
    assert all(r["base_bytes"] <= 0.75 * total_base for r in results[:senders]) or senders == 1


def test_corrupt_patch_is_caught_and_the_old_weights_stay() -> None:
    """A byte flipped in a patch on the wire: every receiver names the bucket and the checksum
    mismatch, and the loader was never called for that sync (the receivers' tensors are the
    previous version's, checked by the helper's bit comparison not running)."""
    results = run_ranks(shard_rank, 3, versions=3, lr=1e-5, delta="on", corrupt=2)
    for r in results[1:]:
        assert len(r["errors"]) == 1 and "v2:" in r["errors"][0]
        assert "checksum mismatch" in r["errors"][0] or "malformed patch" in r["errors"][0]
        assert r["bad"] == []  # versions 0 and 1 arrived exact; version 2 was never loaded


@pytest.mark.parametrize("in_place", [False, True])
def test_calm_buckets_are_diffed_straight_from_the_source(in_place: bool) -> None:
    """At an RL learning rate few words change: after the first patch (packed, codec-encoded, as
    every bucket without history is) the senders diff those buckets in one pass from their source
    tensors, and the chain stays bit-exact."""
    results = run_ranks(shard_rank, 4, num_senders=2, versions=5, lr=1e-6, delta="on", in_place=in_place)
    for r in results[:2]:
        assert r["stats"][1]["direct_buckets"] == 0
        assert all(s["direct_buckets"] > 0 for s in r["stats"][2:])
    for r in results[2:]:
        assert r["bad"] == [] and r["errors"] == []


def test_a_wider_scatter_limit_diffs_busy_buckets_in_one_pass() -> None:
    """At lr 1e-5 many buckets change more than 1 word in 32: with `delta_scatter_below` 1/32
    they are packed first and then diffed; with the default (1/4) they are diffed in one pass
    from their source tensors, and the chain stays bit-exact."""
    def run(kwargs: dict) -> int:
        results = run_ranks(shard_rank, 3, num_senders=1, versions=4, lr=1e-5, delta="on", in_place=True, engine_kwargs=kwargs)
        for r in results[1:]:
            assert r["bad"] == [] and r["errors"] == []
            assert all(p["patch_buckets"] > 0 for p in r["stats"][1:])
        sender = results[0]["stats"][2:]
        return sum(int(s["direct_buckets"]) for s in sender)

    assert run({}) > run({"delta_scatter_below": 1 / 32})


@pytest.mark.parametrize("bad", [0, 0.75, True, "0.1", -0.1])
def test_the_scatter_limit_is_checked(bad: object) -> None:
    from tamper import GlooEngine

    with pytest.raises(ValueError, match="delta_scatter_below"):
        GlooEngine(bucket_size_bytes=1 << 20, delta_scatter_below=bad)


@pytest.mark.parametrize("senders", [1, 2])
def test_patches_land_in_the_loaders_own_tensors(senders: int) -> None:
    """Receivers that offer their own tensors (every entry in the wire layout) hold no base copy:
    their tensors are the base, each patch is checked against the words where they live and
    written there, and the chain stays bit-exact (a tensor larger than a bucket, sharded senders)."""
    results = run_ranks(shard_rank, senders + 2, num_senders=senders, versions=5, lr=1e-5, delta="on", in_place=True)
    for r in results[senders:]:
        assert r["bad"] == [] and r["errors"] == []
        assert all(s["in_place"] == 1.0 for s in r["stats"])
        assert r["base_bytes"] == 0
        assert all(p["patch_buckets"] > 0 for p in r["stats"][1:])


@pytest.mark.parametrize("skip", [0, 3])
def test_in_place_corrupt_patch_leaves_the_loaders_tensors_on_the_old_version(skip: int) -> None:
    """In place, each patch is written as soon as its old words are read, so receivers overlap
    the writes with the transfer; a later bad patch (`skip`: the sender corrupts its 4th) rolls
    every written one back from those old words."""
    results = run_ranks(shard_rank, 3, versions=3, lr=1e-5, delta="on", corrupt=2, in_place=True, corrupt_skip=skip)
    for r in results[1:]:
        assert len(r["errors"]) == 1 and "v2:" in r["errors"][0]
        assert "checksum mismatch" in r["errors"][0] or "malformed patch" in r["errors"][0] or "outside every tensor" in r["errors"][0]
        assert r["bad"] == [] and r["kept"] == []  # version 1 exactly, nothing of version 2


def test_in_place_receivers_name_the_first_bad_bucket_of_a_sync() -> None:
    """In place, every bucket's check is read back once after the last bucket: with two corrupt
    patches in one sync the error still names the earlier bucket, and every written patch of that
    sync is rolled back."""
    results = run_ranks(shard_rank, 3, versions=3, lr=1e-5, delta="on", corrupt=2, in_place=True, corrupt_skip=1, corrupt_count=2)
    tampered = results[0]["tampered"]
    assert len(tampered) == 2
    for r in results[1:]:
        assert len(r["errors"]) == 1 and f"bucket {min(tampered)} from sender" in r["errors"][0], (tampered, r["errors"])
        assert r["bad"] == [] and r["kept"] == []


def test_a_tensor_changed_outside_a_sync_is_no_longer_a_base() -> None:
    """A receiver whose own tensor was written between syncs refuses the next patch sync, naming
    the tensor, instead of patching on top of weights the sender does not know."""
    results = run_ranks(shard_rank, 3, versions=3, lr=1e-5, delta="on", in_place=True, touch=2)
    for r in results[1:]:
        assert len(r["errors"]) == 1 and "v2:" in r["errors"][0] and "'wide' changed since the last sync" in r["errors"][0]
