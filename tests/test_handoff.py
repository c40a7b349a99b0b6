"""nccl_handoff: several senders into one receiver, where a sender on the receiver's own device
hands its buckets over in shared memory and the others broadcast over their process groups.

CPU tests run the gloo variant in real processes (every sender shares the host, so the tests pick
the local senders with the `local_senders` override where they emulate a GPU placement); the GPU
test places sender 0 on cuda:0 and sender 1 with the receiver on cuda:1, found by device UUID.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import time
from collections.abc import Callable, Iterator
from itertools import chain
from typing import Any

import pytest
import torch

from ckpt_engine.delta.request import DeltaRequest
from ckpt_engine.engine import Rendezvous, TransferError
from ckpt_engine.manifest import BucketManifest
from ckpt_engine.planning.ownership import row_shards
from ckpt_engine.registry import CheckpointEngineRegistry
from ckpt_engine.sources.base import spec_of
from ckpt_engine.transports import handoff
from multisender import even_rows, model_state, wire
from ranks import run_ranks
from roundtrip import same_bits


def _pieces(manifest: BucketManifest, rank: int, full: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """This sender's local piece of every tensor it owns (its dim-0 row block, or the whole tensor), in bucket order."""
    start: dict[str, int] = {}
    size: dict[str, int] = {}
    for b in manifest.sender_buckets(rank):
        for e in b.entries:
            start.setdefault(e.name, e.chunk_offset)
            size[e.name] = size.get(e.name, 0) + e.chunk_size
    for name in start:
        t = full[name]
        whole = size[name] == t.numel() * t.element_size()
        yield name, t if whole else t.reshape(-1).view(torch.uint8)[start[name] : start[name] + size[name]].view(t.dtype)


def _handoff_rank(
    rank: int, rdzv: Rendezvous, *, devices: list[str], versions: int = 2, verify: bool = False,
    local_senders: list[int] | None = None, try_delta: bool = False, die_after: int | None = None,
    how: str = "exit", loader_fails_after: int | None = None, engine_timeout_s: float | None = None, late: tuple[int, float] | None = None,
    refused_join: bool = False, map_after_sender_closed: bool = False, num_buffers: dict[int, int] | None = None,
) -> dict[str, Any]:
    """Senders send their row blocks of a mixed-dtype model for `versions` versions; the receiver
    checks every tensor bit for bit against the unsharded model. `try_delta`: with a local sender,
    every rank first asks for a delta sync at version 1 (refused) and then syncs dense.
    `die_after`: sender 1's source fails when the engine asks for its next piece after that many:
    the process reports, then exits hard (`how="exit"`), or the source raises (`how="raise"`).
    `loader_fails_after`: the receiver's loader raises after taking that many tensors.
    `engine_timeout_s`: the engines' timeout (default: the harness's). `late`: (rank, seconds) that
    rank waits before it joins. `refused_join`: the test expects the join to be refused, and a
    join's ValueError is this rank's answer; otherwise it fails the rank, so the harness names it.
    `map_after_sender_closed`: the receiver maps sender 1's buffers only once sender 1 has finalized
    its engine, or after 3 s if sender 1 cannot finalize before the receiver maps (as it must not).
    `num_buffers`: per rank, its engine's rotating buffers (default: the engine's)."""
    dev = torch.device(devices[rank])
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    kwargs: dict[str, Any] = {"verify": verify} if local_senders is None else {"verify": verify, "local_senders": local_senders}
    if num_buffers is not None and rank in num_buffers:
        kwargs["num_buffers"] = num_buffers[rank]
    engine = CheckpointEngineRegistry.new(rdzv.backend, bucket_size_bytes=16 * 1024, device=dev,
        timeout_s=engine_timeout_s if engine_timeout_s is not None else rdzv.timeout_s, **kwargs)
    if map_after_sender_closed and rank == rdzv.num_senders:
        handoff.map_buffers = _after_sender_closed(handoff.map_buffers, rdzv)
    if late is not None and rank == late[0]:
        time.sleep(late[1])
    try:
        engine.init_process_group(rdzv, rank)
    except (ValueError, TransferError) as exc:
        if not refused_join:
            raise
        return {"join_error": f"{type(exc).__name__}: {exc}"}
    senders = rdzv.num_senders
    out: dict[str, Any] = {"local": engine.transport.local_senders, "gids": sorted(engine.transport.groups), "bad": [], "errors": [], "delta_refused": [], "how": how}
    for version in range(versions):
        full = {k: v.to(dev) for k, v in wire(model_state(version, lr=1e-3)).items()}
        specs = [spec_of(n, t) for n, t in full.items()]
        owners = {s.name: row_shards(s, even_rows(s.shape[0], senders)) for s in specs if len(s.shape) >= 2}
        manifest = engine.plan(specs, num_senders=senders, owners=owners)
        if try_delta and version == 1 and engine.transport.local_senders:
            try:
                if rank < senders:
                    engine.send_weights(manifest, _pieces(manifest, rank, full), delta=DeltaRequest(False, None, 7))
                else:
                    next(iter(engine.receive_buckets(manifest, delta=DeltaRequest(False, None, 7))))
            except ValueError as exc:
                out["delta_refused"].append(str(exc))
        t0 = time.monotonic()
        try:
            if rank < senders:
                pieces = _pieces(manifest, rank, full)
                if die_after is not None and rank == 1:
                    pieces = _die_after(pieces, die_after, rdzv, rank, out)
                engine.send_weights(manifest, pieces)
            else:
                got = {}
                buckets = engine.receive_buckets(manifest)
                try:
                    for n, t in chain.from_iterable(buckets):
                        if len(got) == loader_fails_after:
                            raise RuntimeError("the loader failed")
                        got[n] = t.clone()
                finally:
                    buckets.close()
                out["bad"] += [f"v{version} {n}" for n in full if n not in got or not same_bits(got[n], full[n])]
        except Exception as exc:
            out["errors"].append(f"v{version} after {time.monotonic() - t0:.1f}s: {type(exc).__name__}: {exc}")
            break
    engine.finalize()
    rdzv.connect_store().set(f"test/finalized/{rank}", b"1")
    return out


