"""DeltaPolicy: the version chain, and `auto` deciding from what the last syncs cost per transport.

A simulated link gives each sync a cost (seconds) by its kind; the policy sees only those costs and
the bytes, as the session reports them. `auto` must never keep paying for patches that cost more
than dense, and must keep patching where they pay."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt_engine.sync.delta_policy import DENSE_SAMPLES, PATCH_SAMPLES, DeltaPolicy, patches_pay
from ckpt_engine.delta.request import DeltaRequest

BYTES = 1 << 20


def _kind(r: DeltaRequest | None) -> str:
    return "off" if r is None else "patch" if r.patches else "seed"


def _run(policy: DeltaPolicy, costs: list[dict[str, float]], *, wire: float = 0.1, transport: str = "gloo") -> list[str]:
    """Sync once per entry of `costs` (seconds per kind, this sync), returning the kinds sent;
    checks the chain on the way: a patch names the bases the last completed sync left."""
    kinds: list[str] = []
    last_new: int | None = None
    for c in costs:
        r = policy.request("plan", None, transport)
        if r is not None and r.patches:
            assert r.base_id == last_new, "a patch must name the bases of the last completed sync"
        k = _kind(r)
        kinds.append(k)
        policy.completed(
            "plan", r, transport=transport, seconds=c[k], plan_bytes=BYTES, wire_bytes=int((wire if k == "patch" else 1.0) * BYTES), dense_bytes=BYTES
        )
        last_new = r.new_id if r is not None else None
    return kinds


def _costs(n: int, ratio: float, first: float, seed: int) -> list[dict[str, float]]:
    """n syncs' costs: dense 1.0, a seed 1.05 (it also writes bases), a patch `ratio`, each with
    +-15 % noise; the first sync `first` x (one-time costs: allocations, a new group)."""
    rng = random.Random(seed)
    out = [{"off": rng.uniform(0.85, 1.15), "seed": 1.05 * rng.uniform(0.85, 1.15), "patch": ratio * rng.uniform(0.85, 1.15)} for _ in range(n)]
    out[0] = {k: v * first for k, v in out[0].items()}
    return out


@settings(max_examples=100, deadline=None)
@given(dense=st.lists(st.floats(1e-6, 1e3), max_size=DENSE_SAMPLES), patch=st.lists(st.floats(1e-6, 1e3), max_size=PATCH_SAMPLES))
def test_patches_pay_compares_the_cheapest_recent_cost_of_each(dense: list[float], patch: list[float]) -> None:
    got = patches_pay(dense, patch)
    if not dense or len(patch) < PATCH_SAMPLES:
        assert got is None
    else:
        assert got == (min(patch) <= min(dense))


@settings(max_examples=60, deadline=None)
@given(n=st.integers(8, 200), ratio=st.floats(0.05, 0.6), first=st.floats(0.1, 100), seed=st.integers(0, 2**32))
def test_auto_keeps_patching_where_patches_pay(n: int, ratio: float, first: float, seed: int) -> None:
    """Patches at most 0.6 x a dense sync (noise +-15 %), whatever the first sync cost (its
    one-time costs are not kept): a plain dense sync measured, a seed, then patches only."""
    kinds = _run(DeltaPolicy("auto"), _costs(n, ratio, first, seed))
    assert kinds[:3] == ["off", "off", "seed"] and set(kinds[3:]) == {"patch"}, kinds


@settings(max_examples=60, deadline=None)
@given(n=st.integers(8, 300), ratio=st.floats(1.6, 5.0), first=st.floats(0.1, 100), seed=st.integers(0, 2**32))
def test_auto_goes_dense_where_patches_cost_more(n: int, ratio: float, first: float, seed: int) -> None:
    """Patches at 1.6-5 x a dense sync: after the first three measured patch syncs, plain dense
    syncs with a doubling back-off; each probe is one seed and one patch sync, so `auto` costs at
    most a few patch syncs more than always-dense, and no bases are kept while it backs off."""
    policy = DeltaPolicy("auto")
    kinds = _run(policy, _costs(n, ratio, first, seed))
    assert kinds[:6] == ["off", "off", "seed", "patch", "patch", "patch"][:n]
    assert kinds[6:10] == ["off"] * min(4, n - 6)
    probes = [i for i in range(6, len(kinds)) if kinds[i] == "patch"]
    for i in probes:  # after the first decision every patch is a probe: seed before, back-off after
        assert kinds[i - 1] == "seed" and (i + 1 == len(kinds) or kinds[i + 1] == "off"), kinds
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert all(g2 >= g1 for g1, g2 in zip(gaps, gaps[1:])), gaps  # the back-off never shrinks
    assert len(probes) <= 5 + n // policy.max_backoff_syncs


def test_the_back_off_doubles_up_to_its_cap_and_resets_once_patches_pay() -> None:
    policy = DeltaPolicy("auto", backoff_syncs=2, max_backoff_syncs=8)
    slow = {"off": 1.0, "seed": 1.0, "patch": 3.0}
    kinds = _run(policy, [slow] * 40)
    runs, count = [], 0
    for k in kinds[6:]:
        if k == "off":
            count += 1
        elif count:
            runs.append(count)
            count = 0
    assert runs[:4] == [2, 4, 8, 8], kinds
    fast = {"off": 1.0, "seed": 1.0, "patch": 0.2}
    kinds = _run(policy, [fast] * 30)
    first_patch = kinds.index("patch")
    assert set(kinds[first_patch:]) == {"patch"}, kinds  # the probe after the back-off pays: patches stay


def test_a_patch_sync_that_sent_every_byte_stops_patching_without_timing() -> None:
    """A patch sync whose wire reached the dense bytes did a dense sync's work plus the encode:
    dense next, whatever the clock said (a high learning rate changes nearly every word)."""
    kinds = _run(DeltaPolicy("auto"), [{"off": 1.0, "seed": 1.0, "patch": 0.5}] * 6, wire=1.01)
    assert kinds == ["off", "off", "seed", "patch", "off", "off"]


def test_costs_are_kept_per_transport() -> None:
    """What patches cost over one transport says nothing of another."""
    policy = DeltaPolicy("auto")
    _run(policy, [{"off": 1.0, "seed": 1.0, "patch": 3.0}] * 6, transport="nccl")
    assert set(policy.costs) == {"nccl"} and len(policy.costs["nccl"].patch) == 3
    policy.forget()  # a new group (over another transport): its first sync is not measured
    assert _kind(policy.request("plan", None, "gloo")) == "off"  # gloo measures its own dense cost first
    assert "gloo" not in policy.costs


def test_on_never_backs_off_and_off_never_patches() -> None:
    slow = {"off": 1.0, "seed": 1.0, "patch": 9.0}
    assert _run(DeltaPolicy("on"), [slow] * 6) == ["seed"] + ["patch"] * 5
    assert _run(DeltaPolicy("off"), [slow] * 3) == ["off"] * 3


def test_chain_breaks_seed_again() -> None:
    policy = DeltaPolicy("on", full_sync_every=3)
    assert _run(policy, [{"off": 1.0, "seed": 1.0, "patch": 0.1}] * 7) == ["seed", "patch", "patch", "seed", "patch", "patch", "seed"]
    r = policy.request("plan", None)
    policy.failed()
    assert r is not None and _kind(policy.request("plan", None)) == "seed"
    assert _kind(policy.request("other-plan", None)) == "seed"
    with pytest.raises(ValueError, match="delta=on, but the gloo backend does not send patches; use delta=auto or off"):
        policy.request("plan", "the gloo backend does not send patches")
    assert DeltaPolicy("auto").request("plan", "engine(s) x do not take patches") is None
