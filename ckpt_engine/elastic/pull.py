"""A joining engine's side of a peer join: read every held tensor from a serving peer with
one-sided NIXL reads, check each against the checksum the peer advertised, and only then hold
(and serve) the version.

Before anything is touched the offer is checked (`PeerOffer.check_for`): a wrong version, a wrong
memory descriptor, a tensor missing are refused by name and the engine stays as it was. From the
first read on, the engine is out of service (paused, no version, stale) until every tensor read
checks out; a read that fails (the peer died) or bytes that do not match (a sync landed in the
peer mid-read, a wrong address) leave it so, never serving a half-new state, until another pull or
the trainer's next sync installs a complete version.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from ckpt_engine.elastic.host import PeerHost
from ckpt_engine.elastic.offer import PeerOffer, TensorOffer, tensor_checksums
from ckpt_engine.elastic.prepared import JoinPrep, register_uncovered
from ckpt_engine.transports.nixl_agent import NixlAgent, load_nixl

__all__ = ["WINDOW", "GcClock", "pull_version", "read_checked"]

logger = logging.getLogger(__name__)

WINDOW = 8
"""Reads in flight in a pull's first window; a test's hold (`hold`) applies between two windows."""
MAX_WINDOW = 256
"""Reads in flight at most (each window doubles the last up to this)."""
WINDOW_BYTES = 4 << 30
"""Bytes in flight at most (a window holds one read at least)."""
RUN_BYTES = 256 << 20
"""The largest run of tensors read at once (a window keeps several in flight)."""
MAX_GAP = 4096
"""The most padding between two tensors of one run (equal on both sides; the CUDA caching
allocator and `LoaderCopy.slab` both pad to 512 bytes)."""
_MAX_NAP_S = 1e-3


class GcClock:
    """The seconds the interpreter spent in its cyclic collector (and the full collections among
    them) while it is open: a gen-2 collection of a vLLM worker's heap took 0.1 s of a 30B-A3B
    join on 2xH200, unaccounted by any phase. `hold` also keeps automatic collections off while it
    is open (what a pull allocates is freed by reference counts; a collection runs after)."""

    _lock = threading.Lock()
    _open = 0
    """How many holds are open (the collector is one per process)."""
    _was = True
    """Whether automatic collection was on when the first open hold began."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.full = 0
        self._t0 = 0.0

    def _tick(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t0
            self.full += info.get("generation") == 2

    @contextlib.contextmanager
    def timing(self) -> Iterator[GcClock]:
        gc.callbacks.append(self._tick)
        try:
            yield self
        finally:
            gc.callbacks.remove(self._tick)

    @classmethod
    @contextlib.contextmanager
    def hold(cls) -> Iterator[None]:
        """No automatic collection while open (open clocks counted, on any thread); the collector as it was after."""
        with cls._lock:
            if cls._open == 0:
                cls._was = gc.isenabled()
                gc.disable()
            cls._open += 1
        try:
            yield
        finally:
            with cls._lock:
                cls._open -= 1
                if cls._open == 0 and cls._was:
                    gc.enable()

    def info(self) -> dict[str, float]:
        return {"gc": self.seconds, "gc_full": float(self.full)}


def pull_version(
    host: PeerHost, offer: PeerOffer, peer: str, timeout_s: float,
    exclusive: Callable[[str], AbstractContextManager[None]], hold: Callable[[], None], prep: JoinPrep | None = None,
) -> dict[str, Any]:
    """Make `host` hold `offer.version`, read from `peer` (with the agent `prep` holds, if any);
    returns {version, peer, bytes, tensors, seconds, phases, prepare}. Raises ValueError (bad input:
    nothing touched) or RuntimeError (the engine is left paused and stale)."""
    version = offer.version
    if host.last_version is not None and version < host.last_version:
        raise ValueError(f"this engine held version {host.last_version} already; versions only grow, so it cannot pull version {version}")
    offer.check_for(version, host.tensors)
    with exclusive(f"a pull of version {version} from peer {peer}"):
        host.pause("keep")
        host.stale, host.version, host.receiving, host.received = True, None, True, None
        t0 = time.perf_counter()
        try:
            nbytes, phases, prepared = read_checked(host.tensors, offer, peer, timeout_s, hold, prep)  # a failure leaves it out of service
            host.version, host.last_version, host.stale = version, version, False
        finally:
            host.receiving = False
        seconds = time.perf_counter() - t0
        host.resume()
    logger.info("pulled version %d from peer %s: %d bytes in %.3f s (%s)", version, peer, nbytes, seconds, phases)
    return {"version": version, "peer": peer, "bytes": nbytes, "tensors": len(offer.tensors), "seconds": seconds, "phases": phases, "prepare": prepared}


def read_checked(
    into: Mapping[str, torch.Tensor], offer: PeerOffer, peer: str, timeout_s: float, hold: Callable[[], None], prep: JoinPrep | None = None,
) -> tuple[int, dict[str, float], dict[str, Any]]:
    """Read every offered tensor into `into` (by name: the live tensors of a reference receiver, a
    vLLM worker's staging copy) and check each against the checksum the peer advertised. With the
    agent `prep` holds when there is one (made, its registrations done, before the offer came;
    what it lacks is registered here). Returns the bytes read, the seconds by phase (connect: what
    was left of making the agent and connecting to the peer's; read; check) and what the prepare
    gave ({used, early, late}: tensors registered before the offer and here); raises RuntimeError
    naming what failed (a read, a checksum)."""
    t0 = time.perf_counter()
    nbytes, connect_s, prepared = _read_all(into, offer, peer, timeout_s, hold, prep)
    t_check = time.perf_counter()
    names = offer.tensors.names  # columns, not rows: a row per tensor is a tuple made (9,435 of them)
    sums = tensor_checksums([into[n] for n in names])
    bad = [n for n, want, got in zip(names, offer.tensors.checksum, sums) if got != want]
    if bad:
        raise RuntimeError(
            f"{len(bad)} tensor(s) read from peer {peer} do not match the checksums it advertised for version {offer.version} "
            f"({', '.join(bad[:5])}): a sync landed in the peer mid-read, or a memory descriptor was wrong"
        )
    return nbytes, {"connect": connect_s, "read": t_check - t0 - connect_s, "check": time.perf_counter() - t_check}, prepared


def _read_all(
    into: Mapping[str, torch.Tensor], offer: PeerOffer, peer: str, timeout_s: float, hold: Callable[[], None], prep: JoinPrep | None,
) -> tuple[int, float, dict[str, Any]]:
    """Every offered tensor into the held one, in runs (`_runs`) and windows (`_windows`); the
    bytes read, the seconds it took to make the agent (or take the prepared one) and connect to
    the peer's, and what the prepare gave."""
    t0 = time.perf_counter()
    todo = [(t, into[t.name]) for t in offer.tensors if t.nbytes]  # sizes checked against the offer's before
    taken = prep.take({t.name: local for t, local in todo}) if prep is not None else None
    if taken is not None and taken.agent is not None:
        agent, prepared = taken.agent, taken.info()
    else:  # nothing prepared: made and registered now, as before the prepare existed
        agent, prepared = NixlAgent(load_nixl(), "join", []), {"used": False, "early": 0, "late": len(todo)}
    deadline = time.monotonic() + timeout_s
    try:
        if not prepared["used"]:
            register_uncovered(agent, [local for _, local in todo])  # a strided one is refused by name
        try:
            agent.add_peer(0, offer.slots())
        except Exception as exc:
            raise RuntimeError(f"could not connect to peer {peer}'s agent {offer.agent}: {exc}") from exc
        connect_s = time.perf_counter() - t0
        runs = _runs(todo, agent)
        logger.info("reading %d tensors from peer %s in %d reads (%d regions registered there, %d here)", len(todo), peer, len(runs), len(offer.regions), len(agent.slots))
        for window in _windows(runs):
            try:
                reqs = [(run, agent.read_span(0, run.region, run.offset, run.address, run.nbytes)) for run in window]
            except Exception as exc:
                raise RuntimeError(f"a read from peer {peer} could not start (a wrong memory descriptor, or the peer left?): {exc}") from exc
            for run, req in reqs:
                nap = 1e-5
                while (state := agent.state(req)) == "PROC":
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"the read of {run.what} from peer {peer} did not finish within {timeout_s}s")
                    time.sleep(nap)
                    nap = min(2 * nap, _MAX_NAP_S)
                if state != "DONE":
                    raise RuntimeError(f"the read of {run.what} from peer {peer} failed in NIXL ({state}): did the peer leave or die?")
            hold()
        return sum(local.nbytes for _, local in todo), connect_s, prepared
    finally:
        agent.close()


