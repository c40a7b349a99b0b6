"""Elastic fleets (issue 43 item 2) on the CPU box over UCX, with reference receivers in their own
processes: an engine restarted mid-job rejoins from a serving peer with one-sided NIXL reads, bit
for bit, while the trainer syncs other engines, and serves only once it holds the version; a peer
killed mid-pull makes the joiner fail over to another peer, or (none left) stay out of service
until the trainer's next sync seeds it; a sync landing in the peer mid-pull is refused by the
checksums and the joiner fails over; bad input is refused by name with nothing lost: a peer
asked for (or forging) a version it does not hold, wrong memory descriptors, an offer from before
the peer restarted. Kills land while the joiner is held between two read windows (`load_gate.py`),
so no test races the box's speed; every wait is bounded."""

from __future__ import annotations

import dataclasses
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch

from ckpt_engine import CheckpointEngineConfig, WeightSyncSession
from ckpt_engine.control.wire import RpcError
from ckpt_engine.elastic import PeerJoinError, join_from_peer
from ckpt_engine.elastic.join import pull_offer
from ckpt_engine.elastic.offer import OfferTable, PeerOffer
from ckpt_engine.rollout_adapters.torch_ref import TorchRefRollout, write_spec_file
from ckpt_engine.sources.base import StateDictSource
from ckpt_engine.transports.nixl_agent import load_nixl
from refengines import holds, spawn_engine
from roundtrip import mixed_state


def nixl_missing() -> str:
    """Why NIXL cannot load here ('' when it can): the skip reason, install line included."""
    try:
        load_nixl()
    except ImportError as exc:
        return f"{exc} (scripts/setup.sh installs it)"
    return ""


pytestmark = pytest.mark.skipif(bool(nixl_missing()), reason=nixl_missing())

CFG = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.25, timeout_s=30)
NUM_SMALL = 40


def sd(seed: int) -> dict[str, torch.Tensor]:
    return mixed_state(seed, num_small=NUM_SMALL)


@pytest.fixture(scope="module")
def spec_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("elastic") / "spec.msgpack"
    write_spec_file(path, StateDictSource(sd(0)).metadata())
    return str(path)


@pytest.fixture
def fleet(spec_file: str) -> Iterator[list[TorchRefRollout]]:
    """Two serving peers at version 1 (state 1), synced by a trainer session that is then closed."""
    peers = [spawn_engine(f"peer{i}", spec_file=spec_file, timeout_s=30) for i in range(2)]
    try:
        sync(peers, 1)
        yield peers
    finally:
        for p in peers:
            p.close()


def sync(engines: list[TorchRefRollout], seed: int) -> int:
    session = WeightSyncSession(engines, CFG)
    try:
        return session.sync(StateDictSource(sd(seed))).version
    finally:
        session.close()


def serving_at(engine: TorchRefRollout) -> tuple[int | None, bool, bool, Any]:
    h = engine.health()
    return h["version"], h["paused"], h["stale"], h["version_from"]


def while_held(joiner: TorchRefRollout, hold: Path, run: Callable[[], Any], act: Callable[[], None]) -> tuple[Any, BaseException | None]:
    """Run `run` (a join) in a thread; once the joiner is held between two read windows, `act`,
    then release the hold. Returns run's result or its exception."""
    out: list[Any] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            out.append(run())
        except BaseException as exc:
            errors.append(exc)

    hold.touch()
    t = threading.Thread(target=target)
    t.start()
    try:
        deadline = time.monotonic() + 60
        while not joiner.health()["held"]:
            assert time.monotonic() < deadline and t.is_alive(), ("the joiner never reached its hold", errors)
            time.sleep(0.005)
        act()
    finally:
        hold.unlink()
        t.join(90)
    assert not t.is_alive(), "the join hung"
    return (out[0] if out else None), (errors[0] if errors else None)


