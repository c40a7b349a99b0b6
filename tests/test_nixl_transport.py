"""The one-sided pull transport (`backend: nixl`, issue 43) over UCX on the CPU box: dense syncs into
reference receivers in their own processes land bit for bit (one and two engines, with and without
per-bucket checksums), staged syncs, receive plans (TP ranks read only their slices), two trainer
ranks each offering their own pieces, the rate guardrail (a floor no link reaches warns or fails the
sync, naming the link), and bad input refused by name: a malformed or mismatched slot offer, a
sender announcing a bucket at another slot, a missing package (with the install line)."""

from __future__ import annotations

import datetime
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch

from ckpt_engine import CheckpointEngineConfig, SyncError, WeightSyncSession
from ckpt_engine.delta.request import DeltaRequest
from ckpt_engine.engine import Rendezvous, TransferError
from ckpt_engine.pipeline.engine import PipelinedEngine
from ckpt_engine.planning.receive_sets import cut_region
from ckpt_engine.registry import BackendUnavailableError, CheckpointEngineRegistry
from ckpt_engine.rollout_adapters.torch_ref import TorchRefRollout, write_spec_file
from ckpt_engine.sources.base import StateDictSource
from ckpt_engine.transports.nixl_agent import load_nixl
from multisender import shard_rank
from ranks import run_ranks
from helpers_procs import fork_program
from refengines import holds, serving, spawn_engine, spawn_with_timeout, state
from regionranks import KV_HEADS, qwen2_specs, weights
from roundtrip import mixed_state, same_bits
from ckpt_engine.store import serve_store

try:
    load_nixl()
    HAVE_NIXL, WHY = True, ""
except ImportError as exc:
    HAVE_NIXL, WHY = False, f"{exc} (scripts/setup.sh installs it)"
pytestmark = pytest.mark.skipif(not HAVE_NIXL, reason=WHY)

if HAVE_NIXL:
    import ckpt_engine.transports.nixl as nixl_mod
    from ckpt_engine.transports.nixl import NixlOptions, NixlTransport
    from ckpt_engine.transports.nixl_agent import NixlAgent, SlotOffer

    class _CorruptingNixl(PipelinedEngine):
        """The nixl engine whose sender flips one bit of bucket 1 after its checksum was written."""

        name, device_type, supports_many_senders = NixlTransport.name, NixlTransport.device_type, NixlTransport.supports_many_senders

        def __init__(self, **kwargs: Any) -> None:
            super().__init__(NixlTransport, **kwargs)

        def _tamper_hook(self, bucket_index: int, message: torch.Tensor) -> None:
            if bucket_index == 1 and message.numel() > 64:
                message[48] ^= 0x04

    class _Misannouncing(NixlTransport):
        """A sender that announces every bucket at the other slot (a wrong memory descriptor)."""

        def post(self, gid: int, slot: int, msg: torch.Tensor) -> Any:
            return super().post(gid, slot, msg) if slot else self._lie(msg)

        def _lie(self, msg: torch.Tensor) -> Any:
            assert self.rank is not None
            self.device_sync_point()
            ordinal = self._sent
            self._sent += 1
            self._store.set(self._key("ready", self.rank, ordinal), msgpack.packb([1, 0, msg.numel()]))
            return ordinal

    CFG = CheckpointEngineConfig(backend="nixl", bucket_size_mb=0.0625, timeout_s=30)


def assert_holds(engine: TorchRefRollout, sd: dict[str, torch.Tensor], names: list[str] | None = None) -> None:
    for name in names if names is not None else list(sd):
        assert same_bits(engine.get_tensor(name), sd[name]), f"{engine.name}: {name} differs"


@pytest.fixture(scope="module")
def spec_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("nixl") / "spec.msgpack"
    write_spec_file(path, StateDictSource(mixed_state(0, num_small=300)).metadata())
    return str(path)


@pytest.fixture(scope="module")
def engines(spec_file: str) -> Iterator[list[TorchRefRollout]]:
    rs = [spawn_engine(f"pull{i}", spec_file=spec_file, timeout_s=60) for i in range(2)]
    yield rs
    for r in rs:
        r.close()


