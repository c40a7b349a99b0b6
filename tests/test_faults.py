"""Faults mid-sync, each repeated: receiver SIGKILL, sender SIGKILL, receiver SIGSTOP past the
timeout, and a weight source that raises.

Every time: an error naming the culprit within `TIMEOUT_S + GRACE_S`; no engine serving (unpaused
and not stale) unless it holds exactly one complete version, bit for bit; the next sync heals every
survivor bit-exactly. Reference engines in their own processes, a real gloo group, small timeouts.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt_engine import CheckpointEngineConfig, SyncError, WeightSyncSession
from ckpt_engine.rollout_adapters.torch_ref import TorchRefRollout, write_spec_file
from ckpt_engine.sync.api import SyncReport
from ckpt_engine.sync.staging import DISCARD_FLOOR_S, discard_all, failure_deadline
from ckpt_engine.sources.base import StateDictSource
from helpers_procs import fork_program
from _gate_fault_ref import fired_path
from refengines import holds, second_handle, serving, source, spawn_with_timeout, state

TIMEOUT_S = 10.0
"""Every wait of a sync (gloo's, the engines' control calls). The victim signals itself at its first
load (`_gate_fault_ref.py`), so no timer of the sync runs while the test reacts: 3 s, then 10 s,
ran out at load 9-13 on the 2-core box when the test polled for a hold and then sent the signal (a
starved test outlasted the sync's timers before its fault), and 20 s cost every SIGSTOP case about
20 s of waiting out per repeat. What runs under it before the fault is an ordinary sync of seven
64 KiB buckets (tests/test_sync.py syncs 300 tensors under 10 s). Only the SIGSTOP tests wait it
out (a dead process is seen at once). A SIGSTOP ends about timeout_s + 5 s after the fault (the
sender's own wait, then the receivers' answers and the frozen engine's probe, 5 s side by side):
17 s inside `TIMEOUT_S + GRACE_S`."""
GRACE_S = 2 * TIMEOUT_S + 2.0
"""After the fault, the sender's own wait (bounded by timeout_s) is followed by a wait for the
receivers' answers and a health probe of each engine (each bounded by timeout_s)."""
REPEAT = 3
CFG = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.0625, timeout_s=TIMEOUT_S, stage="off")  # today's order: paused for the whole sync
LOAD_DELAY_S = 0.02  # per bucket: a sync streams for a while, so the fault lands mid-stream


def spawn(
    spec_file: str, name: str, load_delay_s: float = LOAD_DELAY_S, stderr_path: str | None = None, fault_file: Path | None = None,
    timeout_s: float = TIMEOUT_S,
) -> TorchRefRollout:
    return spawn_with_timeout(spec_file, name, timeout_s, load_delay_s, stderr_path, fault_file=str(fault_file) if fault_file else None)


@pytest.fixture(scope="module")
def engine_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs") / "engines.log"


@pytest.fixture(scope="module")
def pair(spec_file: str, engine_log: Path) -> Iterator[list[TorchRefRollout]]:
    """Two engines that survive every fault below; their stderr (logs) goes to `engine_log`."""
    rs = [spawn(spec_file, f"ref{i}", stderr_path=str(engine_log)) for i in range(2)]
    yield rs
    for r in rs:
        r.close()


def check_states(engines: list[TorchRefRollout], by_version: dict[int, int]) -> None:
    """No engine serves unless it holds exactly the complete version it reports."""
    for e in engines:
        h = e.health()
        if serving(h):
            assert h["version"] in by_version, (e.name, h)
            assert holds(e, state(by_version[h["version"]])) == [], f"{e.name} serves a mix of versions"


def assert_healed(engines: list[TorchRefRollout], seed: int) -> SyncReport:
    """The next complete sync (a new session, as a restarted trainer would make) heals every engine."""
    session = WeightSyncSession(engines, CFG)
    try:
        report = session.sync(source(seed))
    finally:
        session.close()
    for e in engines:
        h = e.health()
        assert serving(h) and h["version"] == report.version, (e.name, h)
        assert holds(e, state(seed)) == [], f"{e.name} is not bit-exact after the healing sync"
    return report


def sync_in_thread(session: WeightSyncSession, src: StateDictSource) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            session.sync(src)
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=run)
    t.start()
    return t, errors


