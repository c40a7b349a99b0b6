"""The vLLM worker's staging (`rollout_adapters/vllm/staging.py`) without an engine: a staged receive
on its thread, what it keeps (views or copies; region items by their slice bytes), what a swap may
take, and the room for a copy."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from ckpt_engine.manifest import TensorSpec
from ckpt_engine.planning.regions import ReceivePlan, Region
from ckpt_engine.rollout_adapters.vllm.region_landing import RegionItem, RegionLanding
from ckpt_engine.rollout_adapters.vllm.staging import StagedReceive, Staging


def _stream(buckets: list[list[tuple[str, torch.Tensor]]], gate: threading.Event | None = None, fail: str | None = None) -> Any:
    """A receive that hands `buckets` to the sink, reusing one buffer as a rotating receive does."""

    def run(staged: StagedReceive) -> dict[str, Any]:
        if gate is not None:
            assert gate.wait(10)
        for bucket in buckets:
            staged.sink(bucket)
        if fail is not None:
            raise RuntimeError(fail)
        return {"tensors": sum(len(b) for b in buckets)}

    return run


def test_copies_survive_a_reused_buffer_and_a_tied_head_shares_its_copy() -> None:
    staging = Staging()
    buf = torch.arange(8, dtype=torch.float32)
    emb = buf[:4]
    staging.start("d" * 16, _stream([[("embed", emb), ("lm_head", emb)], [("norm", buf[4:])]]), keep_views=False)
    assert staging.version is not None and staging.version.join(10)
    buf.zero_()  # the receive buffer is refilled by the next bucket: the staged copies must not change
    pairs = dict(staging.take().pairs)
    assert torch.equal(pairs["embed"], torch.arange(4.0)) and pairs["lm_head"] is pairs["embed"]
    assert torch.equal(pairs["norm"], torch.arange(4.0, 8.0))
    assert staging.copy.nbytes == 32  # the tied head took no copy of its own
    with pytest.raises(RuntimeError, match="none was staged"):
        staging.take()  # a version is handed over once


def test_views_are_kept_as_they_are() -> None:
    staging = Staging()
    base = torch.ones(4)
    staging.start("e" * 16, _stream([[("w", base)]]), keep_views=True)
    assert staging.version is not None and staging.version.join(10)
    assert staging.take().pairs[0][1] is base and staging.copy.nbytes == 0


def test_a_running_or_failed_receive_cannot_be_swapped_and_discard_drops_it() -> None:
    staging = Staging()
    gate = threading.Event()
    staging.start("f" * 16, _stream([[("w", torch.ones(2))]], gate), keep_views=False)
    assert staging.running and staging.status()["done"] is False
    with pytest.raises(RuntimeError, match="still streaming"):
        staging.take()
    with pytest.raises(RuntimeError, match="still streaming"):
        staging.start("g" * 16, _stream([]), keep_views=False)
    gate.set()
    assert staging.version is not None and staging.version.join(10)
    assert staging.status()["done"] and staging.status()["report"] == {"tensors": 1, "stage_s": staging.status()["report"]["stage_s"]}
    assert staging.discard() and staging.describe() is None

    staging.start("h" * 16, _stream([[("w", torch.ones(2))]], fail="checksum mismatch in bucket 1"), keep_views=False)
    assert staging.version is not None and staging.version.join(10)
    status = staging.status()
    assert status["done"] and "checksum mismatch" in status["error"] and status["report"] is None
    with pytest.raises(RuntimeError, match=r"its receive failed \(RuntimeError: checksum mismatch"):
        staging.take()
    assert staging.version is None  # the refused swap dropped the failed version (and what it held)
    with pytest.raises(RuntimeError, match="none was staged"):
        staging.take()


def test_room_for_a_staging_copy() -> None:
    staging = Staging()
    cpu = torch.device("cpu")
    assert staging.room(1024, cpu, None)[0]
    fits, why = staging.room(1024, cpu, 512)
    assert not fits and "staging limit of 512 bytes" in why
    fits, why = staging.room(1 << 60, cpu, None)
    assert not fits and "more bytes on cpu" in why


_SPECS = {"w": TensorSpec("w", "float32", (4, 3)), "b": TensorSpec("b", "float32", (3,))}
_PLAN = ReceivePlan({"w": (Region(0, 2, 2),), "b": None})  # this rank: rows 2..3 of w, b whole


def _regions(items: list[list[RegionItem]]) -> Any:
    """A region receive: every bucket's items to the loader `keep_regions` gives, as the worker's
    `_stream` does; fails as it does when the plan's regions did not all arrive."""

    def make(device: torch.device, sink: Any) -> RegionLanding:
        return RegionLanding(_PLAN, _PLAN, _SPECS, device, lambda pairs, held: pairs, {}, sink)

    def run(staged: StagedReceive) -> dict[str, Any]:
        check, keep = staged.keep_regions(make)
        for batch in items:
            keep(batch)
        if check.incomplete():
            raise RuntimeError(f"region delivery ended with regions missing for {check.incomplete()}")
        return {"tensors": sum(len(b) for b in items)}

    return run


