"""Peer joins in a vLLM worker (issue 43): a serving engine offers the version it serves, a late one
pulls it and installs it with the staged swap's own code.

Why not the live weights: what a vLLM worker serves from is post-processed (on CPU every linear
weight is packed into a oneDNN handle and its parameter emptied), so there is nothing to name or
read. What vLLM *loads* is the checkpoint layout, and a staged sync leaves exactly that in the
worker's staging copy (`vllm/staging.py`), checked, until its next staged receive: after the swap of
version V it is the engine's *image* of V, offered as is (no copy, no extra memory). A receive, a
stage, a pull or leaving the group drops the image first, so an offer is only ever of the bytes the
engine serves. With `CKPT_ENGINE_PEER_AHEAD=1` in the engine's environment, each install makes the
offer's NIXL agent, registrations and checksums on a thread (`PeerSource.ready_ahead`), so a
joiner's offer only packs its head (docs/elastic.md, "A peer made ahead").

A joiner checks the offer against what its model takes (`VllmSpecs`: every name one it loads, in
the checkpoint's dtype and shape, every needed one offered) before anything is allocated, then
stages the pull like a staged sync: a background thread reads the offer into its staging copy with
one-sided NIXL reads and checks each tensor against the peer's checksum (`elastic/pull.py`), while
the engine keeps stepping on what it held. The controller then swaps it in (`VllmRollout.swap`:
layerwise reload, or the prepared post-processed image, between two engine steps). A failed pull
installs nothing; the joiner serves what it served before, and its staging copy is scratch. After
the swap the joiner holds an image of V itself and can serve later joiners.

Left for later (refused by name): TP/PP > 1 (one image per rank), images of region deliveries.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from ckpt_engine.elastic.offer import PeerOffer
from ckpt_engine.elastic.peer_source import PeerSource
from ckpt_engine.elastic.prepared import JoinPrep
from ckpt_engine.elastic.pull import GcClock, read_checked
from ckpt_engine.rollout_adapters.engine_lease import EngineLease
from ckpt_engine.rollout_adapters.vllm.specs import VllmSpecs
from ckpt_engine.rollout_adapters.vllm.staging import Prepare, StagedReceive, Staging

__all__ = ["PeerImage", "VllmPeer"]

logger = logging.getLogger(__name__)

_NOT_STAGED = "its last sync was not staged (a peer join reads the staging copy a staged sync leaves)"


class PeerImage:
    """The checkpoint-layout tensors of the version this worker serves (`elastic.host.Offered`);
    `version` None: no image."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.version: int | None = None
        self.stale = False
        self.receiving = False
        self.why = _NOT_STAGED
        """Why there is no image (said in a refused offer)."""