def start_faulted(session: WeightSyncSession, src: StateDictSource, fault: Path, sig: signal.Signals) -> tuple[threading.Thread, list[BaseException]]:
    """Start a sync whose first bucket load on the victim (spawned with `fault_file=fault`) sends
    the victim `sig` from itself: surely mid-stream, whatever the box's speed, and with no test
    poll between the victim's load and the fault for the sync's timers to outlast (issue 42)."""
    fired_path(fault).unlink(missing_ok=True)
    fault.write_text(sig.name)
    return sync_in_thread(session, src)


def fault_moment(fault: Path) -> float:
    """When the victim signalled itself (`time.monotonic()` on this box); it must have."""
    fired = fired_path(fault)
    assert fired.exists() and not fault.exists(), "the sync never reached the victim's first load"
    return float(fired.read_text())


def stopped(pid: int) -> bool:
    """Whether process `pid` is stopped by a signal now (state T in /proc/PID/stat)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2] == "T"


def wait_streaming(engine: TorchRefRollout, before: int) -> None:
    deadline = time.monotonic() + 20
    while engine.health()["buckets_received"] < before + 2:
        assert time.monotonic() < deadline, "the sync never started streaming"
        time.sleep(0.005)


def probed_at(engine: TorchRefRollout, at: list[float]) -> None:
    """Note the monotonic time of each of `engine`'s health calls in `at` (by this handle)."""
    health = type(engine).health

    def noted() -> dict:
        at.append(time.monotonic())
        return health(engine)

    engine.health = noted  # type: ignore[method-assign]


def test_receiver_sigkill(spec_file: str, pair: list[TorchRefRollout], tmp_path: Path) -> None:
    """A receiver killed mid-stream is named dead within the bound; the survivors keep their old
    version, are free for the next sync, and are probed once each after the failure (the probe that
    found the victim dead; the group's break does not probe them again)."""
    seed, fault_file = 100, tmp_path / "fault"
    for _ in range(REPEAT):
        victim = spawn(spec_file, "victim", fault_file=fault_file)
        probes: dict[str, list[float]] = {e.name: [] for e in pair}
        try:
            session = WeightSyncSession([*pair, victim], CFG)
            base = session.sync(source(seed)).version
            for e in pair:
                probed_at(e, probes[e.name])
            t, errors = start_faulted(session, source(seed + 1), fault_file, signal.SIGKILL)
            t.join(TIMEOUT_S + GRACE_S + 10)
            elapsed = time.monotonic() - fault_moment(fault_file)
            after = {name: sum(at > fault_moment(fault_file) for at in ats) for name, ats in probes.items()}
            assert after == {e.name: 1 for e in pair}, f"health probes of each survivor after the fault: {after}"
            assert not t.is_alive(), "the sender hung"
            assert victim.process.wait(TIMEOUT_S) == -signal.SIGKILL, "the victim did not die of its SIGKILL"
            assert len(errors) == 1 and isinstance(errors[0], SyncError), errors
            assert set(errors[0].failed) == {"victim"} and "died" in errors[0].failed["victim"], errors[0]
            assert elapsed < TIMEOUT_S + GRACE_S, f"error after {elapsed:.1f}s"
            # Free for the next sync: no survivor still waits on the failed sender's group (its
            # pending work handles kept the group's connections open: a survivor waited out timeout_s).
            assert not any(e.health()["receiving"] for e in pair), [e.health() for e in pair]
            check_states(pair, {base: seed})
            assert not any(serving(e.health()) for e in pair), "survivors hold a half-written version"
            session.close()
        finally:
            victim.close()
            for e in pair:
                vars(e).pop("health", None)  # the class's again
        seed += 2
        assert assert_healed(pair, seed).version > base


