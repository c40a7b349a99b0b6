"""colocated: a stable sender's own tensors, mapped by the receiver, which copies straight out of
them (one copy per byte); other senders go through the shared slots. Real processes, bit for bit."""

from __future__ import annotations

import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from itertools import chain
from typing import Any

import pytest
import torch

from ranks import run_ranks
from roundtrip import mixed_state, same_bits

from ckpt_engine.sources.base import StateDictSource
from ckpt_engine.engine import Rendezvous, TransferError
from ckpt_engine.registry import CheckpointEngineRegistry
from ckpt_engine.store import serve_store
from ckpt_engine.transports import in_process

# Per sync: (what the sender offers, whether the receiver passes destinations).
# "shared": its own tensors, mapped; "moved": one tensor replaced (new handles); "rebound": one
# tensor object given other memory (`.data =`, as an optimizer or an offload may do): new handles;
# "unstable": the slots; "unshared": a stable source whose tensors cannot be mapped (host memory not
# shared, or a non-contiguous tensor on CUDA): the slots; "views": new tensor objects over the same
# memory (as `state_dict()` makes them): the same offer.
STEPS = [("shared", False), ("shared", True), ("moved", True), ("rebound", False), ("unstable", False), ("unshared", True),
         ("shared", False), ("shared", True), ("views", False)]


def _state(version: int, device: torch.device) -> dict[str, torch.Tensor]:
    sd = mixed_state(version, num_small=20)
    sd["noncontig"] = sd["noncontig"].contiguous()
    return {k: v.to(device) for k, v in sd.items()}


def one_copy_rank(rank: int, rdzv: Rendezvous, *, device: str = "cpu", joined: list[int] | None = None, repeatable: bool = False) -> dict[str, Any]:
    """`joined`: (ranks in one process) rank 0 notes the rendezvous store's keys once both joined.
    `repeatable`: the receiver takes a bucket again (the later bytes win), so a provisional offer is copied at once."""
    dev = torch.device(device)
    engine = CheckpointEngineRegistry.new(rdzv.backend, bucket_size_bytes=64 * 1024, timeout_s=rdzv.timeout_s, device=dev)
    engine.init_process_group(rdzv, rank)
    flags_here = any(isinstance(v, torch.distributed.HashStore) for v in in_process._HERE.values())
    bad: list[str] = []
    one_copy: list[bool] = []
    replayed: list[bool] = []
    generations: list[int] = []
    keys: list[int] = []
    passes: list[int] = []  # per sync, how often the receiver was handed each tensor (the most)
    own = _state(0, dev)
    if dev.type == "cpu":
        for t in own.values():
            t.share_memory_()
    manifest = engine.plan(StateDictSource(own).metadata())
    for version, (mode, with_dst) in enumerate(STEPS):
        new = _state(version, dev)
        if rank == 0:
            if mode == "moved":
                own["bf16"] = new["bf16"].clone()  # another tensor: its handle travels again
                if dev.type == "cpu":
                    own["bf16"].share_memory_()
            if mode == "rebound":
                own["fp32"].data = new["fp32"].clone()  # the same object elsewhere: a walk like the last one must not be replayed
                if dev.type == "cpu":
                    own["fp32"].share_memory_()
            for name, t in own.items():
                t.copy_(new[name])  # the trainer's step writes in place
            weights: Any = own.items()
            if mode == "views":
                weights = {n: t.detach() for n, t in own.items()}.items()
            if mode == "unshared":
                weights = {n: (t.clone() if dev.type == "cpu" else t.t().contiguous().t()) if n == "fp32" else t for n, t in own.items()}.items()
            if joined is not None and not joined:  # the receiver has joined: the sender's join read its answer
                joined.append(rdzv.connect_store().num_keys())
            stats = engine.send_weights(manifest, weights, stable=mode != "unstable")
            one_copy.append(bool(stats.extra.get("one_copy", False)))
            replayed.append(bool(stats.extra.get("walk_replayed", False)))
            generations.append(engine.transport.offer_generation)
            # the pair's flags; not tests/ranks.py's `result/` keys, which a rank done first may have set by now
            keys.append(sum(not k.startswith("result/") for k in engine.transport.group.list_keys()))
        else:
            dst = {n: torch.zeros_like(t) for n, t in new.items()} if with_dst else None
            got = {}
            handed: dict[str, int] = {}
            for name, t in chain.from_iterable(engine.receive_buckets(manifest, dst, repeatable=repeatable)):
                if dst is not None and mode in ("shared", "moved") and t is not dst[name]:
                    bad.append(f"v{version} {name}: copied out of the sender's tensor, but not into its destination")
                got[name] = t.clone()
                handed[name] = handed.get(name, 0) + 1
            passes.append(max(handed.values()))
            bad += [f"v{version} {n}" for n in new if n not in got or not same_bits(got[n], new[n])]
    mappings = engine.transport.mappings
    engine.finalize()
    return {"bad": bad, "one_copy": one_copy, "replayed": replayed, "generations": generations, "mappings": mappings, "keys": keys,
            "flags_here": flags_here, "passes": passes}


