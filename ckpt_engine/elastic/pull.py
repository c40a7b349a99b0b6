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
from ckpt_engine.elastic.prepared import JoinPrep
from ckpt_engine.transports.nixl_agent import NixlAgent, load_nixl

__all__ = ["WINDOW", "pull_version", "read_checked"]

logger = logging.getLogger(__name__)

WINDOW = 8
"""Reads in flight at once; a test's hold (`hold`) applies between two windows."""
_MAX_NAP_S = 1e-3


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
    sums = tensor_checksums([into[t.name] for t in offer.tensors])
    bad = [t.name for t, got in zip(offer.tensors, sums) if got != t.checksum]
    if bad:
        raise RuntimeError(
            f"{len(bad)} tensor(s) read from peer {peer} do not match the checksums it advertised for version {offer.version} "
            f"({', '.join(bad[:5])}): a sync landed in the peer mid-read, or a memory descriptor was wrong"
        )
    return nbytes, {"connect": connect_s, "read": t_check - t0 - connect_s, "check": time.perf_counter() - t_check}, prepared


def _read_all(
    into: Mapping[str, torch.Tensor], offer: PeerOffer, peer: str, timeout_s: float, hold: Callable[[], None], prep: JoinPrep | None,
) -> tuple[int, float, dict[str, Any]]:
    """Every offered tensor into the held one, `WINDOW` reads at a time; the bytes read, the
    seconds it took to make the agent (or take the prepared one) and connect to the peer's, and
    what the prepare gave."""
    t0 = time.perf_counter()
    todo = [(i, t.name, tensor_bytes(into[t.name])) for i, t in enumerate(offer.tensors) if t.nbytes]
    taken = prep.take({name: local for _, name, local in todo}) if prep is not None else None
    if taken is not None and taken.agent is not None:
        agent, prepared = taken.agent, taken.info()
    else:  # nothing prepared: made and registered now, as before the prepare existed
        agent, prepared = NixlAgent(load_nixl(), "join", [b for _, _, b in todo]), {"used": False, "early": 0, "late": len(todo)}
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
        return sum(local.numel() for _, _, local in todo), connect_s, prepared
    finally:
        agent.close()
