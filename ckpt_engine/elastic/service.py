"""An engine process's peer-join service: the RPC handlers through which a controller asks it to
offer the version it holds (as a serving peer) or to pull one from a peer (as a joiner), and where
its version came from (`version_from`: "trainer sync" or "peer pull from <peer>"), which its
health reports and `ckpt-engine status` shows."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from ckpt_engine.elastic.host import PeerHost
from ckpt_engine.elastic.offer import PeerOffer
from ckpt_engine.elastic.peer_source import PeerSource
from ckpt_engine.elastic.prepared import JoinPrep
from ckpt_engine.elastic.pull import pull_version

__all__ = ["PeerService"]


class PeerService:
    """Held by the engine process (`TorchRefWorker.peers`); the engine calls `synced()` whenever a
    trainer sync installs a version (finalize, swap)."""

    def __init__(self, host: PeerHost, exclusive: Callable[[str], AbstractContextManager[None]], hold: Callable[[], None]) -> None:
        self.host = host
        self.source = PeerSource(host)
        self._exclusive = exclusive
        self._hold = hold
        self._pulled: tuple[int, str] | None = None
        """(version, peer) of the last pull, until a sync installs a version."""
        self.prep = JoinPrep()
        """A pull's agent made before the offer came (`prepare`), taken by the pull."""

    def prepare(self, keep_s: float) -> dict[str, Any]:
        """Make the pull's agent and register the held tensors (a pull lands in them) while the
        peer makes its offer (`elastic/prepared.py`); kept `keep_s` unless the pull takes it."""
        return self.prep.prepare(dict(self.host.tensors), keep_s)

    def synced(self) -> None:
        self._pulled = None
        self.source.generation += 1
        self.source.ready_ahead()  # with CKPT_ENGINE_PEER_AHEAD: the agent for the next joiner, made now

    def version_from(self, version: int | None) -> str | None:
        if version is None:
            return None
        return f"peer pull from {self._pulled[1]}" if self._pulled is not None and self._pulled[0] == version else "trainer sync"

    def pull(self, offer: bytes, version: int, peer: str, read_timeout_s: float) -> dict[str, Any]:
        """Pull `version` from `peer` (its `offer`); see `pull.py`."""
        decoded = PeerOffer.decode(offer, peer)  # once: the pull and its checks take it as decoded
        if decoded.version != version:
            raise ValueError(f"peer {peer!r} offers version {decoded.version}, but this engine was asked to pull version {version} (a peer advertising a version it does not hold?)")
        self.source.generation += 1  # from the first read on, what this engine held is gone
        try:
            return pull_version(self.host, decoded, peer, read_timeout_s, self._exclusive, self._hold, self.prep)
        finally:
            self._pulled = (version, peer) if self.host.version == version else None
            if self._pulled is not None:
                self.source.ready_ahead()  # it can serve later joiners

    def handlers(self, owned: Callable[[Callable[..., Any]], Callable[..., Any]]) -> dict[str, Callable[..., Any]]:
        """RPC methods, each through `owned` (the engine's lease: only its group may call them)."""
        s = self.source
        return {
            "peer_offer": owned(lambda version, open_s: s.offer(version, open_s)),
            "peer_check": owned(lambda offer: s.check(offer)),
            "peer_done": owned(lambda offer_id: s.done(offer_id)),
            "pull_from_peer": owned(self.pull),
            "peer_prepare": owned(self.prepare),
            "peer_unprepare": owned(lambda: self.prep.release()),
        }