def test_receiver_sigstop_past_the_timeout(spec_file: str, pair: list[TorchRefRollout], tmp_path: Path) -> None:
    seed, fault_file = 200, tmp_path / "fault"
    victim = spawn(spec_file, "victim", fault_file=fault_file)
    engines = [*pair, victim]
    try:
        for _ in range(REPEAT):
            session = WeightSyncSession(engines, CFG)
            base = session.sync(source(seed)).version
            t, errors = start_faulted(session, source(seed + 1), fault_file, signal.SIGSTOP)
            try:
                t.join(TIMEOUT_S + GRACE_S + 10)
                elapsed = time.monotonic() - fault_moment(fault_file)
                assert not t.is_alive(), "the sender hung"
                assert stopped(victim.process.pid), "the victim is not frozen"
                assert len(errors) == 1 and isinstance(errors[0], SyncError), errors
                assert set(errors[0].failed) == {"victim"}, errors[0]
                assert elapsed < TIMEOUT_S + GRACE_S, f"error after {elapsed:.1f}s"
                check_states(pair, {base: seed})
                assert not any(serving(e.health()) for e in pair)
            finally:
                victim.process.send_signal(signal.SIGCONT)
            check_states(engines, {base: seed})  # the woken engine must not serve either
            session.close()
            seed += 2
            # Woken up, its receive has timed out: the stopped engine heals with the others.
            deadline = time.monotonic() + TIMEOUT_S + GRACE_S
            while True:
                try:
                    assert_healed(engines, seed)
                    break
                except SyncError:
                    assert time.monotonic() < deadline, "the woken engine never became usable again"
                    time.sleep(0.2)
    finally:
        victim.close()


def test_sender_sigkill(pair: list[TorchRefRollout], engine_log: Path) -> None:
    seed = 300
    engines_json = [
        {"name": e.name, "host": e.rpc.host, "port": e.rpc.port, "token": getattr(e, "token", None)} for e in pair
    ]
    failures = engine_log.read_text().count("from the sender (rank 0) failed") if engine_log.exists() else 0
    for _ in range(REPEAT):
        base = assert_healed(pair, seed).version
        before = pair[0].health()["buckets_received"]
        # A real trainer process, forked from the preloaded server (tests/ranks.py) so it streams
        # at once instead of importing torch first.
        job = {"engines": engines_json, "seeds": [seed + 1], "timeout_s": TIMEOUT_S, "delay_s": 0.05}
        trainer = fork_program("_fault_sender:main", [json.dumps(job)], "fault-sender").process
        try:
            wait_streaming(pair[0], before)
            trainer.send_signal(signal.SIGKILL)
            fault = time.monotonic()
        finally:
            trainer.kill()
            trainer.wait(10)
        # Each engine's receive fails, naming the sender, and frees the engine within the bound.
        handles = [second_handle(e) for e in pair]
        while any(h.health()["buckets_received"] == before for h in handles) or any(not h.health()["stale"] for h in handles):
            assert time.monotonic() - fault < TIMEOUT_S + GRACE_S
            time.sleep(0.01)
        check_states(pair, {base: seed})
        assert not any(serving(e.health()) for e in pair), "engines hold a half-written version"
        healed = None
        while healed is None:
            try:
                healed = assert_healed(pair, seed + 2)
            except SyncError as exc:  # the engines' receives are still running out their timeout
                assert time.monotonic() - fault < TIMEOUT_S + GRACE_S, f"engines still busy: {exc}"
                time.sleep(0.2)
        assert healed.version > base
        for h in handles:
            h.close()
        log = engine_log.read_text()
        assert log.count("from the sender (rank 0) failed") >= failures + len(pair), log[-2000:]
        failures = log.count("from the sender (rank 0) failed")
        seed += 4