def _after_sender_closed(map_buffers: Callable[..., list[torch.Tensor]], rdzv: Rendezvous) -> Callable[..., list[torch.Tensor]]:
    """`map_buffers` that first waits (at most 3 s) for sender 1 to finalize its engine: the slowest
    a loaded box may make the receiver between reading sender 1's descriptors and mapping them."""

    def late_map(*args: Any, **kwargs: Any) -> list[torch.Tensor]:
        try:
            rdzv.connect_store().wait(["test/finalized/1"], datetime.timedelta(seconds=3))
        except torch.distributed.DistStoreError:
            pass  # sender 1 waits for this mapping before its join returns: it cannot have finalized
        return map_buffers(*args, **kwargs)

    return late_map


def _die_after(pieces: Iterator[tuple[str, torch.Tensor]], n: int, rdzv: Rendezvous, rank: int, out: dict[str, Any]) -> Iterator[Any]:
    for i, piece in enumerate(pieces):
        if i == n:
            if out.get("how") == "raise":
                raise RuntimeError("the weight source failed")
            # Report through the harness's result slot first (a dead rank reports nothing), then die.
            rdzv.connect_store().set(f"result/{rank}", json.dumps({"ok": True, "value": dict(out, died=True)}))
            os._exit(3)
        yield piece