def test_a_restarted_engine_rejoins_from_a_peer_bit_exact_while_the_trainer_syncs_on(fleet: list[TorchRefRollout], spec_file: str, tmp_path: Path) -> None:
    """A fleet of three at version 2: the third restarts (a fresh process holding zeros), pulls
    version 2 from peer0 while a trainer session syncs version 3 into peer1 (nobody paused for the
    join: peer0 serves through it), serves only once it holds version 2 bit for bit, and the
    trainer's next sync over all three counts it and seeds it like the others (version 4)."""
    third = spawn_engine("third", spec_file=spec_file, timeout_s=30)
    assert sync([*fleet, third], 1) == 2  # the fleet of three serves version 2 (state 1)
    third.process.send_signal(signal.SIGKILL)
    third.process.wait(30)
    third.close()
    hold = tmp_path / "hold"
    third = spawn_engine("third", spec_file=spec_file, timeout_s=30, hold_file=str(hold))
    try:
        assert serving_at(third)[0] is None
        seen: dict[str, Any] = {}

        def meanwhile() -> None:
            seen["third"] = third.health()
            seen["peer0"] = serving_at(fleet[0])
            seen["v2"] = sync([fleet[1]], 2)  # the trainer is not paused by the join

        report, error = while_held(third, hold, lambda: join_from_peer(third, fleet, timeout_s=30), meanwhile)
        assert error is None, error
        assert seen["third"]["version"] is None and seen["third"]["paused"] and seen["third"]["stale"]  # out of service mid-pull
        assert seen["peer0"] == (2, False, False, "trainer sync") and seen["v2"] == 3
        assert (report.engine, report.version, report.peer, report.failed) == ("third", 2, "peer0", {})
        assert report.bytes == sum(t.numel() * t.element_size() for t in sd(1).values()) and report.gbps > 0
        assert holds(third, sd(1)) == []
        assert serving_at(third) == (2, False, False, "peer pull from peer0")
        session = WeightSyncSession([*fleet, third], CFG)
        try:
            assert session.sync(StateDictSource(sd(3))).version == 4  # one past what any engine holds
        finally:
            session.close()
        for e in [*fleet, third]:
            assert holds(e, sd(3)) == [] and serving_at(e) == (4, False, False, "trainer sync")
    finally:
        third.close()


def join_killing_peer0(fleet: list[TorchRefRollout], spec_file: str, tmp_path: Path, peers: int) -> tuple[TorchRefRollout, Any, BaseException | None]:
    """A fresh joiner joins from the first `peers` of the fleet; peer0 is SIGKILLed mid-pull."""
    hold = tmp_path / "hold"
    joiner = spawn_engine("joiner", spec_file=spec_file, timeout_s=30, hold_file=str(hold))

    def kill_peer0() -> None:
        fleet[0].process.send_signal(signal.SIGKILL)
        fleet[0].process.wait(30)

    try:
        return (joiner, *while_held(joiner, hold, lambda: join_from_peer(joiner, fleet[:peers], timeout_s=20), kill_peer0))
    except BaseException:
        joiner.close()
        raise


def test_a_peer_killed_mid_pull_makes_the_joiner_fail_over_to_another_peer(fleet: list[TorchRefRollout], spec_file: str, tmp_path: Path) -> None:
    joiner, report, error = join_killing_peer0(fleet, spec_file, tmp_path, 2)
    try:
        assert error is None, error
        assert report.peer == "peer1" and set(report.failed) == {"peer0"}, report
        assert holds(joiner, sd(1)) == [] and serving_at(joiner) == (1, False, False, "peer pull from peer1")
    finally:
        joiner.close()


def test_a_peer_frozen_mid_pull_does_not_stop_the_join(fleet: list[TorchRefRollout], spec_file: str, tmp_path: Path) -> None:
    """peer0 SIGSTOPped while the joiner is held between two read windows. Where UCX reads the
    peer's memory without its CPU (its default transports on the CPU box), the join completes from
    peer0 anyway; where a read needs the peer's worker (run with UCX_TLS=tcp,self), it gives up at
    its bound (timeout_s) and the joiner fails over to peer1. Either way it holds version 1 exactly, and the frozen peer's
    offer close is bounded."""
    hold = tmp_path / "hold"
    joiner = spawn_engine("joiner", spec_file=spec_file, timeout_s=60, hold_file=str(hold))
    try:
        report, error = while_held(joiner, hold, lambda: join_from_peer(joiner, fleet, timeout_s=10), lambda: fleet[0].process.send_signal(signal.SIGSTOP))
        assert error is None, error
        assert report.peer == "peer0" or "did not finish within 10" in report.failed["peer0"], report
        assert holds(joiner, sd(1)) == [] and serving_at(joiner) == (1, False, False, f"peer pull from {report.peer}")
    finally:
        fleet[0].process.send_signal(signal.SIGCONT)
        joiner.close()