def test_region_items_are_kept_by_their_slice_bytes_and_land_at_the_swap() -> None:
    staging = Staging()
    buf = torch.arange(9, dtype=torch.float32)  # a rotating receive buffer
    rows, bias = buf[:6].view(2, 3), buf[6:]
    staging.start("r" * 16, _regions([[("w", Region(0, 2, 2), rows)], [("b", None, bias)]]), keep_views=False)
    assert staging.version is not None and staging.version.join(10) and staging.status()["error"] is None
    buf.fill_(-1)  # refilled: the staged copies must not change
    assert staging.copy.nbytes == 9 * 4  # the rank's slice and the bias, not w's 12 elements
    loaded: dict[str, torch.Tensor] = {}
    staging.take().load(lambda pairs: loaded.update(pairs), torch.device("cpu"))
    assert set(loaded) == {"w", "b"} and list(loaded["w"].shape) == [4, 3]
    assert torch.equal(loaded["w"][2:], torch.arange(6.0).view(2, 3)) and torch.equal(loaded["b"], torch.arange(6.0, 9.0))

    # The next sync brings whole tensors: the region copies it no longer uses are freed.
    staging.start("s" * 16, _stream([[("b", torch.ones(3))]]), keep_views=False)
    assert staging.version is not None and staging.version.join(10)
    assert staging.copy.nbytes == 12


def test_a_region_outside_the_plan_or_a_missing_one_fails_the_staged_receive() -> None:
    staging = Staging()
    staging.start("t" * 16, _regions([[("w", Region(0, 0, 2), torch.zeros(2, 3))]]), keep_views=False)
    assert staging.version is not None and staging.version.join(10)
    assert "does not hold" in staging.status()["error"]
    with pytest.raises(RuntimeError, match="its receive failed"):
        staging.take()
    staging.start("u" * 16, _regions([[("b", None, torch.zeros(3))], [("w", Region(0, 2, 2), torch.zeros(3, 3))]]), keep_views=False)
    assert staging.version is not None and staging.version.join(10)
    assert "expected [2, 3]" in staging.status()["error"]
    staging.start("v" * 16, _regions([[("b", None, torch.zeros(3))]]), keep_views=True)
    assert staging.version is not None and staging.version.join(10)
    assert staging.status()["error"] is None  # w never started: nothing of it is half there

    staging.start("x" * 16, _regions([[("w", Region(0, 2, 2), torch.zeros(2, 3))]]), keep_views=True)
    assert staging.version is not None and staging.version.join(10)
    staged = staging.take()
    assert staged.items[0][2].shape == (2, 3)  # a view, kept as it landed


def test_on_end_is_told_once_the_version_can_be_taken_or_why_it_failed() -> None:
    """The native backend's workers report the end through `on_end` (then the controller swaps at
    once): by the time it runs, the version must already be takeable, never "still streaming"."""
    staging = Staging()
    told: list[tuple[str | None, bool]] = []
    done = threading.Event()

    def on_end(error: str | None) -> None:
        assert staging.version is not None
        told.append((error, staging.version.ready))
        done.set()

    staging.start("a" * 16, _stream([[("w", torch.ones(2))]]), keep_views=False, on_end=on_end)
    assert done.wait(10) and told == [(None, True)]
    assert torch.equal(dict(staging.take().pairs)["w"], torch.ones(2))

    done.clear()
    staging.start("b" * 16, _stream([[("w", torch.ones(2))]], fail="checksum mismatch in bucket 0"), keep_views=False, on_end=on_end)
    assert done.wait(10) and told[1] == ("RuntimeError: checksum mismatch in bucket 0", False)
    with pytest.raises(RuntimeError, match=r"its receive failed \(RuntimeError: checksum mismatch in bucket 0\)"):
        staging.take()