PASSES = [1, 1, 2, 2, 1, 2, 1, 1, 1]
"""A repeatable receiver's passes per sync: from the second sync on the sender offers its last walk's
tensors before it checks this walk (provisional); where the walk moved ("moved", "rebound", and
"unshared", which then goes through the slots) the receiver's copies out of the old tensors are made
again from the sender's own offer. "unstable" offers nothing; after "unshared" there is no last walk."""


@pytest.mark.parametrize("repeatable", [False, True], ids=["checked-first", "provisional"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu)])
def test_stable_sender_shares_its_tensors_once_and_the_receiver_copies_them(device: str, repeatable: bool) -> None:
    """Syncs of a stable sender go as one copy out of its own tensors, bit-exact with and without
    destinations; handles travel again only when a tensor moved; a source that is not stable, or
    whose tensors cannot be mapped, goes through the slots, and the one-copy path comes back. A walk
    whose tensors lie where and as the last one's did (the same objects or new views of them) is
    replayed without per-tensor checks; one whose tensor moved or was replaced is checked again. The
    store's flags do not pile up across syncs (the read ones are deleted while the device copies).
    A receiver whose loads may repeat copies the sender's last tensors before the sender checked its
    walk, and again where it moved: bit-exact either way; any other waits for the check."""
    results = run_ranks(one_copy_rank, 2, backend="colocated", timeout_s=60, device=device, repeatable=repeatable)
    assert results[1]["bad"] == []
    assert results[1]["passes"] == (PASSES if repeatable else [1] * len(STEPS))
    assert results[0]["one_copy"] == [True, True, True, True, False, False, True, True, True]
    assert results[0]["replayed"] == [False, True, False, False, False, False, False, True, True]
    assert results[0]["generations"] == [1, 1, 2, 3, 3, 3, 3, 3, 3]
    assert results[1]["mappings"] == 3  # the receiver maps once per generation, not once per sync
    assert len(set(results[0]["keys"])) == 1, results[0]["keys"]  # the sync's flags are deleted (off its path), none pile up


@pytest.mark.parametrize("repeatable", [False, True], ids=["checked-first", "provisional"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu)])
def test_a_pair_in_one_process_keeps_its_flags_in_memory(device: str, repeatable: bool) -> None:
    """Sender and receiver in one process (vLLM's engine core inside the trainer's process): the same
    syncs, bit for bit, with every flag kept in memory (`in_process.py`): none reaches the
    rendezvous store after the join, none piles up in memory, and the sender's store is let go at its close."""
    master = serve_store("127.0.0.1", 60.0)
    rdzv = Rendezvous("127.0.0.1", master.port, uuid.uuid4().hex, 2, "colocated", 60.0)
    joined_keys: list[int] = []
    with ThreadPoolExecutor(2) as pool:
        ranks = [pool.submit(one_copy_rank, rank, rdzv, device=device, joined=joined_keys, repeatable=repeatable) for rank in (0, 1)]
        results = [f.result(timeout=120) for f in ranks]
    assert results[1]["bad"] == []
    assert results[1]["passes"] == (PASSES if repeatable else [1] * len(STEPS))
    assert results[0]["one_copy"] == [True, True, True, True, False, False, True, True, True]
    assert results[0]["generations"] == [1, 1, 2, 3, 3, 3, 3, 3, 3]
    assert len(set(results[0]["keys"])) == 1, results[0]["keys"]  # the in-memory store's: constant
    assert master.num_keys() == joined_keys[0], "a flag went through the rendezvous store"
    assert results[0]["flags_here"] and in_process._HERE == {}  # published for the pair, let go at the close


def abandoning_rank(rank: int, rdzv: Rendezvous, stable: bool) -> dict[str, Any]:
    engine = CheckpointEngineRegistry.new(rdzv.backend, bucket_size_bytes=64 * 1024, timeout_s=rdzv.timeout_s)
    engine.init_process_group(rdzv, rank)
    own = _state(0, torch.device("cpu"))
    for t in own.values():
        t.share_memory_()
    manifest = engine.plan(StateDictSource(own).metadata())
    error, waited_s = "", 0.0
    if rank == 0:
        t0 = time.monotonic()
        try:
            engine.send_weights(manifest, own.items(), stable=stable)
        except TransferError as exc:
            error = str(exc)
        waited_s = time.monotonic() - t0
    else:
        buckets = engine.receive_buckets(manifest)
        next(buckets)
        buckets.close()  # the loader gives up after the first bucket
    engine.finalize()
    return {"error": error, "waited_s": waited_s}