@pytest.mark.parametrize(
    ("local_senders", "verify", "expected_local"),
    [([1], True, [1]), (None, False, [0, 1]), ([], False, [])],
    ids=["sender1-local-verify", "detected-all-local", "none-local"],
)
def test_local_and_remote_senders_are_bit_exact(local_senders: list[int] | None, verify: bool, expected_local: list[int]) -> None:
    """Sender 1 hands over in shared memory while sender 0 broadcasts over gloo (the shrunk
    topology), every tensor bit-exact over three versions with checksums on; without an override
    both CPU senders share the receiver's host and both hand over; with none local the receiver
    builds a group per sender, as the pipelined core does. Delta is refused (while any sender is
    local) before any byte moves, and the same group then syncs dense."""
    results = run_ranks(
        _handoff_rank, 3, backend="nccl_handoff", num_senders=2, devices=["cpu"] * 3, versions=3, verify=verify,
        local_senders=local_senders, try_delta=True, timeout_s=30,
    )
    for r in results:
        assert r["local"] == expected_local and r["errors"] == []
    receiver = results[2]
    assert receiver["bad"] == []
    assert receiver["gids"] == [s for s in (0, 1) if s not in expected_local]  # no group for a local sender
    for r in results:
        if expected_local:
            assert len(r["delta_refused"]) == 1 and "nccl_handoff backend does not do delta syncs" in r["delta_refused"][0]
        else:
            assert r["delta_refused"] == []


def test_bad_options_are_refused_by_name() -> None:
    from ckpt_engine.transports.gloo import GlooTransport

    engine = CheckpointEngineRegistry.new("nccl_handoff", bucket_size_bytes=4096, device="cpu")
    assert isinstance(engine.transport.remote, GlooTransport) and engine.transport.local_senders == []  # CPU: gloo for remote senders
    for bad in ([-1], [1, 1], "1", [True]):
        with pytest.raises(ValueError, match="local_senders must be a list of distinct sender ranks"):
            CheckpointEngineRegistry.new("nccl_handoff", bucket_size_bytes=4096, device="cpu", local_senders=bad)
    with pytest.raises(ValueError, match="runs on cuda or cpu devices"):
        CheckpointEngineRegistry.new("nccl_handoff", bucket_size_bytes=4096, device="meta")


@pytest.mark.parametrize(
    ("senders", "local_senders", "match"),
    [(1, [0], "needs exactly one receiver rank; this group has 2"), (2, [2], r"local_senders=\[2\] names senders outside \[0, 2\)")],
    ids=["two-receivers", "no-such-sender"],
)
def test_a_group_that_cannot_hand_over_is_refused_on_every_rank(senders: int, local_senders: list[int], match: str) -> None:
    """The first receiver rank's verdict reaches every rank as one ValueError at join."""
    results = run_ranks(
        _handoff_rank, 3, backend="nccl_handoff", num_senders=senders, devices=["cpu"] * 3, local_senders=local_senders, refused_join=True, timeout_s=30
    )
    for r in results:
        assert re.search(match, r["join_error"]), r


def test_a_receiver_that_cannot_map_a_local_sender_tells_it_at_join() -> None:
    """The receiver refuses sender 0's shared buffers (3 against its 2): its join fails by name,
    and so does the sender's, with the receiver's reason, at once: it waits at join for the
    receiver's answer (before, its join returned and its first sync waited out the timeout)."""
    results = run_ranks(
        _handoff_rank, 2, backend="nccl_handoff", num_senders=1, devices=["cpu"] * 2, local_senders=[0], num_buffers={0: 3, 1: 2},
        refused_join=True, engine_timeout_s=60, timeout_s=90,
    )
    sender, receiver = (r["join_error"] for r in results)
    assert receiver.startswith("ValueError") and "sender 0 publishes 3 shared buffers; this rank expects 2" in receiver, receiver
    assert sender.startswith("TransferError") and "could not map them" in sender and "expects 2" in sender, sender


def test_a_rank_that_starts_after_the_sync_timeout_still_joins() -> None:
    """Joining waits for the other ranks within the rendezvous's timeout, as the process-group joins
    do: the receiver starts 5 s after the senders, whose engines bound each wait of a sync by 3 s, and
    the group forms and syncs (ranks started seconds apart on a loaded box had failed the join)."""
    results = run_ranks(
        _handoff_rank, 3, backend="nccl_handoff", num_senders=2, devices=["cpu"] * 3, versions=1, local_senders=[1],
        engine_timeout_s=3, late=(2, 5.0), timeout_s=60,
    )
    assert [r["errors"] for r in results] == [[], [], []] and results[2]["bad"] == []
    assert all(r["local"] == [1] for r in results)


