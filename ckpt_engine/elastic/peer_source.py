"""A serving engine's side of a peer join: it offers the version it holds, and its NIXL agent
serves the joiner's one-sided reads of its live tensors while it keeps serving.

The memory regions holding the tensors are registered with the agent once (`regions.py`: a
caching-allocator segment per many tensors on CUDA, else each tensor's storage; syncs update the
tensors in place, so the registration outlives versions; new storage registers anew). A checksum of each is taken once per
held version. An offer stays open until the joiner is done or `timeout_s` passes; meanwhile a
thread lets the agent's worker serve the reads (UCX emulates a READ over TCP with messages the
target must answer; on RDMA or NVLink it does nothing). Nothing here pauses the engine: a sync
landing in it mid-pull changes bytes under the reads, and the joiner's checksums refuse them.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import secrets
import threading
import time
from collections.abc import Iterator

import torch

from ckpt_engine.elastic.host import Offered
from ckpt_engine.elastic.offer import OfferHead, OfferTable, PeerOffer, tensor_bytes, tensor_checksums
from ckpt_engine.elastic.regions import regions_of
from ckpt_engine.transports.nixl_agent import NixlAgent, load_nixl

__all__ = ["AHEAD_ENV", "PeerSource", "ahead_from_env"]

AHEAD_ENV = "CKPT_ENGINE_PEER_AHEAD"
"""Set to 1 in an engine's environment (its workers inherit it): a peer makes its agent, registers
its memory and takes its checksums when it newly holds a version, not at the first joiner's offer."""

_EMPTY = OfferTable([], [], [], [], [], [], [])
"""The table a `PeerOffer` built to be encoded carries (its encoded table is passed to `encode`)."""

logger = logging.getLogger(__name__)

_MAX_NAP_S = 1e-4
"""Longest sleep between two progress calls while an offer is open (reads over TCP move only then)."""
_CLOSE_S = 5.0
"""The longest `close` waits for the serving thread (and the one making the agent ahead) to stop."""
_LOCK_S = 60.0
"""The longest an offer, a check or the thread making the agent ahead waits for another's."""