def test_dense_syncs_land_bit_exact_and_reuse_the_group(engines: list[TorchRefRollout]) -> None:
    session = WeightSyncSession(engines, CFG)
    try:
        sd0 = mixed_state(0, num_small=300)
        report = session.sync(StateDictSource(sd0), version=3)
        assert (report.version, report.tensors, report.engines) == (3, len(sd0), 2) and report.buckets > 1
        assert report.staged == "full" and report.stall_s <= report.seconds["swap"]  # staged: streamed while serving, paused inside the swap only
        for e in engines:
            assert_holds(e, sd0)
            h = e.health()
            assert (h["version"], h["paused"], h["stale"]) == (3, False, False)
        assert set(report.engine_gbps) == {"pull0", "pull1"} and all(v > 0 for v in report.engine_gbps.values())
        group_engine = session._group.engine
        sd1 = mixed_state(1, num_small=300)
        report = session.sync(StateDictSource(sd1))
        assert report.version == 4 and session._group.engine is group_engine  # same agents, same registered slots
        for e in engines:
            assert_holds(e, sd1)
    finally:
        session.close()


def test_checked_unstaged_syncs_land_and_a_corrupt_bucket_is_named(engines: list[TorchRefRollout]) -> None:
    cfg = CheckpointEngineConfig(backend="nixl", bucket_size_mb=0.0625, timeout_s=30, verify=True, stage="off")
    session = WeightSyncSession(engines, cfg)
    try:
        sd = mixed_state(2, num_small=300)
        report = session.sync(StateDictSource(sd))
        assert report.staged == "off"
        for e in engines:
            assert_holds(e, sd)
    finally:
        session.close()
    bad = _CorruptingNixl(bucket_size_bytes=cfg.bucket_size_bytes, verify=True, timeout_s=30)
    session = WeightSyncSession(engines[:1], cfg, engine=bad)
    try:
        with pytest.raises(SyncError, match=r"pull0: .*bucket 1 failed its checksum") as info:
            session.sync(StateDictSource(mixed_state(3, num_small=300)))
        assert info.value.stage == "transfer" and info.value.stale == ["pull0"]
        assert engines[0].health()["stale"] is True
        session.sync(StateDictSource(sd))  # a new group, the bucket no longer corrupt: the engine serves again
    finally:
        session.close()
    bad.finalize()
    assert_holds(engines[0], sd)
    assert engines[0].health()["stale"] is False


def test_tp_ranks_read_only_their_slices(tmp_path_factory: pytest.TempPathFactory) -> None:
    path = tmp_path_factory.mktemp("nixl-regions") / "qwen2.msgpack"
    specs = qwen2_specs()
    write_spec_file(path, specs)
    model = sum(s.nbytes for s in specs)
    layouts = [{"tp_size": 2, "tp_rank": r, "num_kv_heads": KV_HEADS} for r in range(2)]
    rs = [spawn_engine(f"tp{r}", spec_file=str(path), timeout_s=60, layout=lay) for r, lay in enumerate(layouts)]
    rs.append(spawn_engine("whole", spec_file=str(path), timeout_s=60))
    session = WeightSyncSession(rs, CFG)
    try:
        for v in range(2):
            w = weights(specs, v)
            report = session.sync(StateDictSource(w))
            for e in rs:
                (plan,) = e.receive_plans()
                holds = plan.holds if plan is not None else dict.fromkeys(w)
                for name, regions in holds.items():
                    want = cut_region(w[name], regions[0] if regions is not None else None)
                    assert same_bits(e.get_tensor(name), want.contiguous()), (e.name, name)
        got = report.received_bytes
        assert got["whole"] == [model] and all(got[f"tp{r}"][0] <= 0.55 * model for r in range(2)), got
    finally:
        session.close()
        for e in rs:
            e.close()