class _Failing(StateDictSource):
    """A trainer whose weight export raises after a few tensors."""

    def iter_weights(self):
        for i, item in enumerate(super().iter_weights()):
            if i == 12:
                raise RuntimeError("export failed: parameter shard missing")
            yield item


def test_weight_source_raising(pair: list[TorchRefRollout]) -> None:
    seed = 400
    session = WeightSyncSession(pair, CFG)
    try:
        base = session.sync(source(seed)).version
        for _ in range(REPEAT):
            start = time.monotonic()
            with pytest.raises(SyncError, match=r"weight source: RuntimeError: export failed: parameter shard missing") as info:
                session.sync(_Failing(state(seed + 1)))
            elapsed = time.monotonic() - start
            assert set(info.value.failed) == {"weight source"}, "the engines did nothing wrong"
            assert info.value.stage == "transfer" and info.value.stale == ["ref0", "ref1"]
            assert elapsed < TIMEOUT_S + GRACE_S
            for e in pair:  # alive, reachable, not serving the half-written state
                h = e.health()
                assert h["paused"] and h["stale"], h
            check_states(pair, {base: seed})
            seed += 2
            report = session.sync(source(seed))  # the same session heals them
            assert report.version > base
            check_states(pair, {report.version: seed})
            for e in pair:
                assert serving(e.health()) and holds(e, state(seed)) == []
            base = report.version
    finally:
        session.close()


class _Amiss(StateDictSource):
    """A trainer whose walk yields, at its 12th tensor, what its metadata does not say."""

    def __init__(self, weights: dict[str, torch.Tensor], how: str) -> None:
        super().__init__(weights)
        self.how = how

    def iter_weights(self):
        for i, (name, t) in enumerate(super().iter_weights()):
            if i == 12 and self.how == "fewer":
                return
            if i == 12:
                yield (name + ".renamed", t) if self.how == "name" else (name, t.reshape(-1)[:-1])
                continue
            yield name, t


@pytest.mark.parametrize("how,words", [("shape", "its metadata says"), ("name", "where its metadata put"), ("fewer", "ended before")])
def test_a_source_yielding_what_its_metadata_does_not_say_is_blamed_not_the_engines(pair: list[TorchRefRollout], how: str, words: str) -> None:
    """The sender's check of each yielded tensor fails mid-stream: the error names the weight source
    (it named the engines the abort cut off, the cause only after them), the engines stay members,
    paused and stale on the old bytes, and the next sync heals them."""
    seed = 440 + 10 * ["shape", "name", "fewer"].index(how)
    session = WeightSyncSession(pair, CFG)
    try:
        base = session.sync(source(seed)).version
        for _ in range(REPEAT):
            with pytest.raises(SyncError) as info:
                session.sync(_Amiss(state(seed + 1), how))
            assert list(info.value.failed) == ["weight source"] and words in info.value.failed["weight source"], info.value
            assert info.value.stage == "transfer" and info.value.stale == ["ref0", "ref1"]
            check_states(pair, {base: seed})
            seed += 2
            base = session.sync(source(seed)).version
            check_states(pair, {base: seed})
            assert all(serving(e.health()) for e in pair)
    finally:
        session.close()


class _AnswerHeld(TorchRefRollout):
    """A handle whose receive answers (its report or its error) only once `release` is set: an
    engine still busy with a failed sync's receive (a vLLM worker runs one call at a time, so the
    next sync's first call to it would queue behind that receive)."""

    def __init__(self, engine: TorchRefRollout) -> None:
        super().__init__(engine.name, engine.rpc.host, engine.rpc.port, None, TIMEOUT_S, token=engine.token)
        self.held, self.release = threading.Event(), threading.Event()
        self.release.set()  # answers at once until a test clears it
        self.order: list[str] = []

    def receive(self, manifest: Any, delta: Any = None, *, stage: str | None = None) -> Any:
        try:
            return super().receive(manifest, delta, stage=stage)
        finally:
            self.held.set()
            self.release.wait(60)
            self.order.append("receive answered")


