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

import logging
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch

from ckpt_engine.elastic.host import PeerHost
from ckpt_engine.elastic.offer import PeerOffer, tensor_bytes, tensor_checksums
from ckpt_engine.transports.nixl_agent import NixlAgent, load_nixl

__all__ = ["WINDOW", "pull_version", "read_checked"]

logger = logging.getLogger(__name__)

WINDOW = 8
"""Reads in flight at once; a test's hold (`hold`) applies between two windows."""
_MAX_NAP_S = 1e-3


def pull_version(
    host: PeerHost, offer: PeerOffer, peer: str, timeout_s: float,
    exclusive: Callable[[str], AbstractContextManager[None]], hold: Callable[[], None],
) -> dict[str, Any]:
    """Make `host` hold `offer.version`, read from `peer`; returns {version, peer, bytes, tensors,
    seconds}. Raises ValueError (bad input: nothing touched) or RuntimeError (the engine is left
    paused and stale)."""
    version = offer.version
    if host.last_version is not None and version < host.last_version:
        raise ValueError(f"this engine held version {host.last_version} already; versions only grow, so it cannot pull version {version}")
    offer.check_for(version, host.tensors)
    with exclusive(f"a pull of version {version} from peer {peer}"):
        host.pause("keep")
        host.stale, host.version, host.receiving, host.received = True, None, True, None
        t0 = time.perf_counter()
        try:
            nbytes, phases = read_checked(host.tensors, offer, peer, timeout_s, hold)  # a failure leaves it out of service
            host.version, host.last_version, host.stale = version, version, False
        finally:
            host.receiving = False
        seconds = time.perf_counter() - t0
        host.resume()
    logger.info("pulled version %d from peer %s: %d bytes in %.3f s (%s)", version, peer, nbytes, seconds, phases)
    return {"version": version, "peer": peer, "bytes": nbytes, "tensors": len(offer.tensors), "seconds": seconds, "phases": phases}


def read_checked(
    into: Mapping[str, torch.Tensor], offer: PeerOffer, peer: str, timeout_s: float, hold: Callable[[], None],
) -> tuple[int, dict[str, float]]:
    """Read every offered tensor into `into` (by name: the live tensors of a reference receiver, a
    vLLM worker's staging copy) and check each against the checksum the peer advertised. Returns
    the bytes read and the seconds by phase (connect, read, check); raises RuntimeError naming what
    failed (a read, a checksum)."""
    t0 = time.perf_counter()
    nbytes, connect_s = _read_all(into, offer, peer, timeout_s, hold)
    t_check = time.perf_counter()
    sums = tensor_checksums([into[t.name] for t in offer.tensors])
    bad = [t.name for t, got in zip(offer.tensors, sums) if got != t.checksum]
    if bad:
        raise RuntimeError(
            f"{len(bad)} tensor(s) read from peer {peer} do not match the checksums it advertised for version {offer.version} "
            f"({', '.join(bad[:5])}): a sync landed in the peer mid-read, or a memory descriptor was wrong"
        )
    return nbytes, {"connect": connect_s, "read": t_check - t0 - connect_s, "check": time.perf_counter() - t_check}


def _read_all(into: Mapping[str, torch.Tensor], offer: PeerOffer, peer: str, timeout_s: float, hold: Callable[[], None]) -> tuple[int, float]:
    """Every offered tensor into the held one, `WINDOW` reads at a time; the bytes read and the
    seconds it took to make the agent and connect to the peer's."""
    t0 = time.perf_counter()
    todo = [(i, t.name, tensor_bytes(into[t.name])) for i, t in enumerate(offer.tensors) if t.nbytes]
    agent = NixlAgent(load_nixl(), "join", [b for _, _, b in todo])
    deadline = time.monotonic() + timeout_s
    try:
        try:
            agent.add_peer(0, offer.slots())
        except Exception as exc:
            raise RuntimeError(f"could not connect to peer {peer}'s agent {offer.agent}: {exc}") from exc
        connect_s = time.perf_counter() - t0
        for start in range(0, len(todo), WINDOW):
            window = todo[start : start + WINDOW]
            try:
                reqs = [(name, agent.read(0, i, 0, local)) for i, name, local in window]
            except Exception as exc:
                raise RuntimeError(f"a read from peer {peer} could not start (a wrong memory descriptor, or the peer left?): {exc}") from exc
            for name, req in reqs:
                nap = 1e-5
                while (state := agent.state(req)) == "PROC":
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"the read of {name} from peer {peer} did not finish within {timeout_s}s")
                    time.sleep(nap)
                    nap = min(2 * nap, _MAX_NAP_S)
                if state != "DONE":
                    raise RuntimeError(f"the read of {name} from peer {peer} failed in NIXL ({state}): did the peer leave or die?")
            hold()
        return sum(local.numel() for _, _, local in todo), connect_s
    finally:
        agent.close()
