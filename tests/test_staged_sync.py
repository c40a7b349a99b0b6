"""Staged syncs (issue 28) into reference engines that keep stepping: the next version streams into
a staging area while every engine step reads the live weights; the engines pause only for the swap.

Each engine step (`rollout_adapters/torch_ref/steps.py`) records the version it served and a digest of
every weight it read, so the tests prove that no step ever saw a mix of two versions, that steps
went on while a version streamed in, and that a failed stream leaves the engine serving its old
version bit for bit, unpaused and not stale.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ckpt_engine import CheckpointEngineConfig, SyncError, WeightSyncSession
from ckpt_engine.delta.request import DeltaRequest
from ckpt_engine.rollout_adapters.torch_ref.steps import weights_digest
from ckpt_engine.rollout_adapters.torch_ref import TorchRefRollout, write_spec_file
from ckpt_engine.sources.base import StateDictSource
from ckpt_engine.sync.staging import StagePolicy
from multisender import model_state, wire
from refengines import BrokenSource, holds, source, spawn_engine, state

CFG = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.0625, timeout_s=30, delta="on", stage="auto")
STEP_S = 0.005


def version(v: int, lr: float = 1e-5) -> dict[str, torch.Tensor]:
    return wire(model_state(v, lr=lr))


@pytest.fixture(scope="module")
def spec_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("staged") / "spec.msgpack"
    write_spec_file(path, StateDictSource(version(0)).metadata())
    return str(path)


@pytest.fixture(scope="module")
def stepping(spec_file: str) -> Iterator[TorchRefRollout]:
    engine = spawn_engine("stepping", spec_file=spec_file, timeout_s=60, step_interval_s=STEP_S)
    yield engine
    engine.close()


def _check_steps(engine: TorchRefRollout, since: int, digests: dict[int | None, str]) -> list[tuple]:
    """Every step from `since` on served exactly one known version, whole: its digest is that
    version's (no step saw a mix). Returns the steps."""
    steps = engine.steps(since)
    for index, _start, _end, v, digest in steps:
        assert v in digests, f"step {index} served version {v}, which was never synced"
        assert digest == digests[v], f"step {index} read a mix of versions (it claimed v{v})"
    return steps


