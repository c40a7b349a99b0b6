"""The vLLM worker's staging (`rollout_adapters/vllm_staging.py`) without an engine: a staged receive
on its thread, what it keeps (views or copies), what a swap may take, and the room for a copy."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from ckpt_engine.rollout_adapters.vllm_staging import Sink, Staging


def _stream(buckets: list[list[tuple[str, torch.Tensor]]], gate: threading.Event | None = None, fail: str | None = None) -> Any:
    """A receive that hands `buckets` to the sink, reusing one buffer as a rotating receive does."""

    def run(sink: Sink) -> dict[str, Any]:
        if gate is not None:
            assert gate.wait(10)
        for bucket in buckets:
            sink(bucket)
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
    pairs = dict(staging.take())
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
    assert staging.take()[0][1] is base and staging.copy.nbytes == 0


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


def test_room_for_a_staging_copy() -> None:
    staging = Staging()
    cpu = torch.device("cpu")
    assert staging.room(1024, cpu, None)[0]
    fits, why = staging.room(1024, cpu, 512)
    assert not fits and "staging limit of 512 bytes" in why
    fits, why = staging.room(1 << 60, cpu, None)
    assert not fits and "more bytes on cpu" in why