def test_a_local_sender_that_fails_at_once_leaves_its_buffers_to_the_receiver() -> None:
    """Sender 1's source raises at its first sync while the receiver has not mapped its buffers yet
    (the receiver maps them only once sender 1 has finalized, or 3 s later): sender 1's join returns
    only after the receiver mapped them, so its close cannot unlink them first. Before, the receiver's
    join failed ("shared buffer ... is not on this host") and sender 0 waited out its group's timeout."""
    results = run_ranks(
        _handoff_rank, 3, backend="nccl_handoff", num_senders=2, devices=["cpu"] * 3, versions=1, local_senders=[1],
        die_after=0, how="raise", map_after_sender_closed=True, engine_timeout_s=60, timeout_s=90,
    )
    assert "the weight source failed" in results[1]["errors"][0], results
    (error,) = results[2]["errors"]
    assert "TransferError" in error and "from sender 1" in error and "aborted the sync" in error, error


@pytest.mark.parametrize("how", ["exit", "raise"])
def test_a_failed_local_sender_is_named(how: str) -> None:
    """Sender 1 exits hard mid-sync: the receiver fails with a TransferError naming a bucket from
    sender 1 within `timeout_s` (3 s) plus a little (bounds are loose: CI cores are shared).
    Sender 1's source raises instead: its engine answers the flag the receiver waits on with
    "abort", and the receiver fails at once, long before the engines' 60 s timeout."""
    timeout = 3 if how == "exit" else 60
    results = run_ranks(
        _handoff_rank, 3, backend="nccl_handoff", num_senders=2, devices=["cpu"] * 3, versions=1, local_senders=[1],
        die_after=3, how=how, engine_timeout_s=timeout, timeout_s=90,
    )
    if how == "exit":
        assert results[1].get("died"), results
    else:
        assert "the weight source failed" in results[1]["errors"][0], results
    assert len(results[2]["errors"]) == 1, results
    error = results[2]["errors"][0]
    assert "TransferError" in error and "from sender 1" in error, error
    assert ("aborted the sync" in error) == (how == "raise"), error
    assert float(error.split(" after ")[1].split("s:")[0]) < (timeout + 7 if how == "exit" else 20), error


def test_a_failed_receiver_frees_the_local_sender() -> None:
    """The receiver's loader raises mid-sync: its engine answers the "free" flags the local sender
    may wait on with "abort", so sender 1 fails at once naming the receiver, long before the 60 s
    timeout."""
    results = run_ranks(
        _handoff_rank, 3, backend="nccl_handoff", num_senders=2, devices=["cpu"] * 3, versions=1, local_senders=[1],
        loader_fails_after=5, engine_timeout_s=60, timeout_s=90,
    )
    assert "RuntimeError: the loader failed" in results[2]["errors"][0], results
    (error,) = results[1]["errors"]
    assert "TransferError" in error and "the receiver aborted the sync" in error, error
    assert float(error.split(" after ")[1].split("s:")[0]) < 20, error


@pytest.mark.gpu
@pytest.mark.parametrize("verify", [False, True])
def test_gpu_shrunk_topology_bit_exact(verify: bool) -> None:
    """2 GPUs: sender 0 on cuda:0 over NCCL, sender 1 beside the receiver on cuda:1 through CUDA
    IPC (found by device UUID, no override)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    results = run_ranks(
        _handoff_rank, 3, backend="nccl_handoff", num_senders=2, devices=["cuda:0", "cuda:1", "cuda:1"], versions=3,
        verify=verify, timeout_s=120,
    )
    assert all(r["local"] == [1] and r["errors"] == [] for r in results)
    assert results[2]["gids"] == [0] and results[2]["bad"] == []