@pytest.mark.parametrize("stable", [True, False], ids=["one-copy", "slots"])
def test_receiver_that_stops_fails_the_sender_at_once(stable: bool) -> None:
    """A receiver that stops mid-sync tells the sender, which fails with its reason well before the
    timeout instead of waiting for copies that will not come (through the slots: for the release of
    a bucket the receiver will never free; before, it waited out its bound)."""
    results = run_ranks(abandoning_rank, 2, backend="colocated", timeout_s=600, stable=stable)
    if stable:
        assert "the receiver failed while copying from this sender's tensors" in results[0]["error"]
        assert "GeneratorExit" in results[0]["error"]
    else:
        assert re.fullmatch(r"rank 0: the peer aborted this sync before release of bucket \d+", results[0]["error"]), results[0]["error"]
    assert results[0]["waited_s"] < 300  # the timeout is 600 s


def failing_sender_rank(rank: int, rdzv: Rendezvous, *, at: int | str, repeatable: bool = True) -> str:
    """The sync `at` fails on the sender: 0, the first sync's walk yields one tensor more than the
    metadata lists (found once walked whole); 1, the same after a provisional offer, the walk moved;
    "walk": the second sync's source raises while the sender checks it against its provisional
    offer; "slots": a source that is not stable raises after its third tensor. Each rank's error."""
    engine = CheckpointEngineRegistry.new(rdzv.backend, bucket_size_bytes=64 * 1024, timeout_s=rdzv.timeout_s, device=torch.device("cpu"))
    engine.init_process_group(rdzv, rank)
    own = {k: t.share_memory_() for k, t in _state(0, torch.device("cpu")).items()}
    manifest = engine.plan(StateDictSource(own).metadata())

    def broken() -> Any:
        yield from list(own.items())[:3]
        raise RuntimeError("the trainer's gather failed")

    try:
        for k in range(int(at in (1, "walk")) + 1):
            if rank == 0:
                weights: Any = own.items()
                if at == "slots" or at == "walk" and k == 1:
                    weights = broken()
                elif k == at:
                    own["bf16"] = own["bf16"].clone().share_memory_()  # moved: the provisional offer does not stand
                    weights = [*own.items(), ("stray", torch.ones(3).share_memory_())]
                engine.send_weights(manifest, weights, stable=at != "slots")
            else:
                for _ in engine.receive_buckets(manifest, None, repeatable=repeatable):
                    pass
    except (RuntimeError, ValueError, TransferError) as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        engine.finalize()
    return "no error"


@pytest.mark.parametrize("repeatable", [False, True], ids=["checked-first", "provisional"])
@pytest.mark.parametrize("at", [0, 1, "slots"], ids=["first-sync", "after-a-moved-offer", "slots"])
def test_a_sender_that_fails_before_its_offer_or_bucket_fails_the_receiver_at_once(at: int | str, repeatable: bool) -> None:
    """A walk that ends in a mismatch before the sender offered this sync's tensors (the first sync,
    or after its provisional offer was judged moved), or a source that raises between the slots'
    buckets: the receiver waiting for that offer or bucket is told at once by the sender's abort
    (before, it waited out its bound of 600 s: the colocated abort broke nothing the peer waits on)."""
    sender, receiver = run_ranks(failing_sender_rank, 2, backend="colocated", timeout_s=600, at=at, repeatable=repeatable)
    if at == "slots":
        assert sender == "RuntimeError: the trainer's gather failed", sender
        assert re.fullmatch(r"TransferError: rank 1: the peer aborted this sync before bucket \d+", receiver), receiver
        return
    assert sender == "SourceMismatch: the weight source yielded more tensors than its metadata lists", sender
    assert receiver == "TransferError: rank 1: the sender aborted this sync before its offer", receiver


def test_a_walk_that_fails_after_a_provisional_offer_fails_the_receiver_at_once() -> None:
    """The source raises while the sender checks its walk against the offer the receiver is already
    copying: the receiver is told at once, naming the source's error (not left waiting out its
    bound of 600 s for a verdict)."""
    sender, receiver = run_ranks(failing_sender_rank, 2, backend="colocated", timeout_s=600, at="walk")
    assert sender == "RuntimeError: the trainer's gather failed"
    assert receiver.startswith("TransferError:") and "the trainer's gather failed" in receiver, receiver