@dataclass
class _Run:
    """Tensors lying back to back both in one region of the peer and in one registered region
    here: one read of `nbytes` from (region, offset) into `address`."""

    region: int
    offset: int
    address: int
    nbytes: int
    first: str
    count: int = 1

    @property
    def what(self) -> str:
        return self.first if self.count == 1 else f"{self.first} and the {self.count - 1} tensor(s) after it"


def _runs(todo: list[tuple[TensorOffer, torch.Tensor]], agent: NixlAgent) -> list[_Run]:
    """The reads of `todo` (in offer order), each tensor joined to the run before it where it
    follows that run's last tensor at the peer (same region) and here by the same gap, the run
    still inside one registration here and at most `RUN_BYTES`. A gap (at most `MAX_GAP`: the
    allocator's or a slab's alignment padding) is read along, so it must be free here: inside the
    one allocation both tensors are views of, with no tensor of the pull starting in it."""
    starts: list[int] | None = None
    runs: list[_Run] = []
    before: torch.Tensor | None = None
    for t, local in todo:
        address = local.data_ptr()
        last = runs[-1] if runs else None
        if last is not None and before is not None and last.region == t.region and address - last.address == t.offset - last.offset:
            gap = t.offset - last.offset - last.nbytes
            free = gap == 0
            if 0 < gap <= MAX_GAP and local.untyped_storage().data_ptr() == before.untyped_storage().data_ptr():
                starts = starts if starts is not None else sorted(v.data_ptr() for _, v in todo)
                free = bisect.bisect_left(starts, address - gap) == bisect.bisect_left(starts, address)
            nbytes = t.offset + t.nbytes - last.offset
            if free and nbytes <= RUN_BYTES and agent.covers(last.address, nbytes):
                last.nbytes, last.count, before = nbytes, last.count + 1, local
                continue
        runs.append(_Run(t.region, t.offset, address, t.nbytes, t.name))
        before = local
    return runs


def _windows(runs: list[_Run]) -> Iterator[list[_Run]]:
    """The runs in windows read together: `WINDOW` reads first, each next window twice as many up
    to `MAX_WINDOW` reads or `WINDOW_BYTES` (9,435 reads 8 at a time moved 53 GB/s on 2xH200 where
    339 moved 218 GB/s). A test's hold applies between two windows, so a pull of more than `WINDOW`
    reads is held mid-pull at its first."""
    size, start = WINDOW, 0
    while start < len(runs):
        end, nbytes = start, 0
        while end < len(runs) and end - start < size and (end == start or nbytes + runs[end].nbytes <= WINDOW_BYTES):
            nbytes += runs[end].nbytes
            end += 1
        yield runs[start:end]
        start, size = end, min(2 * size, MAX_WINDOW)