class VllmPeer:
    """One vLLM worker's peer joins: its image and offers (`PeerSource`), and the pulls it stages."""

    def __init__(self) -> None:
        self.image = PeerImage()
        self.source = PeerSource(self.image)
        self._pull: StagedReceive | None = None
        self.pulled: tuple[int, str] | None = None
        """(version, peer) of the pull the last swap installed (None: a trainer sync installed it)."""
        self.lease = EngineLease()
        """Which weight-sync group may make this worker's peer calls (`caller`), as the reference
        receiver's lease guards its own: a worker serving one job is not offered or pulled into by another."""
        self.hold: Callable[[], None] = _no_hold
        """Called between two read windows of a pull: where a fault test holds one to act on its
        peer mid-pull, with no timing (`tests/_vllm_peer_faults.py`)."""
        self.prep = JoinPrep()
        """A pull's agent made, and its staging copy allocated and registered, before the offer came."""
        self.ahead_tried = False
        """Whether this worker was asked to prepare a join ahead (`worker.py`, once per worker)."""

    def caller(self, owner: str | None) -> VllmPeer:
        """This worker's peer joins, for a caller naming weight-sync group `owner` (None: none).
        PermissionError naming the owner while another group claimed this worker; an owner's call
        renews its claim, and the first call naming one claims an unclaimed worker (`EngineLease`)."""
        self.lease.owned_call(_no_hold)(owner=owner)
        return self

    # --- the serving side ------------------------------------------------------------------------
    def clear(self, why: str = _NOT_STAGED) -> None:
        """The staging copy or the live weights are about to change: no image (open offers fail their check)."""
        self.image.tensors, self.image.version, self.image.why = {}, None, why
        self.source.generation += 1

    def installed(self, version: int, staged: StagedReceive, specs: VllmSpecs) -> None:
        """A swap installed `staged` as `version`: its pairs are the image (whole tensors that cover
        every needed name; else none, said why), and where the version came from is recorded."""
        pulled = staged is self._pull
        self.pulled = (version, str((staged.report or {}).get("peer"))) if pulled else None
        self._pull = None
        if staged.items:
            return self.clear("its last staged sync delivered regions (an image of regions is not offered yet)")
        tensors: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for name, t in staged.pairs:  # a tied head rides as its embedding's own tensor: offered once
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                tensors[name] = t
        missing = sorted(set(specs.needed) - set(tensors))
        if missing:
            return self.clear(f"its last staged sync carried {len(specs.needed) - len(missing)} of the model's {len(specs.needed)} tensors (not {', '.join(missing[:3])})")
        self.image.tensors, self.image.version = tensors, version
        self.source.generation += 1
        self.source.ready_ahead()  # with CKPT_ENGINE_PEER_AHEAD: the agent for the next joiner, made now

    def offer(self, version: int, open_s: float) -> bytes:
        if self.image.version != version:
            held = f"keeps an image of version {self.image.version}" if self.image.version is not None else f"keeps no image: {self.image.why}"
            raise ValueError(f"this engine cannot offer version {version}: it {held}")
        return self.source.offer(version, open_s)

    def version_from(self, version: int | None) -> str | None:
        if version is None:
            return None
        return f"peer pull from {self.pulled[1]}" if self.pulled is not None and self.pulled[0] == version else "trainer sync"

    def close(self) -> None:
        self.clear("this engine left its weight-sync group (its staging copy is freed)")
        self.prep.release()
        self.source.close()

    # --- the joining side ------------------------------------------------------------------------
    def prepare(self, keep_s: float, *, specs: VllmSpecs, staging: Staging, device: torch.device) -> dict[str, Any]:
        """While the peer makes its offer: the pull's NIXL agent made and the staging copy it will
        read into allocated and registered, in this model's checkpoint shapes (`VllmSpecs`: every
        needed tensor; an offer naming another shape or a further tensor gets it at the pull).
        Nothing is written. A prepare no pull takes (`release`, its deadline, the next prepare)
        frees what it allocated and deregisters it."""
        if staging.running:
            raise RuntimeError("a peer join's prepare refused: a staged receive is streaming into this worker")
        into: dict[str, torch.Tensor] = {}
        made: dict[str, torch.Tensor] = {}

        def free() -> None:  # what this prepare allocated, unless a staged receive uses the copy by now
            if not staging.running:
                for name, t in made.items():
                    if staging.copy.tensors.get(name) is t:
                        del staging.copy.tensors[name]

        try:
            wanted = [(name, tuple(spec.shape), getattr(torch, spec.dtype)) for name, spec in sorted(specs.needed.items())]
            if not any(name in staging.copy.tensors for name, _, _ in wanted):  # a fresh copy: one slab, one region to register
                made = staging.copy.slab(wanted, device)
                into = dict(made)
            else:  # held copies (a staged sync's) are reused where they fit
                for name, shape, dtype in wanted:
                    before = staging.copy.tensors.get(name)
                    into[name] = staging.copy.slot(name, shape, dtype, device)
                    if into[name] is not before:
                        made[name] = into[name]
        except BaseException:  # out of memory part-way: nothing kept
            free()
            raise
        return {**self.prep.prepare(into, keep_s, on_release=free), "allocated": len(made)}

    def start_pull(
        self, raw: bytes, version: int, peer: str, read_timeout_s: float, *, specs: VllmSpecs, staging: Staging,
        device: torch.device, held: int | None, prepare: Prepare | None,
    ) -> None:
        """Check `raw` (the offer of `peer`) against what this model takes, then stage the pull on
        a background thread (`Staging`: the controller polls its status and swaps). ValueError:
        a bad offer, refused before anything is allocated."""
        t_call = time.perf_counter()
        offer = PeerOffer.decode(raw, peer)
        if held is not None and version <= held:
            raise ValueError(f"this engine holds version {held}; versions only grow, so it does not pull version {version}")
        check_against(offer, version, specs)
        self.clear("a peer pull is landing in its staging copy")
        t_started = 0.0

        def stream(staged: StagedReceive) -> dict[str, Any]:
            t0 = time.perf_counter()
            with GcClock().timing() as clock, GcClock.hold():  # no collection of the worker's heap mid-pull (0.1 s seen on 2xH200)
                # The prepare's slab laid again in the offer's order (no new memory, its one registration
                # still covers it): tensors back to back at the peer are then back to back here, one read.
                slabbed = [(n, shape, getattr(torch, d)) for n, d, shape in zip(offer.tensors.names, offer.tensors.dtypes, offer.tensors.shapes)
                           if n in staging.copy.slabbed]
                into = staging.copy.slab(slabbed, device) if slabbed and len(slabbed) == len(staging.copy.slabbed) else {}
                into.update({n: staging.copy.slot(n, shape, getattr(torch, d), device)
                             for n, d, shape in zip(offer.tensors.names, offer.tensors.dtypes, offer.tensors.shapes) if n not in into})
                staging.copy.retain(into)
                t_laid = time.perf_counter()
                nbytes, phases, prepared = read_checked(into, offer, peer, read_timeout_s, self.hold, self.prep)
                t_sink = time.perf_counter()
                alias = [(head, into[emb]) for head, emb in specs.tied.items() if head not in into and emb in into]
                staged.sink([*into.items(), *alias])  # kept as they are: they already are the staging copy
            seconds = time.perf_counter() - t0
            phases = {"start": t_started, "queued": t0 - t_call - t_started, "lay": t_laid - t0, **phases,
                      "sink": time.perf_counter() - t_sink, **clock.info()}
            logger.info("pulled version %d from peer %s into the staging copy: %d bytes in %.3f s (%s)", version, peer, nbytes, seconds, phases)
            return {"peer": peer, "version": version, "bytes": nbytes, "tensors": len(into), "seconds": seconds, "phases": phases, "prepare": prepared}

        t_started = time.perf_counter() - t_call  # the call's own work: the offer decoded and checked
        staging.start(f"peer-pull:{peer}:v{version}", stream, True, prepare)
        self._pull = staging.version


def _no_hold() -> None:
    """No hold: a pull reads its windows back to back."""


def check_against(offer: PeerOffer, version: int, specs: VllmSpecs) -> None:
    """Refuse (ValueError naming what) an offer of another version, or one that does not describe
    what this model loads: every needed checkpoint tensor, a tied head at most besides, each in the
    checkpoint's dtype and shape. Reads `specs` only: nothing is allocated."""
    needed, offered = specs.needed, set(offer.tensors.names)
    kinds = {d: str(getattr(torch, d)).removeprefix("torch.") for d in {s.dtype for s in specs.specs.values()}}  # as a tensor's dtype reads
    offer.check_layout(version, {n: (kinds[s.dtype], tuple(s.shape), s.nbytes) for n, s in specs.specs.items() if n in needed or n in offered})