def test_the_rate_floor_warns_naming_the_link_or_fails_the_sync(spec_file: str, tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    r = spawn_engine("slowlink", spec_file=spec_file, timeout_s=60, stderr_path=str(log))
    sd = mixed_state(4, num_small=300)
    try:
        warn = CheckpointEngineConfig(backend="nixl", bucket_size_mb=0.0625, timeout_s=30, engine_kwargs={"nixl": {"min_gbps": 1e6}})
        session = WeightSyncSession([r], warn)
        try:
            report = session.sync(StateDictSource(sd))  # no link here reaches a petabyte a second: warned, not failed
            assert report.engine_gbps["slowlink"] > 0
        finally:
            session.close()
        assert_holds(r, sd)
        text = log.read_text()
        assert "nixl pull from sender 0 (agent ckpt-r0-" in text and "below the floor min_gbps=1e+06" in text, text[-2000:]
        fail = CheckpointEngineConfig(
            backend="nixl", bucket_size_mb=0.0625, timeout_s=30, stage="off", engine_kwargs={"nixl": {"min_gbps": 1e6, "on_slow": "error"}},
        )
        session = WeightSyncSession([r], fail)
        try:
            with pytest.raises(SyncError, match=r"slowlink: .*nixl pull from sender 0 .*below the floor .*on_slow: error"):
                session.sync(StateDictSource(mixed_state(5, num_small=300)))
            assert r.health()["stale"] is True
        finally:
            session.close()
    finally:
        r.close()


def test_nixl_options_are_checked_when_the_config_is_loaded() -> None:
    with pytest.raises(ValueError, match="min_gbps must be a positive number"):
        CheckpointEngineConfig(backend="nixl", engine_kwargs={"nixl": {"min_gbps": 0}})
    with pytest.raises(ValueError, match="on_slow must be one of warn, error"):
        CheckpointEngineConfig(backend="nixl", engine_kwargs={"nixl": {"on_slow": "ignore"}})
    with pytest.raises(ValueError, match="the nixl backend does not do delta syncs"):
        PipelinedEngine(NixlTransport, bucket_size_bytes=1 << 16)._ready(DeltaRequest.__new__(DeltaRequest), "send_weights", sender=True)


def _offer(**change: Any) -> bytes:
    d: dict[str, Any] = {"agent": "ckpt-r0-abc", "metadata": b"md", "memory": "DRAM", "device_id": 0, "slots": [[4096, 128], [8192, 128]]}
    d.update(change)
    return msgpack.packb(d, use_bin_type=True)


@pytest.mark.parametrize(
    "raw, match",
    [
        (b"\xc1", "is not msgpack"),
        (msgpack.packb({"agent": "a"}), "must be a map of agent, metadata"),
        (_offer(metadata=b""), "no agent name or no agent metadata"),
        (_offer(memory="HBM"), "names memory 'HBM'"),
        (_offer(slots=[[4096, 128]]), "describes 1 slots, this plan needs 2"),
        (_offer(slots=[[4096, 128], [8192, 64]]), "slot 1 holds 64 bytes, this plan's slots hold 128"),
        (_offer(slots=[[0, 128], [8192, 128]]), "slot 0 must be"),
    ],
)
def test_a_bad_slot_offer_is_refused_by_name(raw: bytes, match: str) -> None:
    with pytest.raises(ValueError, match=f"the nixl offer of sender 1 .*{match}|the nixl offer of sender 1.*{match}"):
        SlotOffer.decode(raw, sender=1, num_slots=2, slot_bytes=128)


def _pair(store_port: int, sender_cls: type[NixlTransport], errors: dict[int, BaseException], **opts: Any) -> tuple[NixlTransport, NixlTransport]:
    """A sender and a receiver transport in this process (two NIXL agents over UCX), joined."""
    rdzv = Rendezvous("127.0.0.1", store_port, "t" + str(store_port), 2, "nixl", 20.0)
    made = [sender_cls(NixlOptions(**opts), bucket_size_bytes=4096, num_buffers=2, timeout_s=20.0),
            NixlTransport(NixlOptions(**opts), bucket_size_bytes=4096, num_buffers=2, timeout_s=20.0)]

    def join(rank: int) -> None:
        try:
            made[rank].join(rdzv, rank)
        except BaseException as exc:
            errors[rank] = exc

    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return made[0], made[1]


def test_a_bucket_announced_at_another_slot_is_refused_and_stops_the_sender() -> None:
    master = serve_store("127.0.0.1", 300)
    errors: dict[int, BaseException] = {}
    sender, receiver = _pair(master.port, _Misannouncing, errors)
    assert errors == {}
    try:
        sender.begin_send([0])
        receiver.begin_receive()
        msg = sender.buffers[0][:1000]
        msg.fill_(7)
        ordinal = sender.post(0, 0, msg)
        with pytest.raises(TransferError, match=r"sender 0 announced its bucket 0 at slot 1, offset 0, 1000 bytes; this receiver's plan reads slot 0"):
            receiver.post(0, 0, receiver.buffers[0][:1000])
        receiver.abort()
        with pytest.raises(TransferError, match=r"rank 0: the receivers' reads of bucket 0 stopped: rank 1 aborted"):
            sender.drain_slots([ordinal, None])
    finally:
        receiver.close()
        sender.close()


def test_a_stale_offer_is_refused_at_join() -> None:
    """A receiver joining a group whose offer key holds another agent's metadata under this agent's
    name (a registration left from before a restart) is refused, and the sender learns why."""

    class Stale(NixlTransport):
        def join(self, rendezvous: Rendezvous, rank: int) -> None:
            store = rendezvous.connect_store()
            real = NixlTransport(NixlOptions(), bucket_size_bytes=4096, num_buffers=2, timeout_s=20.0)
            real.num_senders, real.rank = 1, 0
            real.prepare()
            other = NixlAgent(nixl_mod._API, "old", list(real.buffers))
            offer = other.offer()
            store.set("nixl/offer/0", SlotOffer("ckpt-r0-restarted", offer.metadata, offer.memory, offer.device_id, offer.slots).encode())
            store.wait(["nixl/joined/1"], datetime.timedelta(seconds=20))
            self.answer = store.get("nixl/joined/1")
            other.close()

    master = serve_store("127.0.0.1", 300)
    errors: dict[int, BaseException] = {}
    sender, receiver = _pair(master.port, Stale, errors)
    assert list(errors) == [1] and "names agent 'ckpt-r0-restarted' but its metadata is agent 'ckpt-old-" in str(errors[1])
    assert b"a stale registration?" in sender.answer  # type: ignore[attr-defined]
    receiver.close()


def test_a_missing_nixl_package_is_refused_by_name_with_the_install_line(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("nixl", "nixl._api", "nixl_cu12", "nixl_cu12._api", "nixl_cu13", "nixl_cu13._api"):
        monkeypatch.setitem(sys.modules, name, None)  # an import of a None entry raises ImportError
    monkeypatch.delitem(sys.modules, "ckpt_engine.transports.nixl")
    monkeypatch.setattr(CheckpointEngineRegistry, "_classes", {k: v for k, v in CheckpointEngineRegistry._classes.items() if k != "nixl"})
    monkeypatch.setattr(CheckpointEngineRegistry, "_failed", {})
    with pytest.raises(BackendUnavailableError, match=r"backend 'nixl' could not be loaded .*needs the `nixl` package.*install it: pip install nixl-cu12"):
        CheckpointEngineRegistry.get("nixl")


def test_delta_on_is_refused_by_name_and_delta_auto_syncs_dense(engines: list[TorchRefRollout]) -> None:
    on = WeightSyncSession(engines, CheckpointEngineConfig(backend="nixl", bucket_size_mb=0.0625, timeout_s=30, delta="on"))
    try:
        with pytest.raises(ValueError, match="delta=on, but the nixl backend does not send patches; use delta=auto or off"):
            on.sync(StateDictSource(mixed_state(6, num_small=300)))
    finally:
        on.close()
    auto = WeightSyncSession(engines, CheckpointEngineConfig(backend="nixl", bucket_size_mb=0.0625, timeout_s=30, delta="auto"))
    try:
        for v in (6, 7):
            sd = mixed_state(v, num_small=300)
            report = auto.sync(StateDictSource(sd))
            assert report.delta == "off" and report.wire_bytes == report.bytes
            for e in engines:
                assert_holds(e, sd)
                assert e.health()["paused"] is False
    finally:
        auto.close()


@pytest.mark.parametrize("verify", [True, False])
def test_two_senders_each_offer_their_rows_and_two_receivers_pull_them_bit_exact(verify: bool) -> None:
    """Two trainer ranks, each registering its own slots and packing its dim-0 row block of every
    tensor; two receivers each read from both and reassemble three versions bit for bit."""
    results = run_ranks(shard_rank, 4, backend="nixl", num_senders=2, engine_kwargs={"verify": verify})
    for r in results[2:]:
        assert r["bad"] == [] and r["errors"] == []
    sent = [sum(s["bytes"] for s in r["stats"]) for r in results[:2]]
    assert min(sent) > 0.5 * max(sent), sent


def test_a_receiver_killed_mid_pull_fails_the_sync_by_name_and_nobody_serves_half_new(engines: list[TorchRefRollout], spec_file: str, tmp_path: Path) -> None:
    """The victim's first load waits on a hold file (load_gate.py), so the kill lands mid-stream on
    any box; the sender, waiting for the victim's reads, fails within its timeout and names it;
    the survivors are left paused and stale, and the next sync without the victim heals them."""
    timeout_s = 3.0
    cfg = CheckpointEngineConfig(backend="nixl", bucket_size_mb=0.0625, timeout_s=timeout_s, stage="off")
    hold = tmp_path / "hold"
    victim = spawn_with_timeout(spec_file, "victim", timeout_s, 0.02, None, str(hold))
    sd0, sd1 = mixed_state(20, num_small=300), mixed_state(21, num_small=300)
    try:
        session = WeightSyncSession([*engines, victim], cfg)
        errors: list[BaseException] = []
        try:
            session.sync(StateDictSource(sd0))
            hold.touch()

            def run() -> None:
                try:
                    session.sync(StateDictSource(sd1))
                except BaseException as exc:
                    errors.append(exc)

            t = threading.Thread(target=run)
            t.start()
            deadline = time.monotonic() + 30
            while not victim.health()["held"]:
                assert time.monotonic() < deadline and t.is_alive(), ("the sync never reached the victim", errors)
                time.sleep(0.005)
            victim.process.send_signal(signal.SIGKILL)
            hold.unlink()
            t.join(60)
            assert not t.is_alive(), "the sender hung"
        finally:
            session.close()
        assert len(errors) == 1 and isinstance(errors[0], SyncError), errors
        assert set(errors[0].failed) == {"victim"} and "died" in errors[0].failed["victim"], errors[0]
        for e in engines:
            h = e.health()
            assert h["paused"] or h["stale"], (e.name, h)  # never serving a half-new state
    finally:
        victim.close()
    heal = WeightSyncSession(engines, cfg)
    try:
        heal.sync(StateDictSource(sd1))
    finally:
        heal.close()
    for e in engines:
        assert_holds(e, sd1)
        assert e.health()["stale"] is False


def test_bench_runs_the_pull_transport_and_refuses_broadcast_modes_by_name() -> None:
    bad = subprocess.run(
        [sys.executable, "-m", "ckpt_engine.cli", "bench", "--preset", "tiny", "--backend", "nixl", "--device", "cpu", "--modes", "raw,ours"],
        capture_output=True, text=True, timeout=120,
    )
    assert bad.returncode == 2 and "--modes raw: the nixl backend has no process group to broadcast on" in bad.stderr, bad.stderr[-2000:]
    out = subprocess.run(
        [sys.executable, "-m", "ckpt_engine.cli", "bench", "--preset", "tiny", "--backend", "nixl", "--device", "cpu", "--iters", "1", "--json", "-"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads(out.stdout)
    assert set(summary["modes"]) == {"ours"} and summary["correct"] is True


def test_a_sender_killed_mid_pull_leaves_no_engine_serving_half_new(tmp_path: Path) -> None:
    """A trainer process SIGKILLed while its receivers read its slots: each engine's receive fails
    (a read against a dead agent, or no announcement within timeout_s), every engine is left stale
    and paused, never serving a half-new state, and a new trainer's sync heals them bit for bit.
    The kill comes while an engine's bucket load is held (load_gate.py), so it is mid-pull whatever
    the box's speed (a count of received buckets raced a fast sync to its end)."""
    timeout_s = 3.0
    spec, hold = tmp_path / "spec.msgpack", tmp_path / "hold"
    write_spec_file(spec, StateDictSource(state(0)).metadata())
    pair = [spawn_with_timeout(str(spec), f"k{i}", timeout_s, 0.0, None, str(hold)) for i in range(2)]
    cfg = CheckpointEngineConfig(backend="nixl", bucket_size_mb=0.0625, timeout_s=timeout_s, stage="off")
    try:
        first = WeightSyncSession(pair, cfg)
        try:
            first.sync(StateDictSource(state(1)))
        finally:
            first.close()
        job = {
            "engines": [{"name": e.name, "host": e.rpc.host, "port": e.rpc.port, "token": e.token} for e in pair],
            "seeds": [2], "timeout_s": timeout_s, "backend": "nixl",
        }
        hold.touch()
        trainer = fork_program("_fault_sender:main", [json.dumps(job)], "fault-sender").process
        try:
            deadline = time.monotonic() + 60
            while not pair[0].health()["held"]:
                assert time.monotonic() < deadline and trainer.poll() is None, "the sync never reached k0's loads"
                time.sleep(0.005)
            trainer.send_signal(signal.SIGKILL)
        finally:
            trainer.kill()
            trainer.wait(10)
            hold.unlink()
        deadline = time.monotonic() + 60
        while not all(e.health()["stale"] for e in pair):
            assert time.monotonic() < deadline, [e.health() for e in pair]
            time.sleep(0.01)
        assert not any(serving(e.health()) for e in pair), "an engine serves a half-written version"
        healed = False
        while not healed:  # the engines' receives may still be running out their timeout
            heal = WeightSyncSession(pair, cfg)
            try:
                heal.sync(StateDictSource(state(3)))
                healed = True
            except SyncError:
                assert time.monotonic() < deadline, "the engines never took a sync again"
                time.sleep(0.2)
            finally:
                heal.close()
        for e in pair:
            assert holds(e, state(3)) == [] and serving(e.health()), e.name
    finally:
        for e in pair:
            e.close()


def test_a_receiver_posts_every_announced_read_before_the_pipeline_finishes_it() -> None:
    """Bucket 1's read is posted while the receiver finishes bucket 0, not when the pipeline comes
    to finish bucket 1: on NVLink or RDMA the link then carries bucket 1 while the loader copies
    bucket 0 (the 2xH200 run lost ~2 ms a bucket to that gap). Both land bit for bit."""
    master = serve_store("127.0.0.1", 300)
    errors: dict[int, BaseException] = {}
    sender, receiver = _pair(master.port, NixlTransport, errors)
    assert errors == {}
    try:
        sender.begin_send([0, 1])
        receiver.begin_receive()
        reads = [receiver.post(0, slot, receiver.buffers[slot][:1000]) for slot in (0, 1)]
        assert [r.req for r in reads] == [None, None]  # nothing announced yet
        for slot, value in ((0, 3), (1, 5)):
            msg = sender.buffers[slot][:1000]
            msg.fill_(value)
            assert sender.post(0, slot, msg) == slot
        drained: list[BaseException] = []
        drain = threading.Thread(target=lambda: _catch(drained, sender.drain_slots, [0, 1]))
        drain.start()  # the sender progresses its agent while it waits for the reads
        receiver.finish(0, 0, 0, reads[0], "0")
        assert reads[1].req is not None  # posted by finish(0)
        receiver.finish(1, 0, 1, reads[1], "1")
        drain.join(30)
        assert not drain.is_alive() and drained == []
        assert bool((receiver.buffers[0][:1000] == 3).all()) and bool((receiver.buffers[1][:1000] == 5).all())
    finally:
        receiver.close()
        sender.close()


def _catch(errors: list[BaseException], fn: Any, *args: Any) -> None:
    try:
        fn(*args)
    except BaseException as exc:
        errors.append(exc)
