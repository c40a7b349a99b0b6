"""The late joiner's prepare (issue 43, time to serve): a joiner makes its NIXL agent and registers
the tensors its pull lands in before the peer's offer comes (`elastic/prepared.py`), and the pull
then reads with that agent. On the CPU box over UCX, in one process (a `PeerSource` over named
tensors serves the reads, as a peer does) and with reference receivers in their own processes: the
pull reads with the prepared agent and lands the peer's bytes exactly; a tensor whose storage or
shape the prepare did not know is registered at the pull, or the offer is refused by name before
anything is read; a prepare no pull takes is released (at the join's end, by a call, at its
deadline) with nothing left registered; `join_from_peer` runs the joiner's prepare beside the
peer's offer: a test handle's gate holds the peer's offer until the joiner's prepare has returned
(a join that prepared only after the offer would never pass it), with no timing."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from ckpt_engine.control.wire import RpcError
from ckpt_engine.elastic import PeerJoinError, join_from_peer
from ckpt_engine.elastic.offer import OfferHead, PeerOffer
from ckpt_engine.elastic.peer_source import AHEAD_ENV, PeerSource, ahead_from_env
from ckpt_engine.elastic.prepared import JoinPrep
from ckpt_engine.elastic.pull import read_checked
from ckpt_engine.elastic.service import PeerService
from ckpt_engine.rollout_adapters.torch_ref import TorchRefRollout
from ckpt_engine.sources.base import StateDictSource
from refengines import holds, spawn_engine
from roundtrip import same_bits
from test_elastic_join import nixl_missing, sd, sync

pytestmark = pytest.mark.skipif(bool(nixl_missing()), reason=nixl_missing())

WAIT_S = 60.0
"""The bound on each wait of a test (a gate, an event)."""


@dataclass
class Held:
    """A serving peer's held tensors (`elastic.host.Offered`), in this process."""

    tensors: dict[str, torch.Tensor]
    version: int | None = 1
    stale: bool = False
    receiving: bool = False


@dataclass
class Local:
    """A peer serving `state` from this process, and a joiner's empty tensors of the same specs."""

    peer: Held
    source: PeerSource
    into: dict[str, torch.Tensor]
    offers: list[int] = field(default_factory=list)

    def offer(self) -> PeerOffer:
        offer = PeerOffer.decode(self.source.offer(1, WAIT_S), "peer")
        self.offers.append(offer.offer_id)
        return offer


@pytest.fixture
def local() -> Iterator[Local]:
    state = {n: t.contiguous() for n, t in sd(7).items()}
    peer = Held(state)
    source = PeerSource(peer)
    try:
        yield Local(peer, source, {n: torch.zeros_like(t) for n, t in state.items()})
    finally:
        source.close()