class PeerSource:
    """The offers of one engine rank, and the agent that serves their reads."""

    def __init__(self, host: Offered, *, ahead: bool | None = None) -> None:
        self.host = host
        self.ahead = ahead if ahead is not None else ahead_from_env()
        """Make the agent, the registrations and the table whenever a version is newly held
        (`ready_ahead`), not at the first joiner's offer."""
        self.instance = secrets.token_hex(8)
        """This process's id in its offers: an offer made before a restart names another one."""
        self.generation = 0
        """Bumped whenever the held weights change (a sync or a pull installed a version)."""
        self._lock = threading.Lock()
        self._agent_lock = threading.Lock()
        """Orders every call into the agent (the progress thread's and an offer's): one at a time."""
        self._agent: NixlAgent | None = None
        self._names: list[str] = []
        self._ptrs: list[int] = []
        self._layout: tuple[list[str], dict[str, tuple[int, int]]] = ([], {})
        """The held tensors in offer order (by region and offset; empty ones last), and the (region,
        offset) of each non-empty one in the agent's registered regions."""
        self._table: tuple[int, bytes] | None = None
        """(generation, the encoded table: layout and checksums) of the last offer, or made ahead."""
        self._closed = False
        self._ahead_lock = threading.Lock()
        """Guards the thread making things ahead (`_ahead`, `_again`, `_closed`); held only briefly."""
        self._ahead: threading.Thread | None = None
        self._again = False
        """A version was newly held while the thread making things ahead ran: it goes round again."""
        self._open: dict[int, tuple[bytes, int, float]] = {}
        """offer id -> (digest of the offer as sent, generation it was made at, deadline)."""
        self._next_id = 0
        self._thread: threading.Thread | None = None

    def _state(self) -> tuple[int | None, bool, bool, int]:
        h = self.host
        return h.version, h.stale, h.receiving, self.generation

    def offer(self, version: int, timeout_s: float) -> bytes:
        """Open an offer of `version`; refused by name unless this engine holds exactly it, serving.
        Its agent, registrations and table (checksums) are made once per held version, here or
        ahead (`ready_ahead`); an offer then only packs its head."""
        h, before = self.host, self._state()
        if h.version != version or h.stale or h.receiving:
            held = "a partially loaded state" if h.stale or h.receiving else f"version {h.version}"
            raise ValueError(f"this engine holds {held}, not version {version}: it cannot offer it")
        with self._locked():
            agent, layout, cached = self._agent_locked(), self._layout, self._table
        if cached is None or cached[0] != before[3]:  # outside the lock: open offers' reads go on meanwhile
            cached = (before[3], self._tabled(agent, layout))
        with self._locked():
            if self._state() != before or self._agent is not agent:
                raise RuntimeError(f"a sync landed in this engine while it took the checksums of version {version}; ask again")
            self._table = cached
            with self._agent_lock:
                made = agent.offer()
            self._next_id += 1
            offer = PeerOffer(self.instance, self._next_id, version, agent.name, made.metadata, agent.memory, agent.device_id, made.slots, _EMPTY)
            raw = offer.encode(cached[1])
            self._open[offer.offer_id] = (hashlib.blake2b(raw, digest_size=16).digest(), before[3], time.monotonic() + timeout_s)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._serve, name="ckpt-peer-offers", daemon=True)
                self._thread.start()
        logger.info("offered version %d to a joining peer (offer %d, %d tensors in %d registered regions)", version, offer.offer_id, len(layout[0]), len(made.slots))
        return raw

    def _tabled(self, agent: NixlAgent, layout: tuple[list[str], dict[str, tuple[int, int]]]) -> bytes:
        """The encoded table of the held tensors as `agent` registered them (`layout`: their offer
        order and (region, offset)), their checksums taken now."""
        order, at = layout
        ts = [self.host.tensors[n] for n in order]
        sums = tensor_checksums(ts)
        where = [at.get(n, (0, 0)) for n in order]
        table = OfferTable(list(order), [str(t.dtype).removeprefix("torch.") for t in ts], [tuple(t.shape) for t in ts],
                           [r for r, _ in where], [o for _, o in where], [t.nbytes for t in ts], sums)
        return table.encode(agent.slots)

    def ready_ahead(self) -> None:
        """With `ahead`: make the agent, register the held tensors' memory and take their table on
        a thread now, off the step path, so that the first joiner's offer only packs its head (on
        2xH200 the first agent and its registrations were ~1.3 s of a 2.7 s offer). Called whenever
        a version is newly held; a thread already at it takes the newest state before it stops."""
        if not self.ahead:
            return
        with self._ahead_lock:  # never the offers' lock: a swap calling this must not wait for an agent's start
            if self._closed or (self._ahead is not None and self._ahead.is_alive()):
                self._again = True
                return
            self._again = False
            self._ahead = threading.Thread(target=self._make_ahead, name="ckpt-peer-ahead", daemon=True)
            self._ahead.start()

    def ahead_done(self, timeout_s: float) -> bool:
        """Wait (at most `timeout_s`) until nothing is being made ahead; whether that is so (a
        caller timing offers made ahead, a test)."""
        with self._ahead_lock:
            thread = self._ahead
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=timeout_s)
            return not thread.is_alive()
        return True

    @property
    def ready(self) -> bool:
        """Whether an offer now would only pack its head: the agent made, the table of the version held taken."""
        table = self._table
        return self._agent is not None and table is not None and table[0] == self.generation

    def _make_ahead(self) -> None:
        """The thread of `ready_ahead`: once, and again while a newer version came meanwhile."""
        while True:
            try:
                self._ahead_once()
            except Exception as exc:  # a join then makes them itself, as without `ahead`
                logger.warning("making the peer's agent ahead of a join failed (the next offer makes it): %s", exc)
            with self._ahead_lock:
                if not self._again or self._closed:
                    self._ahead = None
                    return
                self._again = False

    def _ahead_once(self) -> None:
        h, before = self.host, self._state()
        if h.version is None or h.stale or h.receiving or not h.tensors:
            return
        device = next(iter(h.tensors.values())).device
        t0 = time.perf_counter()
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            with self._locked():
                if self._closed:
                    return
                agent, layout, cached = self._agent_locked(), self._layout, self._table
            if cached is None or cached[0] != before[3]:
                table = self._tabled(agent, layout)
                with self._locked():
                    if self._state() != before or self._agent is not agent or self._closed:
                        return
                    self._table = (before[3], table)
        logger.info("made the peer's agent and table of version %s ahead of any join in %.3f s", before[0], time.perf_counter() - t0)

    def check(self, raw: bytes) -> None:
        """Refuse by name an offer this process did not make as it stands (a stale registration
        from before a restart, an altered one), one no longer open, or one whose version this
        engine no longer holds."""
        offer = OfferHead.decode(raw, "this peer")
        if offer.instance != self.instance:
            raise ValueError(
                f"a stale registration: offer {offer.offer_id} was made by peer process {offer.instance} (agent {offer.agent}), "
                f"this peer process is {self.instance} (it restarted since); ask it for a new offer"
            )
        with self._locked():
            entry = self._open.get(offer.offer_id)
        if entry is None:
            raise ValueError(f"offer {offer.offer_id} is not open at this peer (done, expired or never made)")
        if hashlib.blake2b(raw, digest_size=16).digest() != entry[0]:
            raise ValueError(f"offer {offer.offer_id} differs from what this peer made (version, agent or memory descriptors altered)")
        if self._state() != (offer.version, False, False, entry[1]):
            raise ValueError(f"this peer no longer holds version {offer.version} as offered (it holds version {self.host.version})")

    def done(self, offer_id: int) -> None:
        with self._locked():
            self._open.pop(offer_id, None)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """This source's lock, waited for at most `_LOCK_S` (an agent's start and registrations, ~1.3 s
        on an H200 host, are made under it)."""
        if not self._lock.acquire(timeout=_LOCK_S):
            raise TimeoutError(f"this peer's offers were held for more than {_LOCK_S:.0f}s (its agent being made?)")
        try:
            yield
        finally:
            self._lock.release()

    def _agent_locked(self) -> NixlAgent:
        """The agent with the memory regions of every held tensor registered (`elastic/regions.py`:
        a segment or a storage per many tensors; registered anew if their storage moved)."""
        h = self.host
        names = sorted(h.tensors)
        ptrs = [h.tensors[n].data_ptr() for n in names]
        if self._agent is not None and (names, ptrs) == (self._names, self._ptrs):
            return self._agent
        if self._agent is not None:
            if self._open:
                raise RuntimeError("the engine's tensors moved while offers are open; ask again once they closed")
            with self._agent_lock:
                self._agent.close()
            self._agent = None
        full = [n for n in names if h.tensors[n].numel()]
        regions = regions_of([tensor_bytes(h.tensors[n]) for n in full])
        where = dict(zip(full, regions.where))
        with self._agent_lock:
            agent = NixlAgent(load_nixl(), "peer", [])
            try:
                agent.register_regions(regions.spans, regions.device)
            except BaseException:
                agent.close()
                raise
        self._agent, self._names, self._ptrs, self._table = agent, names, ptrs, None
        self._layout = (sorted(full, key=where.__getitem__) + [n for n in names if not h.tensors[n].numel()], where)
        return self._agent

    def _serve(self) -> None:
        """Progress the agent while an offer is open; drop offers past their deadline."""
        nap = 1e-5
        while True:
            with self._lock:
                now = time.monotonic()
                for oid in [o for o, (_, _, deadline) in self._open.items() if deadline < now]:
                    logger.warning("offer %d expired before the joining peer said it was done", oid)
                    del self._open[oid]
                if not self._open or self._agent is None:
                    self._thread = None
                    return
                agent = self._agent
            with self._agent_lock:
                agent.progress()
            time.sleep(nap)
            nap = min(2 * nap, _MAX_NAP_S)

    def close(self) -> None:
        """Close the offers and the agent, once the thread serving them has stopped (it stops at
        its next look with no offer open): an agent closed under its progress call, or left to
        the interpreter's exit with the thread still in it, aborted the process ('terminate
        called without an active exception')."""
        with self._ahead_lock:
            self._closed = True
            ahead = self._ahead
        if ahead is not None and ahead is not threading.current_thread():
            ahead.join(timeout=_CLOSE_S)  # it stops at its next look (an agent's start, ~1.3 s, is under the lock)
        with self._lock:  # unbounded: closing must not leave the agent to the interpreter's exit
            self._open.clear()
            agent, self._agent = self._agent, None
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=_CLOSE_S)
        if agent is not None:
            with self._agent_lock:
                agent.close()


def ahead_from_env() -> bool:
    """`AHEAD_ENV` as a bool (unset: off); ValueError naming it and its value otherwise."""
    value = os.environ.get(AHEAD_ENV, "").strip().lower()
    if value in ("1", "on", "true", "yes"):
        return True
    if value in ("", "0", "off", "false", "no"):
        return False
    raise ValueError(f"{AHEAD_ENV} must be 1, on, true, yes or 0, off, false, no; got {os.environ[AHEAD_ENV]!r}")