def test_with_no_peer_left_the_joiner_serves_nothing_until_the_next_sync_seeds_it(fleet: list[TorchRefRollout], spec_file: str, tmp_path: Path) -> None:
    joiner, _, error = join_killing_peer0(fleet, spec_file, tmp_path, 1)
    try:
        assert isinstance(error, PeerJoinError) and set(error.failed) == {"peer0"}, error
        assert "peer0" in str(error) and "joiner" in str(error)
        h = joiner.health()
        assert h["version"] is None and h["stale"] and h["paused"]  # nothing half-new is served
        assert sync([fleet[1], joiner], 4) == 2
        assert holds(joiner, sd(4)) == [] and serving_at(joiner) == (2, False, False, "trainer sync")
    finally:
        joiner.close()


def test_a_sync_landing_in_the_peer_mid_pull_is_refused_by_checksum_and_the_joiner_fails_over(fleet: list[TorchRefRollout], spec_file: str, tmp_path: Path) -> None:
    """While the joiner is held between two read windows, the trainer syncs version 2 into peer0:
    the rest of what the joiner reads from peer0 is version 2's, which the checksums of version 1
    refuse; it fails over to peer1 (still version 1) and holds version 1 exactly."""
    hold = tmp_path / "hold"
    joiner = spawn_engine("joiner", spec_file=spec_file, timeout_s=30, hold_file=str(hold))
    try:
        report, error = while_held(joiner, hold, lambda: join_from_peer(joiner, fleet, timeout_s=20), lambda: sync(fleet[:1], 5) and None)
        assert error is None, error
        assert report.peer == "peer1" and "do not match the checksums it advertised for version 1" in report.failed["peer0"], report
        assert holds(joiner, sd(1)) == [] and serving_at(joiner) == (1, False, False, "peer pull from peer1")
        assert holds(fleet[0], sd(5)) == [] and serving_at(fleet[0]) == (2, False, False, "trainer sync")
    finally:
        joiner.close()


def _offer(peer: TorchRefRollout, version: int = 1) -> bytes:
    return peer.peer_offer(version, 30)


def _altered(raw: bytes, change: Callable[[dict[str, Any]], None]) -> bytes:
    """The offer with its head (a map) changed by `change`."""
    d = msgpack.unpackb(raw, raw=False)
    change(d)
    return msgpack.packb(d, use_bin_type=True)


def _forged(raw: bytes, change: Callable[[OfferTable, list[list[int]]], None]) -> bytes:
    """The offer with its table's columns and its regions ([address, bytes] each) changed in place
    by `change`, encoded as a peer would (nothing checked: what a forger or a bug would send)."""
    o = PeerOffer.decode(raw, "peer0")
    t = o.tensors
    table = OfferTable(list(t.names), list(t.dtypes), list(t.shapes), list(t.region), list(t.offset), list(t.nbytes), list(t.checksum))
    regions = [list(r) for r in o.regions]
    change(table, regions)
    return dataclasses.replace(o, regions=tuple((a, n) for a, n in regions), tensors=table).encode()


def _cut_column(key: str) -> Callable[[dict[str, Any]], None]:
    """A change of an offer's head: one column of its table a byte short (a truncated or bad offer)."""

    def cut(d: dict[str, Any]) -> None:
        table = msgpack.unpackb(d["table"], raw=False)
        table[key] = table[key][:-1]
        d["table"] = msgpack.packb(table, use_bin_type=True)

    return cut


def test_a_peer_asked_for_or_forging_a_version_it_does_not_hold_is_refused_by_name(fleet: list[TorchRefRollout], spec_file: str) -> None:
    joiner = spawn_engine("joiner", spec_file=spec_file, timeout_s=30)
    try:
        with pytest.raises(RpcError, match="this engine holds version 1, not version 2: it cannot offer it"):
            _offer(fleet[0], 2)
        with pytest.raises(PeerJoinError, match="peer0: serves version 1, not 2"):
            join_from_peer(joiner, fleet, version=2, timeout_s=20)
        forged = _altered(_offer(fleet[0]), lambda d: d.update(version=2))
        with pytest.raises(RpcError, match="differs from what this peer made"):
            pull_offer(joiner, fleet[0], forged, 20)
        with pytest.raises(RpcError, match="peer 'peer0' offers version 2, but this engine was asked to pull version 1"):
            joiner.pull_from_peer(forged, 1, "peer0", 20)
        assert serving_at(joiner)[:3] == (None, False, False) and serving_at(fleet[0]) == (1, False, False, "trainer sync")
        assert join_from_peer(joiner, fleet, timeout_s=20).version == 1 and holds(joiner, sd(1)) == []
    finally:
        joiner.close()


