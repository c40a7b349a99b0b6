"""colocated: one end closed (`finalize()`, not an abort) while a sync is in flight tells the other
end, which fails at once naming the close, instead of waiting out its bound (`timeout_s`) for a
flag that will never come. Issue 42.

A real path: `WeightSyncSession.close()` goes on after `timeout_s` with a sync still in flight (its
lock wait is bounded, a sync is not), and a `leave` reaches an engine's receiver while it receives.
Each case puts one end mid-sync with events (a walk or a loader that blocks until the close is
done), closes it from another thread, then lets it go on. The transport's bound is 600 s; each rank
is bounded far below it, so a peer left waiting fails the test (a hung rank) rather than a timing
assertion."""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from ranks import run_ranks
from roundtrip import mixed_state

from ckpt_engine.engine import Rendezvous
from ckpt_engine.registry import CheckpointEngineRegistry
from ckpt_engine.sources.base import StateDictSource
from ckpt_engine.store import serve_store
from ckpt_engine.transports import in_process

BOUND_S = 600.0
"""The transport's bound: a peer that is not told waits this long."""
WAIT_S = 45.0
"""How long each rank (and each wait inside one) may take here: far below `BOUND_S`."""

# (the end closed, the path): sender: "first-offer" (the first one-copy sync: it walks before its
# offer), "provisional" (the second: the receiver waits for the verdict on its provisional offer),
# "slots" (a source that is not stable, between buckets); receiver: its loader stops after the first
# bucket, out of the sender's tensors ("one-copy", the sender waits for its answer) or the slots.
CASES = [("sender", "first-offer"), ("sender", "provisional"), ("sender", "slots"), ("receiver", "one-copy"), ("receiver", "slots")]

PEER_ERRORS = {
    ("sender", "first-offer"): r"rank 1: the sender closed its end of the group mid-sync before its offer",
    ("sender", "provisional"): r"rank 1: the sender closed its end of the group mid-sync before its verdict on its provisional offer",
    ("sender", "slots"): r"rank 1: the peer closed its end of the group mid-sync before bucket \d+",
    ("receiver", "one-copy"): r"rank 0: the receiver closed its end of the group mid-sync before its answer on its copies",
    ("receiver", "slots"): r"rank 0: the peer closed its end of the group mid-sync before release of bucket \d+",
}

MINE_ERRORS = r"(this end of the colocated group was closed mid-sync|this end's slots were dropped mid-sync \(its group was closed\))"
"""The closed end's own sync: at its next flag, or at its next slot (before: `IndexError`)."""


def _state() -> dict[str, torch.Tensor]:
    sd = mixed_state(0, num_small=20)
    sd["noncontig"] = sd["noncontig"].contiguous()
    return {k: t.share_memory_() for k, t in sd.items()}


def _error(fn: Callable[[], None]) -> str:
    try:
        fn()
    except Exception as exc:  # the closed end's own sync may fail anywhere after its close
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def closing_rank(rank: int, rdzv: Rendezvous, *, closed: str, path: str) -> dict[str, Any]:
    """One rank of a case: the closed end syncs on a thread of its own and is closed from this one
    once that thread reached its blocking point; the other end syncs here. Its error and seconds."""
    engine = CheckpointEngineRegistry.new("colocated", bucket_size_bytes=64 * 1024, timeout_s=BOUND_S, device=torch.device("cpu"))
    engine.init_process_group(rdzv, rank)
    own = _state()
    manifest = engine.plan(StateDictSource(own).metadata())
    reached, go = threading.Event(), threading.Event()

    def pause() -> None:
        reached.set()
        assert go.wait(WAIT_S), "not let go"

    def walk() -> Iterator[tuple[str, torch.Tensor]]:
        items = list(own.items())
        yield from items[:3]
        pause()  # mid-walk: before the offer, before its verdict, or between the slots' buckets
        yield from items[3:]

    def sync(pausing: bool) -> None:
        if rank == 0:
            engine.send_weights(manifest, walk() if pausing else own.items(), stable=path != "slots")
        else:
            for i, _ in enumerate(engine.receive_buckets(manifest, None)):
                if pausing and i == 0:
                    pause()  # the loader holds the first bucket

    mine = (rank == 0) == (closed == "sender")
    syncs = 2 if path == "provisional" else 1
    try:
        for _ in range(syncs - 1):
            sync(False)
        if not mine:
            t0 = time.monotonic()
            return {"error": _error(lambda: sync(False)), "seconds": time.monotonic() - t0}
        out: dict[str, Any] = {}
        worker = threading.Thread(target=lambda: out.update(error=_error(lambda: sync(True))), daemon=True)
        worker.start()
        assert reached.wait(WAIT_S), "the sync did not reach its blocking point"
        engine.finalize()  # from another thread, mid-sync
        go.set()
        worker.join(WAIT_S)
        assert not worker.is_alive(), "the closed end's own sync did not end"
        return out
    finally:
        go.set()
        engine.finalize()


def _in_one_process(closed: str, path: str) -> list[dict[str, Any]]:
    """Both ranks as threads of this process (their flags in the sender's memory, `in_process.py`),
    each joined within `WAIT_S`; a rank still waiting then fails the test."""
    master = serve_store("127.0.0.1", WAIT_S)
    rdzv = Rendezvous("127.0.0.1", master.port, uuid.uuid4().hex, 2, "colocated", WAIT_S)
    results: list[Any] = [None, None]

    def run(rank: int) -> None:
        try:
            results[rank] = closing_rank(rank, rdzv, closed=closed, path=path)
        except BaseException as exc:
            results[rank] = f"{type(exc).__name__}: {exc}"

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 2 * WAIT_S
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, t in enumerate(threads) if t.is_alive()]
    assert not hung, f"ranks {hung} still waiting after {2 * WAIT_S}s (bound {BOUND_S}s); the others: {json.dumps(results)}"
    assert all(isinstance(r, dict) for r in results), results
    assert in_process._HERE == {}, "the sender's store was not let go at its close"
    return results


@pytest.mark.timeout(300)
@pytest.mark.parametrize("where", ["processes", "one-process"])
@pytest.mark.parametrize(("closed", "path"), CASES, ids=[f"{c}-{p}" for c, p in CASES])
def test_an_end_closed_mid_sync_fails_its_peer_at_once(closed: str, path: str, where: str) -> None:
    """The peer fails at once naming the close (before: it waited out its 600 s bound, here past
    the ranks' bound of `WAIT_S`); the closed end's own sync ends too, with a `TransferError` naming
    its close (in the slots path it was an `IndexError` on the dropped slots)."""
    if where == "processes":
        results = run_ranks(closing_rank, 2, backend="colocated", timeout_s=WAIT_S, closed=closed, path=path)
    else:
        results = _in_one_process(closed, path)
    mine, peer = (results[0], results[1]) if closed == "sender" else (results[1], results[0])
    assert re.fullmatch(f"TransferError: {PEER_ERRORS[closed, path]}", peer["error"]), peer
    assert re.fullmatch(f"TransferError: rank {0 if closed == 'sender' else 1}: {MINE_ERRORS}", mine["error"]), mine
