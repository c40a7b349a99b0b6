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

import hashlib
import logging
import secrets
import threading
import time

from ckpt_engine.elastic.host import Offered
from ckpt_engine.elastic.offer import PeerOffer, TensorOffer, tensor_bytes, tensor_checksums
from ckpt_engine.elastic.regions import regions_of
from ckpt_engine.transports.nixl_agent import NixlAgent, load_nixl

__all__ = ["PeerSource"]

logger = logging.getLogger(__name__)

_MAX_NAP_S = 1e-4
"""Longest sleep between two progress calls while an offer is open (reads over TCP move only then)."""
_CLOSE_S = 5.0
"""The longest `close` waits for the serving thread to stop."""


class PeerSource:
    """The offers of one engine rank, and the agent that serves their reads."""

    def __init__(self, host: Offered) -> None:
        self.host = host
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
        self._where: dict[str, tuple[int, int]] = {}
        """(region, offset) of each non-empty held tensor in the agent's registered regions."""
        self._order: list[str] = []
        """The held tensors in offer order (by region and offset; empty ones last)."""
        self._sums: tuple[int, list[int]] | None = None
        """(generation, checksum of each tensor in `_order`) of the last offer."""
        self._open: dict[int, tuple[bytes, int, float]] = {}
        """offer id -> (digest of the offer as sent, generation it was made at, deadline)."""
        self._next_id = 0
        self._thread: threading.Thread | None = None

    def _state(self) -> tuple[int | None, bool, bool, int]:
        h = self.host
        return h.version, h.stale, h.receiving, self.generation

    def offer(self, version: int, timeout_s: float) -> bytes:
        """Open an offer of `version`; refused by name unless this engine holds exactly it, serving."""
        h, before = self.host, self._state()
        if h.version != version or h.stale or h.receiving:
            held = "a partially loaded state" if h.stale or h.receiving else f"version {h.version}"
            raise ValueError(f"this engine holds {held}, not version {version}: it cannot offer it")
        with self._lock:
            agent, order, cached = self._agent_locked(), self._order, self._sums
        if cached is None or cached[0] != before[3]:  # outside the lock: open offers' reads go on meanwhile
            cached = (before[3], tensor_checksums([h.tensors[n] for n in order]))
        sums = cached[1]
        with self._lock:
            if self._state() != before or self._agent is not agent:
                raise RuntimeError(f"a sync landed in this engine while it took the checksums of version {version}; ask again")
            self._sums = cached
            with self._agent_lock:
                made = agent.offer()
            tensors = tuple(
                TensorOffer(n, str(h.tensors[n].dtype).removeprefix("torch."), tuple(h.tensors[n].shape), *self._where.get(n, (0, 0)), h.tensors[n].nbytes, s)
                for n, s in zip(order, sums)
            )
            self._next_id += 1
            offer = PeerOffer(self.instance, self._next_id, version, agent.name, made.metadata, agent.memory, agent.device_id, made.slots, tensors)
            raw = offer.encode()
            self._open[offer.offer_id] = (hashlib.blake2b(raw, digest_size=16).digest(), before[3], time.monotonic() + timeout_s)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._serve, name="ckpt-peer-offers", daemon=True)
                self._thread.start()
        logger.info("offered version %d to a joining peer (offer %d, %d tensors in %d registered regions)", version, offer.offer_id, len(tensors), len(offer.regions))
        return raw

    def check(self, raw: bytes) -> None:
        """Refuse by name an offer this process did not make as it stands (a stale registration
        from before a restart, an altered one), one no longer open, or one whose version this
        engine no longer holds."""
        offer = PeerOffer.decode(raw, "this peer")
        if offer.instance != self.instance:
            raise ValueError(
                f"a stale registration: offer {offer.offer_id} was made by peer process {offer.instance} (agent {offer.agent}), "
                f"this peer process is {self.instance} (it restarted since); ask it for a new offer"
            )
        with self._lock:
            entry = self._open.get(offer.offer_id)
        if entry is None:
            raise ValueError(f"offer {offer.offer_id} is not open at this peer (done, expired or never made)")
        if hashlib.blake2b(raw, digest_size=16).digest() != entry[0]:
            raise ValueError(f"offer {offer.offer_id} differs from what this peer made (version, agent or memory descriptors altered)")
        if self._state() != (offer.version, False, False, entry[1]):
            raise ValueError(f"this peer no longer holds version {offer.version} as offered (it holds version {self.host.version})")

    def done(self, offer_id: int) -> None:
        with self._lock:
            self._open.pop(offer_id, None)

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
        self._agent, self._names, self._ptrs, self._sums, self._where = agent, names, ptrs, None, where
        self._order = sorted(full, key=where.__getitem__) + [n for n in names if not h.tensors[n].numel()]
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
        with self._lock:
            self._open.clear()
            agent, self._agent = self._agent, None
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=_CLOSE_S)
        if agent is not None:
            with self._agent_lock:
                agent.close()