def test_a_failed_source_is_reported_only_once_every_engine_answered(pair: list[TorchRefRollout]) -> None:
    """Unstaged, the `SyncError` of a source that failed mid-walk comes only once every engine's
    receive has answered (within the bound), so no engine call of the failed sync is in flight when
    the next sync begins. Before, the error came 5 s after the fault whatever the engines still did,
    and a vLLM worker still in its receive made the next session's first call to it time out (a CI
    flake of tests/test_elastic_vllm_holds.py). The receive's answer here is held until the test has
    waited past those 5 s."""
    held = _AnswerHeld(pair[0])
    session = WeightSyncSession([held, pair[1]], CFG)
    try:
        base = session.sync(source(420)).version
        held.order.clear()
        held.held.clear()
        errors: list[BaseException] = []

        def run() -> None:
            try:
                session.sync(_Failing(state(421)))
            except BaseException as exc:
                errors.append(exc)
            held.order.append("sync raised")

        t = threading.Thread(target=run)
        held.release.clear()
        t.start()
        assert held.held.wait(60), "the failed sync's receive never ended"
        t.join(8.0)  # past the 5 s the error used to come after, whatever the engines still did
        held.release.set()
        t.join(TIMEOUT_S + GRACE_S)
        assert not t.is_alive(), "the failed sync never ended"
        assert held.order == ["receive answered", "sync raised"], held.order
        assert len(errors) == 1 and isinstance(errors[0], SyncError) and set(errors[0].failed) == {"weight source"}, errors
        check_states(pair, {base: 420})
        report = session.sync(source(422))  # the same session heals both
        check_states(pair, {report.version: 422})
        assert all(serving(e.health()) for e in pair)
    finally:
        held.release.set()
        session.close()
        held.close()


STAGED_TIMEOUT_S = 12.0
"""A failed staged sync ends about timeout_s + 5 s after the fault (the sender's own wait, then the
receivers' answers and the frozen engine's probe, 5 s side by side, then the discards: the frozen
engine's, found unreachable, waited 0.5 s): at 12 s well inside `STAGED_BOUND_S` on a loaded box,
as it was when the discards waited up to 10 s more (at 10 s or less they ran to the failure's
deadline, 1.5 s inside it)."""
STAGED_BOUND_S = 3 * STAGED_TIMEOUT_S + 2.0
STAGED = CheckpointEngineConfig(backend="gloo", bucket_size_mb=1, timeout_s=STAGED_TIMEOUT_S, stage="full")
BIG_SEEDS = 8
"""32 MB in 1 MB buckets: more than the sockets buffer once an engine stops, so the sender is
still blocked on the frozen engine when it is stopped and waits its whole timeout, as on a real
model (the small reference model fits in the socket buffers: its sender finishes at once)."""