def _exact(into: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    return [n for n, t in want.items() if not same_bits(into[n], t)]


def _no_hold() -> None:
    """No hold between read windows."""


def test_a_prepared_pull_reads_with_the_prepared_agent_exactly(local: Local) -> None:
    prep = JoinPrep()
    info = prep.prepare(local.into, WAIT_S)
    nonempty = sum(1 for t in local.into.values() if t.numel())
    assert (info["tensors"], info["reused"]) == (nonempty, False) and prep.held
    nbytes, phases, prepared = read_checked(local.into, local.offer(), "peer", WAIT_S, _no_hold, prep)
    assert prepared == {"used": True, "early": nonempty, "late": 0}
    assert not prep.held and set(phases) == {"connect", "read", "check"}  # the pull took it (and closed it)
    assert nbytes == sum(t.nbytes for t in local.peer.tensors.values()) and _exact(local.into, local.peer.tensors) == []


def test_what_the_prepare_did_not_know_is_registered_at_the_pull(local: Local) -> None:
    """New storage for one tensor after the prepare (a sync that reallocated, or a vLLM staging
    slot made again in another shape): registered at the pull, read exactly; a prepare asked again
    keeps its agent and registers only what it lacks."""
    prep = JoinPrep()
    prep.prepare(local.into, WAIT_S)
    name = next(n for n, t in local.into.items() if t.numel())
    moved = {**local.into, name: torch.zeros_like(local.into[name])}
    again = prep.prepare(moved, WAIT_S)
    assert again["reused"]
    other = next(n for n, t in local.into.items() if t.numel() and n != name)
    moved2 = {**moved, other: torch.zeros_like(local.into[other])}
    _, _, prepared = read_checked(moved2, local.offer(), "peer", WAIT_S, _no_hold, prep)
    assert (prepared["used"], prepared["late"]) == (True, 1)
    assert _exact(moved2, local.peer.tensors) == []


def test_an_offer_whose_shapes_disagree_is_refused_by_name_and_the_prepare_released(local: Local) -> None:
    """A joiner prepared in its own shapes; an offer describing a tensor in another shape is refused
    by name before anything is read (`PeerOffer.check_for`, as every pull checks), and the prepare
    no pull took is released: nothing left registered, what it allocated freed."""
    name = next(n for n, t in local.into.items() if t.dim() == 2 and t.shape[0] != t.shape[1])
    mine = {**local.into, name: torch.zeros(tuple(reversed(local.into[name].shape)), dtype=local.into[name].dtype)}
    released = threading.Event()
    prep = JoinPrep()
    prep.prepare(mine, WAIT_S, on_release=released.set)
    agent = prep._held.agent if prep._held is not None else None  # the test looks at what it registered
    assert agent is not None and agent.registrations == 1
    with pytest.raises(ValueError, match=f"memory descriptors do not match what this engine holds .1 tensor.s..: {name}: offered"):
        local.offer().check_for(1, mine)
    assert prep.release() and released.is_set() and agent.registrations == 0 and agent.agent is None
    assert not prep.release()


def test_a_prepare_never_taken_lapses_at_its_deadline(local: Local) -> None:
    released = threading.Event()
    prep = JoinPrep()
    prep.prepare(local.into, 0.2, on_release=released.set)
    assert released.wait(WAIT_S) and not prep.held  # its deadline passed: released, no call needed


def test_a_failed_prepare_leaves_nothing_and_frees_what_it_allocated(local: Local) -> None:
    released = threading.Event()
    prep = JoinPrep()
    strided = {"w": torch.zeros(4, 6)[:, ::2]}  # not contiguous: a read could not land in it
    with pytest.raises(ValueError, match=r"contiguous tensors only; w has shape \[4, 3\]"):  # named
        prep.prepare(strided, WAIT_S, on_release=released.set)
    assert not prep.held and released.is_set()  # what its engine allocated for it is freed
    released.clear()
    prep.prepare(local.into, WAIT_S, on_release=released.set)
    agent = prep._held.agent if prep._held is not None else None
    with pytest.raises(ValueError, match="contiguous"):
        prep.prepare({**local.into, **strided}, WAIT_S)
    assert not prep.held and released.is_set()  # the held one went with the failure: nothing registered
    assert agent is not None and agent.registrations == 0


def test_an_agent_started_beside_the_callers_work_is_the_one_the_prepare_registers_with(local: Local) -> None:
    """A vLLM worker starts the agent on a thread, then records its loaders' copies beside it: the
    prepare takes that agent (no second one made), and the pull reads exactly with it."""
    prep = JoinPrep()
    prep.start_agent()
    starting = prep._starting  # the test looks at which agent the prepare took
    assert starting is not None
    prep.start_agent()  # one starts at most
    assert prep._starting is starting
    prep.prepare(local.into, WAIT_S)
    assert prep._starting is None and prep._held is not None and prep._held.agent is starting.result(WAIT_S)
    _, _, prepared = read_checked(local.into, local.offer(), "peer", WAIT_S, _no_hold, prep)
    assert prepared["used"] and _exact(local.into, local.peer.tensors) == []


def test_an_agent_started_for_a_prepare_that_never_came_is_closed_at_release() -> None:
    """The loaders' dry run failed after the agent was started: the release closes the agent (once
    made), and a later prepare makes a fresh one."""
    prep = JoinPrep()
    prep.start_agent()
    starting = prep._starting
    assert starting is not None
    assert not prep.release()  # no prepare was held
    assert starting.result(0).agent is None and prep._starting is None  # made, then closed


# --- reference receivers in their own processes, through join_from_peer --------------------------

@pytest.fixture
def peer0(spec_file: str) -> Iterator[TorchRefRollout]:
    peer = spawn_engine("peer0", spec_file=spec_file, timeout_s=30)
    try:
        sync([peer], 1)
        yield peer
    finally:
        peer.close()


@pytest.fixture
def spec_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    from ckpt_engine.rollout_adapters.torch_ref import write_spec_file

    path = tmp_path_factory.mktemp("prepare") / "spec.msgpack"
    write_spec_file(path, StateDictSource(sd(0)).metadata())
    return str(path)


def _gate_offer(peer: TorchRefRollout, joiner: TorchRefRollout, events: list[str], offer: Callable[[bytes], bytes] = lambda raw: raw) -> None:
    """Test handles: the joiner's prepare says when it returned; the peer's offer waits (at most
    WAIT_S) until it has, then says when it returned (`offer` may alter what it returns)."""
    prepared = threading.Event()
    make_offer, prepare = peer.peer_offer, joiner.peer_prepare

    def gated_offer(version: int, timeout_s: float) -> bytes:
        if not prepared.wait(WAIT_S):
            raise TimeoutError("the joiner's prepare never returned while the peer's offer waited")
        raw = offer(make_offer(version, timeout_s))
        events.append("peer offered")
        return raw

    def told_prepare(keep_s: float, timeout_s: float) -> dict[str, Any]:
        out = prepare(keep_s, timeout_s)
        events.append("joiner prepared")
        prepared.set()
        return out

    peer.peer_offer, joiner.peer_prepare = gated_offer, told_prepare  # type: ignore[method-assign]


def test_the_join_prepares_the_joiner_beside_the_peers_offer(peer0: TorchRefRollout, spec_file: str) -> None:
    joiner = spawn_engine("joiner", spec_file=spec_file, timeout_s=30)
    try:
        events: list[str] = []
        _gate_offer(peer0, joiner, events)
        report = join_from_peer(joiner, [peer0], timeout_s=30)
        assert events == ["joiner prepared", "peer offered"]  # the offer returned only once the joiner was prepared
        nonempty = sum(1 for t in sd(1).values() if t.numel())
        assert (report.prepare["used"], report.prepare["early"], report.prepare["late"]) == (True, nonempty, 0), report.prepare
        assert report.phases["prepare"] > 0 and report.phases["prepare_wait"] >= 0 and {"connect", "read", "check"} <= set(report.phases)
        assert holds(joiner, sd(1)) == [] and joiner.health()["version_from"] == "peer pull from peer0"
        assert joiner.peer_rpc("peer_unprepare") is False  # the pull took it: nothing held
    finally:
        joiner.close()


def test_a_prepare_whose_offer_is_refused_is_released_and_the_joiner_can_join_again(peer0: TorchRefRollout, spec_file: str) -> None:
    """The peer's offer, altered on its way (another shape for one tensor), is refused by the
    peer's check by name; the join fails naming it, the joiner's prepare is released at the join's
    end (nothing held, nothing read into it), and the joiner joins and syncs as before."""
    joiner = spawn_engine("joiner", spec_file=spec_file, timeout_s=30)
    try:
        def reshape(raw: bytes) -> bytes:
            o = PeerOffer.decode(raw, "peer0")
            t = o.tensors
            shapes = list(t.shapes)
            i = next(i for i, s in enumerate(shapes) if len(s) == 2 and s[0] != s[1])
            shapes[i] = shapes[i][::-1]
            return dataclasses.replace(o, tensors=dataclasses.replace(t, shapes=shapes)).encode()

        events: list[str] = []
        make_offer, prepare = peer0.peer_offer, joiner.peer_prepare
        _gate_offer(peer0, joiner, events, reshape)
        with pytest.raises(PeerJoinError, match="peer0: .*differs from what this peer made"):
            join_from_peer(joiner, [peer0], timeout_s=30)
        assert events == ["joiner prepared", "peer offered"]
        assert joiner.peer_rpc("peer_unprepare") is False  # released at the join's end
        h = joiner.health()
        assert (h["version"], h["paused"], h["stale"], h["receiving"]) == (None, False, False, False)
        # Asked directly, the joiner refuses an offer in other shapes by name, before reading, and
        # its prepare stays for a release (the pull did not take it).
        joiner.peer_prepare(60.0, 30.0)
        raw = make_offer(1, 30.0)
        try:
            with pytest.raises(RpcError, match="memory descriptors do not match what this engine holds .1 tensor.s..: "):
                joiner.pull_from_peer(reshape(raw), 1, "peer0", 30.0)
        finally:
            peer0.peer_done(PeerOffer.decode(raw, "peer0").offer_id)
        assert joiner.peer_rpc("peer_unprepare") is True and joiner.peer_rpc("peer_unprepare") is False
        assert joiner.health()["version"] is None
        peer0.peer_offer, joiner.peer_prepare = make_offer, prepare  # type: ignore[method-assign]
        assert join_from_peer(joiner, [peer0], timeout_s=30).prepare["used"] and holds(joiner, sd(1)) == []
        assert sync([peer0, joiner], 2) == 2 and holds(joiner, sd(2)) == []  # a sync takes it as any engine
    finally:
        joiner.close()


def test_a_peer_made_ahead_offers_its_version_without_making_anything_and_a_joiner_reads_it_exactly(local: Local) -> None:
    """With `ahead`, a peer that newly holds a version makes its agent, registrations and table
    (checksums) on a thread (`ready_ahead`): the first offer takes them as made (the same agent),
    and a joiner reads it bit for bit. A sync that lands later is taken ahead again: the next
    offer carries the new bytes' checksums, and a joiner reads those exactly."""
    ahead = PeerSource(local.peer, ahead=True)
    try:
        assert not ahead.ready
        ahead.ready_ahead()
        assert ahead.ahead_done(WAIT_S) and ahead.ready
        raw = ahead.offer(1, WAIT_S)
        made = OfferHead.decode(raw, "peer").agent
        offer = PeerOffer.decode(raw, "peer")
        assert offer.tensors.checksum == PeerOffer.decode(local.source.offer(1, WAIT_S), "peer").tensors.checksum
        read_checked(local.into, offer, "peer", WAIT_S, _no_hold)
        assert _exact(local.into, local.peer.tensors) == []
        ahead.done(offer.offer_id)

        for n, t in sd(8).items():  # a sync lands in place at version 2
            local.peer.tensors[n].copy_(t)
        local.peer.version = 2
        ahead.generation += 1
        assert not ahead.ready
        ahead.ready_ahead()
        assert ahead.ahead_done(WAIT_S) and ahead.ready
        offer = PeerOffer.decode(ahead.offer(2, WAIT_S), "peer")
        assert offer.agent == made  # the same storage: the same agent and registrations
        read_checked(local.into, offer, "peer", WAIT_S, _no_hold)
        assert _exact(local.into, local.peer.tensors) == [] and _exact(local.into, sd(8)) == []
    finally:
        ahead.close()
    assert not ahead.ready and ahead.ahead_done(0.0)


def test_a_peer_made_ahead_while_it_holds_no_version_makes_nothing_and_closes_at_once(local: Local) -> None:
    local.peer.stale = True  # a sync failed part-way: nothing to offer
    ahead = PeerSource(local.peer, ahead=True)
    ahead.ready_ahead()
    assert ahead.ahead_done(WAIT_S) and not ahead.ready
    ahead.close()
    off = PeerSource(local.peer, ahead=False)  # without it (the default) nothing is made ahead
    off.ready_ahead()
    assert off.ahead_done(0.0) and not off.ready
    off.close()


def test_the_ahead_switch_is_read_from_the_environment_and_a_bad_value_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(AHEAD_ENV, raising=False)
    assert not ahead_from_env()
    for on in ("1", "true", " On "):
        monkeypatch.setenv(AHEAD_ENV, on)
        assert ahead_from_env() and PeerSource(Held({}), ahead=None).ahead
    monkeypatch.setenv(AHEAD_ENV, "0")
    assert not ahead_from_env()
    monkeypatch.setenv(AHEAD_ENV, "soon")
    with pytest.raises(ValueError, match=f"{AHEAD_ENV} must be 1, on, true, yes or 0, off, false, no; got 'soon'"):
        PeerSource(Held({}))


def test_an_engine_with_the_switch_on_makes_its_agent_ahead_once_a_sync_installs(local: Local, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine side (`PeerService`, as the reference receiver's worker holds it): with
    CKPT_ENGINE_PEER_AHEAD=1 a trainer sync's install (`synced`) readies the offer; without it,
    nothing is made until an offer."""
    monkeypatch.setenv(AHEAD_ENV, "1")
    on = PeerService(local.peer, lambda what: contextlib.nullcontext(), _no_hold)  # type: ignore[arg-type]
    monkeypatch.delenv(AHEAD_ENV)
    off = PeerService(local.peer, lambda what: contextlib.nullcontext(), _no_hold)  # type: ignore[arg-type]
    try:
        on.synced()
        off.synced()
        assert on.source.ahead_done(WAIT_S) and on.source.ready and not off.source.ready
        offer = PeerOffer.decode(on.source.offer(1, WAIT_S), "peer")
        read_checked(local.into, offer, "peer", WAIT_S, _no_hold)
        assert _exact(local.into, local.peer.tensors) == []
    finally:
        on.source.close()
        off.source.close()
