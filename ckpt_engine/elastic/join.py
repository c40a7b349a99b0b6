"""Elastic fleets, the controller's call: an engine that registers or restarts while the job runs
pulls the version a serving peer holds, from that peer, with one-sided NIXL reads, and serves it
only once it holds that version bit for bit. The trainer and the other engines go on meanwhile.

    report = join_from_peer(joiner, peers)      # the library; `ckpt-engine serve` does the same

The peers asked are the serving ones (complete version, not paused, not stale) holding the wanted
version (default: the newest any of them holds), in the order given. Each attempt: the peer opens
an offer of exactly that version (or refuses by name), the offer is checked with the peer as it
stands (a stale one from before a restart, or an altered one, is refused by name), the joiner
checks it against what it holds and reads, and checks what it read against the peer's checksums.
A peer that fails (died mid-pull, refused) is named, and the next one is tried; when none is left
the joiner holds no version and does not serve, and the trainer's next sync seeds it.

The joiner prepares beside the peer's offer (`elastic/prepared.py`): while the peer makes its offer
(its agent, its registration, its checksums), the joiner makes its own NIXL agent and registers the
tensors its pull lands in, which it knows from its own model; the pull then only loads the peer's
metadata, registers what the offer names and the prepare did not, and reads. A prepare the pull does
not take (the offer was refused, the peer failed) is released at the join's end (or by the next
prepare, or at its deadline in the engine); a prepare that failed leaves the pull to make its agent
itself, as before. On 2xH200 each of the two was ~1.4 s, once a process.

While it joins, the joiner is held for the join (`PeerJoinable.joining`, under a fresh name per
join): a vLLM engine's workers refuse a sync's group join or validate meanwhile by name, and a join
into an engine a sync holds is refused by name (`PeerJoinError` naming the joiner), before anything
is touched.

Afterwards the joiner reports the version like an engine a sync reached, so a session's next sync
counts it (`next_version`); it is a new member of the session's weight-sync group, so that sync
rebuilds the group and is a dense seed for every engine (delta chains restart from it: every
rank's delta bases live in the group's transport engine, docs/elastic.md says what carrying the
joiner into the chain needs).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ckpt_engine.elastic.offer import OfferHead
from ckpt_engine.rollout_adapters.base import RolloutAdapter, version_of

__all__ = ["PeerJoinError", "PeerJoinReport", "PeerJoinable", "join_from_peer", "serving_version"]

logger = logging.getLogger(__name__)

_SLACK_S = 10.0
"""Beyond a prepare call's own bound, the longest a join waits for its answer."""


class PeerJoinable(ABC):
    """An engine handle whose engine can offer its held weights to a joining peer, and pull them
    from one (the reference receiver's `TorchRefRollout`). The calls go to the engine's process."""

    name: str

    @abstractmethod
    def peer_rpc(self, method: str, timeout_s: float | None = None, **params: Any) -> Any:
        """One control call to the engine's process (with this handle's group, if it has one)."""

    def peer_offer(self, version: int, timeout_s: float) -> bytes:
        return bytes(self.peer_rpc("peer_offer", version=version, open_s=timeout_s))

    def peer_check(self, offer: bytes) -> None:
        self.peer_rpc("peer_check", offer=offer)

    def peer_done(self, offer_id: int) -> None:
        self.peer_rpc("peer_done", timeout_s=5.0, offer_id=offer_id)  # best effort: an open offer also closes at its deadline

    def pull_from_peer(self, offer: bytes, version: int, peer: str, timeout_s: float) -> dict[str, Any]:
        return dict(self.peer_rpc("pull_from_peer", timeout_s=2 * timeout_s, offer=offer, version=version, peer=peer, read_timeout_s=timeout_s))

    def peer_prepare(self, keep_s: float, timeout_s: float) -> dict[str, Any]:
        """Before the peer's offer comes, make the pull's NIXL agent and register what the pull will
        land in (known from this engine's own model), kept `keep_s` unless a pull takes it; returns
        what was prepared. The join calls it on a thread beside the peer's offer."""
        return dict(self.peer_rpc("peer_prepare", timeout_s=timeout_s, keep_s=keep_s))

    def peer_unprepare(self) -> None:
        """Release a prepare no pull took (its agent closed, its registrations and allocations gone)."""
        self.peer_rpc("peer_unprepare", timeout_s=10.0)

    @contextlib.contextmanager
    def joining(self, owner: str, timeout_s: float) -> Iterator[None]:
        """Hold this engine for one join named `owner` while it pulls (`timeout_s`: the join's), so
        that a sync into it meanwhile is refused by name; raises, by name, if a sync holds it. By
        default nothing: the reference receiver takes its receiver for the whole pull, which a
        sync's join, receive or swap is refused by (`VllmRollout` claims its workers' lease)."""
        yield