def _big(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layer.{i}": torch.randn(1 << 20, generator=g) for i in range(BIG_SEEDS)}


def test_staged_receiver_sigstop_ends_within_the_bound(tmp_path: Path) -> None:
    """A frozen engine in a staged sync: the survivors drop what they staged and keep serving their
    old version, the frozen one is named and stale, and the whole failure (the sender's wait, the
    receivers' answers, the probe and then the discards) ends within the documented bound: the
    discards wait only for what is left of it (issue 45: they waited min(10, timeout_s) of their
    own after the rest, 4 x timeout_s in all)."""
    spec = str(tmp_path / "big.msgpack")
    write_spec_file(spec, StateDictSource(_big(0)).metadata())
    fault_file = tmp_path / "fault"
    engines = [spawn(spec, f"big{i}", 0.0, timeout_s=STAGED_TIMEOUT_S) for i in range(2)]
    engines.append(spawn(spec, "victim", 0.0, fault_file=fault_file, timeout_s=STAGED_TIMEOUT_S))
    victim, seed = engines[-1], 500
    try:
        for _ in range(REPEAT):
            session = WeightSyncSession(engines, STAGED)
            base = session.sync(StateDictSource(_big(seed))).version
            t, errors = start_faulted(session, StateDictSource(_big(seed + 1)), fault_file, signal.SIGSTOP)
            try:
                t.join(STAGED_BOUND_S + 10)
                elapsed = time.monotonic() - fault_moment(fault_file)
                assert not t.is_alive(), "the sender hung"
                assert stopped(victim.process.pid), "the victim is not frozen"
                assert len(errors) == 1 and isinstance(errors[0], SyncError), errors
                assert set(errors[0].failed) == {"victim"} and errors[0].stale == ["victim"], errors[0]
                assert elapsed < STAGED_BOUND_S, f"error after {elapsed:.1f}s"
                for e in engines[:2]:  # the survivors dropped what they staged and serve their old version
                    h = e.health()
                    assert serving(h) and h["version"] == base and holds(e, _big(seed)) == [], (e.name, h)
            finally:
                victim.process.send_signal(signal.SIGCONT)
            session.close()
            seed += 2
            deadline = time.monotonic() + STAGED_BOUND_S
            while True:  # woken, its receive times out: the stopped engine heals with the others
                healing = WeightSyncSession(engines, STAGED)
                try:
                    healing.sync(StateDictSource(_big(seed)))
                    break
                except SyncError:
                    assert time.monotonic() < deadline, "the woken engine never became usable again"
                    time.sleep(0.2)
                finally:
                    healing.close()
            assert all(holds(e, _big(seed)) == [] for e in engines)
    finally:
        for e in engines:
            e.close()


def test_the_discards_of_a_failed_staged_sync_wait_only_for_what_is_left_of_the_bound(spec_file: str, pair: list[TorchRefRollout]) -> None:
    """The discard wait comes from the failure's remaining budget, not a timeout of its own
    (min(10, timeout_s)): a frozen engine (control calls time out after 30 s) is named after the
    budget left, a live engine still discards within it, and past the deadline a discard still gets
    the floor. Asserted on the wait the code chose (the error states it), not on the wall clock."""
    frozen = spawn_with_timeout(spec_file, "frozen", 30.0)
    pool = cf.ThreadPoolExecutor(4)
    try:
        frozen.process.send_signal(signal.SIGSTOP)
        sent = time.monotonic() - 2 * TIMEOUT_S + 2.0  # the receivers' answers and the probe took all but 2 s of their timeouts
        deadline = failure_deadline(TIMEOUT_S, sent)
        assert deadline - sent < 3 * TIMEOUT_S + 2 - TIMEOUT_S, "the sender's own wait comes before `sent`"
        left = deadline - time.monotonic()
        failed = discard_all(pool, [pair[0], frozen], 30.0, deadline)
        assert set(failed) == {"frozen"} and "could not drop its staged version" in failed["frozen"], failed
        assert 0 < discard_wait(failed["frozen"]) <= max(DISCARD_FLOOR_S, round(left, 3)) < 10.0, failed  # 10 s: a wait of its own, min(10, timeout_s)
        late = discard_all(pool, [frozen], 30.0, time.monotonic() - 1.0)  # the deadline has passed
        assert set(late) == {"frozen"} and discard_wait(late["frozen"]) == DISCARD_FLOOR_S, late
        # found unreachable by the failure's probe: asked, but waited for only the floor, whatever is left
        named = discard_all(pool, [pair[0], frozen], 30.0, time.monotonic() + 20.0, unreachable={"frozen"})
        assert set(named) == {"frozen"} and discard_wait(named["frozen"]) == DISCARD_FLOOR_S, named
    finally:
        frozen.process.send_signal(signal.SIGCONT)
        frozen.close()
        pool.shutdown(wait=False)


def discard_wait(why: str) -> float:
    """The seconds a discard was waited for, as its failure says ("no answer to discard within Ns")."""
    found = re.search(r"no answer to discard within ([0-9.]+)s", why)
    assert found, why
    return float(found.group(1))