def test_wrong_memory_descriptors_are_refused_by_name_and_nothing_is_lost(fleet: list[TorchRefRollout], spec_file: str) -> None:
    joiner = spawn_engine("joiner", spec_file=spec_file, timeout_s=30)
    try:
        assert join_from_peer(joiner, fleet[:1], timeout_s=20).version == 1
        peer = fleet[0]
        raw = _offer(peer)

        def shrink(t: OfferTable, regions: list[list[int]]) -> None:
            t.nbytes[0] -= 4

        with pytest.raises(RpcError, match="memory descriptors do not match what this engine holds"):
            joiner.pull_from_peer(_forged(raw, shrink), 1, "peer0", 20)
        with pytest.raises(RpcError, match="bytes at address 0x0 .a wrong memory descriptor"):
            joiner.pull_from_peer(_forged(raw, lambda t, regions: regions[0].__setitem__(0, 0)), 1, "peer0", 20)

        def past_the_end(t: OfferTable, regions: list[list[int]]) -> None:  # a tensor described past the end of its region
            i = next(i for i, n in enumerate(t.nbytes) if n)
            t.offset[i] = regions[t.region[i]][1] - t.nbytes[i] + 1

        with pytest.raises(RpcError, match="bytes at offset [0-9]+ lie outside region [0-9]+ of [0-9]+ bytes .a wrong memory descriptor"):
            joiner.pull_from_peer(_forged(raw, past_the_end), 1, "peer0", 20)
        with pytest.raises(RpcError, match="lie outside region 99999 of the offer's [0-9]+ .a wrong memory descriptor"):
            joiner.pull_from_peer(_forged(raw, lambda t, regions: t.region.__setitem__(0, 99999)), 1, "peer0", 20)
        with pytest.raises(RpcError, match="column 'offset' must be [0-9]+ <i8 values as bytes"):
            joiner.pull_from_peer(_altered(raw, _cut_column("offset")), 1, "peer0", 20)
        assert serving_at(joiner) == (1, False, False, "peer pull from peer0") and holds(joiner, sd(1)) == []  # nothing touched

        def swap_addresses(t: OfferTable, regions: list[list[int]]) -> None:  # two tensors of one size, each pointed at the other's (region, offset)
            n = len(t)
            i, j = next((i, j) for i in range(n) for j in range(i + 1, n) if t.nbytes[i] == t.nbytes[j] and t.checksum[i] != t.checksum[j])
            t.region[i], t.region[j], t.offset[i], t.offset[j] = t.region[j], t.region[i], t.offset[j], t.offset[i]

        with pytest.raises(RpcError, match="do not match the checksums it advertised"):
            joiner.pull_from_peer(_forged(raw, swap_addresses), 1, "peer0", 20)
        h = joiner.health()
        assert h["version"] is None and h["stale"] and h["paused"]  # read, refused: out of service, never half-new
        peer.peer_done(msgpack.unpackb(raw, raw=False)["offer_id"])
        assert serving_at(peer) == (1, False, False, "trainer sync") and holds(peer, sd(1)) == []  # the peer lost nothing
        assert join_from_peer(joiner, fleet, timeout_s=20).peer == "peer0" and holds(joiner, sd(1)) == []
    finally:
        joiner.close()


def test_an_offer_from_before_the_peer_restarted_is_refused_as_a_stale_registration(fleet: list[TorchRefRollout], spec_file: str) -> None:
    joiner = spawn_engine("joiner", spec_file=spec_file, timeout_s=30)
    old = fleet[0]
    raw = _offer(old)
    port = old.rpc.port
    old.process.send_signal(signal.SIGKILL)
    old.process.wait(30)
    old.close()
    fleet[0] = spawn_engine("peer0", spec_file=spec_file, timeout_s=30, token=old.token, port=port)
    try:
        sync(fleet[:1], 1)
        with pytest.raises(RpcError, match="a stale registration: offer 1 was made by peer process"):
            pull_offer(joiner, fleet[0], raw, 20)
        assert serving_at(joiner)[:3] == (None, False, False)
        assert join_from_peer(joiner, fleet, timeout_s=20).version == 1 and holds(joiner, sd(1)) == []  # both peers: version 1
    finally:
        joiner.close()