@dataclass
class PeerJoinReport:
    """A completed join: who, which version, from which peer, how fast; the peers that failed first."""

    engine: str
    version: int
    peer: str
    bytes: int
    tensors: int
    seconds: float
    """The joiner's reads and checks, from its first read to holding the version."""
    wall_s: float
    """The whole call, offers and failed attempts included: the joiner's time to serve."""
    failed: dict[str, str] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)
    """The joiner's seconds by phase: prepare (its agent made and its tensors registered, beside the
    peer's offer), prepare_wait (how long the pull waited for it after the offer: 0 when the offer
    took longer), connect (what was left of connecting: what the prepare lacked registered, the
    peer's metadata loaded), read, check (checksums); a vLLM joiner's whole pull call too: start,
    queued, lay, sink, gc (the collector inside the stream), shadow and swap (`vllm/peer.py`)."""
    prepare: dict[str, Any] = field(default_factory=dict)
    """The last attempt's prepare: used (the pull read with its agent), early / late (tensors
    registered before the offer / at the pull), tensors, bytes, seconds; error when it failed."""

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "gbps": self.gbps}


class PeerJoinError(RuntimeError):
    """No peer could give the joiner the version; `failed` names each peer tried and why. The
    joiner holds no version (it does not serve) until a sync or another join installs one."""

    def __init__(self, engine: str, version: int | None, failed: dict[str, str]) -> None:
        tried = "; ".join(f"{p}: {why}" for p, why in failed.items()) if failed else "no serving peer holds it"
        super().__init__(f"engine {engine!r} could not join from a peer (version {version}): {tried}")
        self.engine, self.version, self.failed = engine, version, dict(failed)


def serving_version(engine: RolloutAdapter) -> int | None:
    """The version an engine serves now, by its health (None: paused, stale or holding none). A
    handle whose health says its own version only (a vLLM handle's: None when another process's
    session synced the engine, as a trainer following `ckpt-engine serve` does) is asked what its
    workers hold (`held_version`): a worker in the middle of a sync keeps no image to offer, so its
    offer is refused by name and the next peer is tried."""
    health = engine.health()
    if health.get("paused") or health.get("stale") or health.get("receiving"):
        return None
    version = version_of(health.get("version"))
    return engine.held_version() if version is None and "stale" not in health else version


def join_from_peer(
    joiner: RolloutAdapter, peers: Sequence[RolloutAdapter], *, version: int | None = None, timeout_s: float = 60.0,
) -> PeerJoinReport:
    """Make `joiner` hold `version` (default: the newest a serving peer holds), pulled from one of
    `peers`; see the module docstring. Raises ValueError (bad arguments) or PeerJoinError."""
    t0 = time.perf_counter()
    if not isinstance(joiner, PeerJoinable):
        raise ValueError(f"engine {joiner.name!r} cannot join from a peer: its handle ({type(joiner).__name__}) is not PeerJoinable")
    failed: dict[str, str] = {}
    held: dict[str, int] = {}
    for p in peers:
        if p.name == joiner.name:
            continue
        if not isinstance(p, PeerJoinable):
            failed[p.name] = f"its handle ({type(p).__name__}) cannot offer weights to a peer"
            continue
        try:
            v = serving_version(p)
        except Exception as exc:
            failed[p.name] = f"health probe failed: {exc}"
            continue
        if v is not None:
            held[p.name] = v
    want = version if version is not None else max(held.values(), default=None)
    if want is None:
        raise PeerJoinError(joiner.name, None, failed)
    with contextlib.ExitStack() as held_for_join:
        try:
            held_for_join.enter_context(joiner.joining(f"peer join {secrets.token_hex(3)}", timeout_s))
        except Exception as exc:  # a sync holds the joiner (or it cannot be reached): nothing was touched
            raise PeerJoinError(joiner.name, want, {joiner.name: f"the joiner could not be held for the join: {exc}"}) from exc
        beside = Beside(joiner, timeout_s)
        held_for_join.callback(beside.release)  # before the hold is let go: a prepare no pull took goes
        return _attempts(joiner, peers, held, want, failed, timeout_s, t0, beside)


def _attempts(
    joiner: PeerJoinable, peers: Sequence[RolloutAdapter], held: dict[str, int], want: int, failed: dict[str, str], timeout_s: float, t0: float,
    beside: Beside,
) -> PeerJoinReport:
    """Each peer serving `want`, in order, until one join completes (else PeerJoinError)."""
    for p in peers:
        if held.get(p.name) != want:
            if p.name in held:
                failed.setdefault(p.name, f"serves version {held[p.name]}, not {want}")
            continue
        assert isinstance(p, PeerJoinable)
        try:
            got = _attempt(joiner, p, want, timeout_s, beside)
        except Exception as exc:
            logger.warning("engine %s: the join from peer %s failed: %s", joiner.name, p.name, exc)
            failed[p.name] = f"{type(exc).__name__}: {exc}"
            continue
        beside.taken = bool((got.get("prepare") or {}).get("used"))
        phases = {**dict(got.get("phases") or {}), "prepare": beside.seconds, "prepare_wait": beside.waited}
        report = PeerJoinReport(joiner.name, want, p.name, got["bytes"], got["tensors"], got["seconds"], time.perf_counter() - t0, failed,
                                phases, {**beside.info, **dict(got.get("prepare") or {})})
        logger.info("engine %s joined at version %d from peer %s (%.3f GB/s, %.3f s to serve)", joiner.name, want, p.name, report.gbps, report.wall_s)
        return report
    raise PeerJoinError(joiner.name, want, failed)


