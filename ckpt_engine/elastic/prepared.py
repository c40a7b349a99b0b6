"""A joiner's side of a peer join made ready before the peer's offer arrives (issue 43, the late
joiner's time to serve): its NIXL agent (UCX started) and the registration of the tensors its pull
will land in, which it knows from its own model (the reference receiver: its live tensors; a vLLM
worker: its staging copy in its model's checkpoint shapes). On 2xH200 these, and the peer's first
offer, were each ~1.4 s, once a process, and neither waits for the other: `join_from_peer` asks the
joiner to prepare while the peer makes its offer.

One prepared agent per engine process at most. The pull takes it (`take`): every tensor the offer
names whose memory it has not registered is registered then (another shape, new storage), so a
prepare that guessed wrong costs what no prepare costs, never a wrong read. A prepare the pull never
takes (the offer was refused, the peer failed first) is released: at the join's end, by the next
prepare, or at its own deadline (a controller that died), with every registration it made and
whatever its engine allocated for it (`on_release`).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ckpt_engine.elastic.offer import checksum_word, tensor_bytes, tensor_checksums
from ckpt_engine.elastic.regions import regions_of
from ckpt_engine.transports.nixl_agent import NixlAgent, load_nixl

__all__ = ["JoinPrep", "Taken", "register_uncovered", "warm_checksums"]

logger = logging.getLogger(__name__)

_LOCK_S = 30.0
"""The longest a call waits for another's prepare or release (an agent's start is ~1.4 s on an H200 host)."""


_WARM: set[tuple[torch.device, int]] = set()
"""The (device, word size) pairs whose checksums this process has run (`warm_checksums`)."""


def warm_checksums(tensors: list[torch.Tensor]) -> None:
    """Run the checksums once on a few bytes of each device and word size `tensors` will be
    checksummed in, so the pull's first checksums do not pay the process's first launch (on a GPU:
    Triton's kernel loaded or compiled per word size, `checksum_kernel.py`; the 30B-A3B joiner's
    checksums took 0.162 s on 2xH200 for ~10 ms of kernel). Once per process, device and word size;
    what the prepare does beside the offer, or ahead."""
    wanted = {(t.device, checksum_word(t.nbytes)) for t in tensors}
    todo = sorted(wanted - _WARM, key=str)
    _WARM.update(todo)
    if not todo:
        return
    try:
        tensor_checksums([torch.zeros(w, dtype=torch.uint8, device=d) for d, w in todo])  # w bytes: one word of w
    except Exception as exc:  # the pull's own checksums then say what is wrong, by name
        logger.warning("warming the checksums (%s) failed: %s", todo, exc)


def _landing(tensors: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """The non-empty tensors a read lands in and a registration covers, contiguous (a strided one is
    refused by name: a read would land in the copy its flat view makes). No view is made: 9,435 of
    them, two per tensor, were most of a 30B-A3B joiner's connect (0.2 s)."""
    out = []
    for name, t in tensors.items():
        if not t.is_contiguous():
            raise ValueError(f"a peer join reads and registers contiguous tensors only; {name} has shape {list(t.shape)} and strides {list(t.stride())}")
        if t.numel():
            out.append(t)
    return out


@dataclass
class _Prepared:
    agent: NixlAgent
    on_release: Callable[[], None] | None
    timer: threading.Timer


@dataclass
class Taken:
    """What a pull got from its engine's prepare: the agent to read with (None: none was prepared,
    the pull makes one) and how many of its tensors lay in the regions the prepare registered and
    how many outside them (registered at the pull)."""

    agent: NixlAgent | None
    early: int = 0
    late: int = 0

    def info(self) -> dict[str, Any]:
        return {"used": self.agent is not None, "early": self.early, "late": self.late}