class StepGatedSource(StateDictSource):
    """Yields half its tensors, then waits (bounded) until the engine has taken another step, then
    the rest: a step during the stream is certain however fast or loaded the box, unless the
    engine stops stepping while a version streams in, which is what the test checks."""

    def __init__(self, weights: dict[str, torch.Tensor], engine: TorchRefRollout) -> None:
        super().__init__(weights)
        self.engine = engine

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        items = list(self.weights.items())
        yield from items[: len(items) // 2]
        mark, deadline = self.engine.health()["steps"], time.monotonic() + 60.0
        while self.engine.health()["steps"] <= mark:
            if time.monotonic() > deadline:
                raise RuntimeError("the engine took no step in 60 s while the version streamed in")
            time.sleep(0.005)
        yield from items[len(items) // 2 :]


def test_staged_delta_and_dense_syncs_while_the_engine_steps(stepping: TorchRefRollout) -> None:
    """A seed, five patch syncs, a seed again (full_sync_every): each lands staged (`full` for the
    dense ones, `patches` for the others) while the engine steps; after each swap the engine holds
    the trainer's weights bit for bit, steps ran during every stream, and the stall is reported."""
    cfg = dataclasses.replace(CFG, full_sync_every=6)
    session = WeightSyncSession([stepping], cfg)
    digests: dict[int | None, str] = {stepping.held_version(): weights_digest({n: stepping.get_tensor(n) for n in version(0)})}
    try:
        staged, kinds = [], []
        for v in range(7):
            sd = version(v)
            since = stepping.health()["steps"]
            t0 = time.monotonic()
            report = session.sync(StepGatedSource(sd, stepping))
            digests[report.version] = weights_digest(sd)
            staged.append(report.staged)
            kinds.append(report.delta)
            assert holds(stepping, sd) == []
            assert 0 < report.stall_s <= report.seconds["swap"], report.seconds  # the pause lies inside the swap step
            steps = _check_steps(stepping, since, digests)
            during = [s for s in steps if t0 <= s[1] and s[3] != report.version]
            assert during, "no engine step ran while the version streamed in"
        assert kinds == ["seed"] + ["patch"] * 5 + ["seed"]
        assert staged == ["full"] + ["patches"] * 5 + ["full"]
        # a step begun after the last sync returned serves the newest version (waited for, not slept:
        # a loaded box may take no step in any fixed number of step intervals)
        after = stepping.health()["steps"] + 1
        _wait("a step after the last sync", lambda: len(stepping.steps(after)) > 0, 60)
        _check_steps(stepping, 0, digests)
        assert stepping.steps(after)[0][3] == report.version
    finally:
        session.close()


def test_no_room_for_a_staging_copy_pauses_dense_syncs_as_today_and_says_so_once(
    spec_file: str, caplog: pytest.LogCaptureFixture
) -> None:
    """An engine with no room for a dense staging copy: `auto` pauses for dense syncs (said once
    per session), still stages patches, stays exact; `full` is refused before anything pauses."""
    engine = spawn_engine("cramped", spec_file=spec_file, timeout_s=60, staging_budget_bytes=0, step_interval_s=STEP_S)
    session = WeightSyncSession([engine], dataclasses.replace(CFG, full_sync_every=3))
    try:
        with caplog.at_level(logging.WARNING, logger="ckpt_engine.sync.staging"):
            staged = []
            for v in range(4):
                sd = version(20 + v)
                report = session.sync(StateDictSource(sd))
                staged.append((report.delta, report.staged))
                assert holds(engine, sd) == []
                assert report.stall_s > 0
        assert staged == [("seed", "off"), ("patch", "patches"), ("patch", "patches"), ("seed", "off")]
        said = [r.getMessage() for r in caplog.records if "no room for a dense staging copy" in r.getMessage()]
        assert len(said) == 1 and "engine(s) cramped" in said[0] and "pause" in said[0], said
        held = engine.held_version()
        with pytest.raises(ValueError, match="checkpoint_engine.stage=full: engine\\(s\\) cramped report no room .*nothing was paused or sent"):
            WeightSyncSession([engine], dataclasses.replace(CFG, delta="off", stage="full")).sync(StateDictSource(version(30)))
        h = engine.health()
        assert (h["paused"], h["stale"], h["version"]) == (False, False, held)
        assert holds(engine, sd) == []
    finally:
        session.close()
        engine.close()


def _wait(what: str, cond, timeout_s: float) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _line(proc: subprocess.Popen[str], timeout_s: float) -> str:
    """The next line `proc` prints (stripped); fails the test after `timeout_s`."""
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(proc.stdout.readline() if proc.stdout else ""), daemon=True)
    reader.start()
    reader.join(timeout_s)
    assert got, f"no line from the trainer within {timeout_s}s"
    return got[0].strip()


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TorchRefRollout]:
    """A stepping engine of `refengines.state` tensors (what tests/_fault_sender.py sends)."""
    path = tmp_path_factory.mktemp("mixed") / "spec.msgpack"
    write_spec_file(path, source(0).metadata())
    engine = spawn_engine("mixed", spec_file=str(path), timeout_s=60, step_interval_s=STEP_S)
    yield engine
    engine.close()