def _attempt(joiner: PeerJoinable, peer: PeerJoinable, version: int, timeout_s: float, beside: Beside) -> dict[str, Any]:
    beside.start()  # the joiner prepares while the peer makes its offer: neither waits for the other
    raw = peer.peer_offer(version, timeout_s)
    head = OfferHead.decode(raw, peer.name)  # its head only: the joiner decodes the table, once
    try:
        if head.version != version:
            raise ValueError(f"asked for version {version}, it offered version {head.version}")
        return pull_offer(joiner, peer, raw, timeout_s, beside.settle_for_pull, head)
    finally:
        try:
            peer.peer_done(head.offer_id)
        except Exception as exc:  # a dead peer: nothing to close
            logger.debug("closing the offer of %s: %s", peer.name, exc)


def pull_offer(
    joiner: PeerJoinable, peer: PeerJoinable, raw: bytes, timeout_s: float, before_pull: Callable[[], None] | None = None,
    head: OfferHead | None = None,
) -> dict[str, Any]:
    """One pull of an offer `peer` made (`head`: its head, when the caller decoded it): checked with
    the peer as it stands now (a stale offer from before a restart, an altered one, a version it no
    longer holds: refused by name), then read (`before_pull`: the join waits there for the joiner's
    prepare). Only the joiner decodes the offer's table."""
    version = (head or OfferHead.decode(raw, peer.name)).version
    peer.peer_check(raw)
    if before_pull is not None:
        before_pull()
    return joiner.pull_from_peer(raw, version, peer.name, timeout_s)


class Beside:
    """The joiner's prepare (`PeerJoinable.peer_prepare`) on a thread of its own, beside the peer's
    offer. The joiner takes one call at a time (two threads on one in-process vLLM client abort it),
    so every other call to it waits for the prepare in flight first, bounded by the prepare's own
    bound and `_SLACK_S`; a prepare still out then fails the attempt by name instead."""

    def __init__(self, joiner: PeerJoinable, timeout_s: float) -> None:
        self.joiner, self.timeout_s = joiner, timeout_s
        self.keep_s = 2 * timeout_s + 30.0
        """How long the engine keeps a prepare no pull took (an offer, a check and a pull's start come first)."""
        self.seconds = 0.0
        """The last prepare's seconds (the call's, from this side)."""
        self.waited = 0.0
        """How long the last pull waited for its prepare after the offer."""
        self.info: dict[str, Any] = {}
        self.taken = False
        """The pull that completed read with the prepared agent: nothing is left to release."""
        self._done: threading.Event | None = None

    def start(self) -> None:
        self._settle()
        done = self._done = threading.Event()
        threading.Thread(target=self._run, args=(done,), name=f"ckpt-prepare-{self.joiner.name}", daemon=True).start()

    def _run(self, done: threading.Event) -> None:
        t0 = time.perf_counter()
        try:
            self.info = {**self.joiner.peer_prepare(self.keep_s, self.timeout_s)}
        except Exception as exc:  # the pull then makes its agent itself, as without a prepare
            logger.warning("engine %s: its prepare before the offer failed (the pull prepares itself): %s", self.joiner.name, exc)
            self.info = {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            self.seconds = time.perf_counter() - t0
            self.info["seconds"] = self.seconds
            done.set()

    def _settle(self) -> None:
        """Wait for a prepare in flight (bounded); RuntimeError naming it if it is still out."""
        done = self._done
        if done is not None and not done.wait(self.timeout_s + _SLACK_S):
            raise RuntimeError(f"the joiner's prepare did not answer within {self.timeout_s + _SLACK_S:.0f}s; no other call goes to it meanwhile")

    def settle_for_pull(self) -> None:
        t0 = time.perf_counter()
        self._settle()
        self.waited = time.perf_counter() - t0

    def release(self) -> None:
        """At the join's end: a prepare no pull took is released (best effort: else at its deadline)."""
        if self._done is None or self.taken:
            return
        try:
            self._settle()
            self.joiner.peer_unprepare()
        except Exception as exc:
            logger.warning("engine %s: releasing its prepare failed (it lapses within %.0fs): %s", self.joiner.name, self.keep_s, exc)