class JoinPrep:
    """One engine process's prepared pull (at most one)."""

    def __init__(self, label: str = "join") -> None:
        self.label = label
        self._lock = threading.Lock()
        self._held: _Prepared | None = None
        self._starting: cf.Future[NixlAgent] | None = None
        """An agent being made on a thread (`start_agent`), for the next prepare to take."""

    def start_agent(self) -> None:
        """Begin making the agent on a thread while the caller does the rest of its prepare (a vLLM
        worker: its loaders' dry run, 2.6 s for Qwen3-30B-A3B at 24 layers on an H200 host, beside
        UCX's start, ~1.4 s, which releases the GIL). The next `prepare` takes it; `release` closes
        it if none does. Nothing is started while an agent is held or starting."""
        with self._locked():
            if self._held is not None or self._starting is not None:
                return
            made: cf.Future[NixlAgent] = cf.Future()
            self._starting = made

            def make() -> None:
                try:
                    made.set_result(NixlAgent(load_nixl(), self.label, []))
                except BaseException as exc:  # handed to the prepare that takes it
                    made.set_exception(exc)

            threading.Thread(target=make, name="ckpt-join-agent", daemon=True).start()

    def _started(self) -> NixlAgent | None:
        """The agent `start_agent` began (waited for, within the lock's bound), if any."""
        starting, self._starting = self._starting, None
        return starting.result(timeout=_LOCK_S) if starting is not None else None

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        if not self._lock.acquire(timeout=_LOCK_S):
            raise TimeoutError(f"a peer join's prepare or release held this engine for more than {_LOCK_S:.0f}s")
        try:
            yield
        finally:
            self._lock.release()

    @property
    def held(self) -> bool:
        return self._held is not None

    def prepare(self, into: Mapping[str, torch.Tensor], keep_s: float, on_release: Callable[[], None] | None = None) -> dict[str, Any]:
        """Make an agent with `into` registered (a held one is kept, what it lacks registered, its
        deadline renewed), kept `keep_s` unless a pull takes it or a release comes first. Returns
        {seconds, tensors, bytes, reused, regions (registered in all)}. A failure leaves nothing registered (`on_release` called)."""
        t0 = time.perf_counter()
        with self._locked():
            held, self._held = self._held, None
            if held is not None:
                held.timer.cancel()
            release = on_release if held is None else _chain(held.on_release, on_release)
            try:
                views = _landing(into)
                if held is None:
                    agent = self._started() or NixlAgent(load_nixl(), self.label, [])
                    try:
                        register_uncovered(agent, views)
                    except BaseException:
                        agent.close()
                        raise
                else:  # its agent is kept (UCX started): only what it lacks is registered
                    agent = held.agent
                    register_uncovered(agent, views)
            except BaseException:
                _let_go(held.agent if held is not None else None, release)
                raise
            warm_checksums(views)
            timer = threading.Timer(keep_s, self._expire, args=(agent,))
            timer.daemon = True
            self._held = _Prepared(agent, release, timer)
            timer.start()
        seconds = time.perf_counter() - t0
        nbytes = sum(v.nbytes for v in views)
        logger.info("peer join prepared before the offer: agent %s, %d tensors (%d bytes) registered in %.3f s%s",
                    agent.name, len(views), nbytes, seconds, " (the held agent kept)" if held is not None else "")
        return {"seconds": seconds, "tensors": len(views), "bytes": nbytes, "reused": held is not None, "regions": len(agent.slots)}

    def take(self, into: Mapping[str, torch.Tensor]) -> Taken:
        """The held agent for a pull landing in `into` (it owns it from now on: it closes it), the
        regions of `into` it had not registered registered now; Taken(None) when none is held."""
        with self._locked():
            held, self._held = self._held, None
        if held is None:
            return Taken(None)
        held.timer.cancel()
        try:
            views = _landing(into)
            late = len(_uncovered(held.agent, views))
            register_uncovered(held.agent, views)
        except BaseException:
            _close(held)
            raise
        return Taken(held.agent, len(views) - late, late)

    def release(self) -> bool:
        """Close a held prepare (deregistering everything it registered), or an agent started for
        one; whether one was held."""
        with self._locked():
            held, self._held = self._held, None
            starting, self._starting = self._starting, None
        if starting is not None:  # waited for (UCX's start, ~1.4 s, once) and closed
            with contextlib.suppress(Exception):
                starting.result(timeout=_LOCK_S).close()
        if held is None:
            return False
        held.timer.cancel()
        _close(held)
        return True

    def _expire(self, agent: NixlAgent) -> None:
        """Its deadline passed with no pull and no release (a controller that died): let it go."""
        with self._locked():
            held = self._held
            if held is None or held.agent is not agent:
                return
            self._held = None
        logger.warning("a peer join's prepared agent %s was not taken before its deadline: released", agent.name)
        _close(held)


def _uncovered(agent: NixlAgent, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t for t in tensors if not agent.covers(t.data_ptr(), t.nbytes)]


def register_uncovered(agent: NixlAgent, tensors: list[torch.Tensor]) -> None:
    """Register the memory regions holding those of `tensors` (contiguous, non-empty) no
    registration of `agent` covers (`regions.py`: one region for a staging slab; on CUDA a segment
    for many tensors)."""
    missing = _uncovered(agent, tensors)
    if missing:
        regions = regions_of([tensor_bytes(t) for t in missing])
        agent.register_regions(regions.spans, regions.device)


def _close(held: _Prepared) -> None:
    _let_go(held.agent, held.on_release)


def _let_go(agent: NixlAgent | None, release: Callable[[], None] | None) -> None:
    """Deregister and close `agent`, then `release` what its engine allocated for it."""
    try:
        if agent is not None:
            agent.close()
    finally:
        if release is not None:
            release()


def _chain(first: Callable[[], None] | None, second: Callable[[], None] | None) -> Callable[[], None] | None:
    if first is None or second is None:
        return first or second

    def both() -> None:
        try:
            first()
        finally:
            second()

    return both