@pytest.mark.parametrize("delta", ["off", "on"])
def test_a_sender_killed_mid_stream_leaves_the_engine_serving_its_old_version(mixed: TorchRefRollout, delta: str) -> None:
    """The trainer (its own process) is SIGKILLed while a staged sync streams (a dense one into the
    staging copy, or a patch sync after a seed): the engine never paused (its steps went on), holds
    the old version bit for bit, is not stale, and the next sync heals it."""
    tests_dir = str(Path(__file__).parent)
    seeds = [41, 42] if delta == "on" else [42]
    if delta == "off":
        session = WeightSyncSession([mixed], dataclasses.replace(CFG, delta="off"))
        try:
            session.sync(source(41))
        finally:
            session.close()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests_dir, os.environ.get("PYTHONPATH", "")])}
    trainer = subprocess.Popen([sys.executable, "-m", "_fault_sender"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=tests_dir, env=env)
    try:
        assert trainer.stdin is not None and trainer.stdout is not None
        job = {"engines": [{"name": mixed.name, "host": mixed.rpc.host, "port": mixed.rpc.port, "token": mixed.token}],
               "seeds": seeds, "timeout_s": 60, "delay_s": 0.0, "stage": "auto", "delta": delta, "hold_midway": True}
        trainer.stdin.write(json.dumps(job) + "\n")
        trainer.stdin.flush()
        if delta == "on":  # the seed completes; the patch sync is the one killed
            assert _line(trainer, 60).startswith("synced")
        base = mixed.held_version()
        before = mixed.health()
        # The trainer's source stops after half its tensors until told to go on (never, here): the
        # stream cannot finish, so what follows is mid-stream on any box.
        assert _line(trainer, 60) == "midway"
        # A dense sync counts the buckets it staged; a patch sync's health shows no count while it streams.
        landed = (lambda h: h["buckets_received"] > before["buckets_received"]) if delta == "off" else (lambda h: True)
        _wait("the engine receiving the new version", lambda: (h := mixed.health())["receiving"] and landed(h), 60)
        mark = mixed.health()["steps"]
        _wait("engine steps while the version streams in", lambda: mixed.health()["steps"] >= mark + 3, 60)
        h = mixed.health()
        assert h["receiving"] and not h["paused"], h  # still mid-stream, and serving
        trainer.send_signal(signal.SIGKILL)
    finally:
        trainer.kill()
        trainer.wait(10)
    old = state(41)
    _wait("the engine's receive ended", lambda: not mixed.health()["receiving"], 90)  # past the 60 s timeout
    h = mixed.health()
    assert (h["paused"], h["stale"], h["version"], h["staged"]) == (False, False, base, False), h
    assert holds(mixed, old) == []
    _check_steps(mixed, before["steps"], {base: weights_digest(old)})  # every step, those mid-stream too, served the old version whole
    session = WeightSyncSession([mixed], dataclasses.replace(CFG, delta=delta))
    try:
        sd = state(43)
        report = session.sync(StateDictSource(sd))
        assert report.version > base and report.delta in ("off", "seed") and report.staged == "full"
        assert holds(mixed, sd) == []
    finally:
        session.close()


def test_syncs_with_receive_plans_stage_only_where_every_engine_stages_plans(caplog: pytest.LogCaptureFixture) -> None:
    """Staging a sync with receive plans is each engine's own capability (`capabilities.stages_regions`), not a
    global off: a group with an engine that cannot (SGLang, vLLM's native backend) pauses such syncs, said once per
    session; the same group stages syncs without plans, and the reference receiver alone stages both."""

    class NoPlanStaging(TorchRefRollout):
        capabilities = dataclasses.replace(TorchRefRollout.capabilities, stages_regions=False)  # an engine that cannot stage plans

    ref = TorchRefRollout("ref", "127.0.0.1", 1, None, 1.0, token="t" * 16)  # never called: the policy reads capabilities
    other = NoPlanStaging("other", "127.0.0.1", 1, None, 1.0, token="t" * 16)
    patch = DeltaRequest(True, 1, 2)

    def no_room_asked(ask: object) -> dict[str, bool]:
        raise AssertionError("a patch sync asks no engine for room")

    policy = StagePolicy("auto")
    with caplog.at_level(logging.WARNING, logger="ckpt_engine.sync.staging"):
        assert policy.choose([ref], patch, {}, no_room_asked, regions=True) == "patches"
        for _ in range(2):
            assert policy.choose([ref, other], patch, {}, no_room_asked, regions=True) is None
        assert policy.choose([ref, other], patch, {}, no_room_asked) == "patches"
    said = [r.getMessage() for r in caplog.records if "receive plans" in r.getMessage()]
    assert said == ["checkpoint_engine.stage=auto: engine(s) other cannot stage a sync with receive plans; such syncs pause for the whole transfer"]
    assert StagePolicy("off").choose([ref], patch, {}, no_room_asked, regions=True) is None


class _FinalizeFails(TorchRefRollout):
    """An engine handle whose finalize fails (as a dead engine's would) before reaching the engine."""

    def finalize(self, version: int) -> None:
        raise RuntimeError("finalize refused")


def test_a_failed_finalize_says_which_engines_hold_the_new_version_paused(spec_file: str) -> None:
    """Unstaged: one engine finalized (it holds the new version whole, still paused), the other's
    finalize failed (paused, stale): the error says each, as the engines' own health does."""
    engines = [spawn_engine("finalizes", spec_file=spec_file, timeout_s=60), spawn_engine("refuses", spec_file=spec_file, timeout_s=60, handle=_FinalizeFails)]
    session = WeightSyncSession(engines, dataclasses.replace(CFG, stage="off"))
    try:
        with pytest.raises(SyncError) as info:
            session.sync(StateDictSource(version(52)))
        assert info.value.stage == "finalize" and info.value.serving == [], str(info.value)
        assert "holding the new version, paused: finalizes; left paused and stale: refuses;" in str(info.value), str(info.value)
        done, left = (e.health() for e in engines)
        assert (done["version"], done["paused"], done["stale"]) == (1, True, False) and holds(engines[0], version(52)) == [], done
        assert (left["version"], left["paused"], left["stale"]) == (None, True, True), left
    finally:
        session.close()
        for e in engines:
            e.close()


def test_a_stream_into_an_engine_left_serving_says_it_may_serve_part_of_the_version(spec_file: str) -> None:
    """`pause_mode: none`, unstaged: the engine serves while it receives, so a failed stream may have left
    it serving part of the new version: the error says that, not "left paused"."""
    engine = spawn_engine("open", spec_file=spec_file, timeout_s=60)
    session = WeightSyncSession([engine], dataclasses.replace(CFG, stage="off", pause_mode="none"))
    try:
        with pytest.raises(SyncError, match=r"not paused while it received \(pause_mode none, .*\): it may serve part of the new version: open;"):
            session.sync(BrokenSource(version(53), fail_after=1))
        assert not engine.health()["paused"]
    finally:
        session.close()
        engine.close()


class _SwapFails(TorchRefRollout):
    """An engine handle whose swap fails (as a dead or refusing engine's would) before reaching the engine."""

    def swap(self, version: int, pause_mode: str) -> float:
        raise RuntimeError("swap refused")


def test_a_failed_swap_after_a_complete_stream_leaves_the_engines_stale_as_a_failed_finalize(spec_file: str) -> None:
    """Every engine streamed and checked its version; one swap fails: that is a failed finalize, not a
    failed stream, so every engine is listed stale (none was told to discard) and the next sync heals.
    The error says what each engine does meanwhile: the one that swapped serves the new version,
    unpaused (not "left paused"), the one whose swap never reached it its old one."""
    engines = [spawn_engine("swaps", spec_file=spec_file, timeout_s=60), spawn_engine("refuses", spec_file=spec_file, timeout_s=60, handle=_SwapFails)]
    session = WeightSyncSession(engines, CFG)
    try:
        with pytest.raises(SyncError) as info:
            session.sync(StateDictSource(version(50)))
        assert info.value.stage == "swap" and set(info.value.failed) == {"refuses"}, str(info.value)
        assert info.value.stale == ["refuses", "swaps"] and info.value.serving == ["swaps"], str(info.value)
        assert "serving the new version: swaps; not paused by this sync, still on its old version" in str(info.value), str(info.value)
        assert "paused and stale" not in str(info.value), str(info.value)
        live, old = (e.health() for e in engines)
        assert (live["version"], live["paused"], live["stale"]) == (1, False, False) and holds(engines[0], version(50)) == [], live
        assert (old["version"], old["paused"]) == (None, False), old
        engines[1].swap = types.MethodType(TorchRefRollout.swap, engines[1])  # type: ignore[method-assign]
        sd = version(51)
        report = session.sync(StateDictSource(sd))
        assert report.staged == "full" and all(holds(e, sd) == [] for e in engines)
    finally:
        session.close()
        for e in engines:
            e.close()
