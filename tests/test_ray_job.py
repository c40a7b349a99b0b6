"""The Ray launcher: config and placement (no Ray needed), and the reference job on a local Ray cluster.

The vLLM + FSDP2 job on a 2-node cluster is in tests/test_ray_cluster.py.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from ckpt_engine.config import ConfigError
from ckpt_engine.trainer.config import load_job_config
from ckpt_engine.trainer.ray_job import placement_bundles

START_S = 420
"""The job's bound on each start-up wait (`ray.start_timeout_s`): Ray's workers took over 180 s to
start at a load of 10-12 on two cores; quiet, the whole job takes ~25 s. The bounds end hangs only."""
JOB_S = 480
"""The job's bound on its training run (`ray.job_timeout_s`)."""
pytestmark = pytest.mark.timeout(3 * START_S + JOB_S + 60)  # past the job's own waits: a slow job fails with its own error


def test_ray_section_switch_and_bundles() -> None:
    job = load_job_config(None, ["ray.enabled=true", "ray.engine_num_cpus=0.5", "ray.trainer_num_gpus=1", "rollout.num_engines=3"])
    assert job.ray.enabled and job.ray.address is None and job.ray.placement_strategy == "PACK"
    assert placement_bundles(job) == [{"CPU": 1.0, "GPU": 1.0}] + [{"CPU": 0.5}] * 3
    assert not load_job_config(None).ray.enabled  # without the switch the job runs as local processes
    with pytest.raises(ConfigError, match="ray.placement_strategy must be one of PACK, SPREAD, STRICT_PACK, STRICT_SPREAD, got 'TIGHT'"):
        load_job_config(None, ["ray.placement_strategy=TIGHT"])
    with pytest.raises(ConfigError, match="ray.engine_num_cpus and ray.engine_num_gpus are both 0"):
        load_job_config(None, ["ray.engine_num_cpus=0"])
    with pytest.raises(ConfigError, match="ray.trainer_num_gpus must be a number >= 0, got -1"):
        load_job_config(None, ["ray.trainer_num_gpus=-1"])
    with pytest.raises(ConfigError, match="unknown key.*under ray: num_cpu"):
        load_job_config(None, ["ray.num_cpu=1"])


def test_strict_spread_shares_one_trainer_bundle_and_pins_roles() -> None:
    from ckpt_engine.trainer.ray_placement import trainer_bundle_index

    base = ["ray.enabled=true", "trainer.backend=fsdp2", "trainer.num_processes=3", "rollout.num_engines=2", "ray.trainer_num_cpus=0.5"]
    pinned = ['ray.trainer_resources={"trainer_node": 1}', 'ray.engine_resources={"engine_node": 0.5}']
    job = load_job_config(None, [*base, *pinned, "ray.placement_strategy=STRICT_SPREAD"])
    # No two bundles may share a node: the 3 ranks share one (the trainer's node), each engine has its own.
    assert placement_bundles(job) == [{"CPU": 1.5, "trainer_node": 3.0}] + [{"CPU": 1.0, "engine_node": 0.5}] * 2
    assert [trainer_bundle_index(job, r) for r in range(3)] == [0, 0, 0]
    job = load_job_config(None, [*base, "ray.placement_strategy=SPREAD"])
    assert placement_bundles(job) == [{"CPU": 0.5}] * 3 + [{"CPU": 1.0}] * 2
    assert [trainer_bundle_index(job, r) for r in range(3)] == [0, 1, 2]
    with pytest.raises(ConfigError, match="ray.engine_resources: 'CPU' is not a custom resource name"):
        load_job_config(None, ['ray.engine_resources={"CPU": 1}'])
    with pytest.raises(ConfigError, match=r"ray.trainer_resources.gpu_a must be a number > 0, got 0"):
        load_job_config(None, ['ray.trainer_resources={"gpu_a": 0}'])
    with pytest.raises(ConfigError, match="ray.engine_max_restarts must be an int >= 0, got -1"):
        load_job_config(None, ["ray.engine_max_restarts=-1"])


def test_ray_vllm_descriptor_is_validated() -> None:
    from ckpt_engine.trainer.ray_engine_client import RayVllmEngineClient, ray_vllm_factory

    adapter = ray_vllm_factory("e", {"host": "10.0.0.2", "port": 4000, "world_size": 2}, 5.0, token="t" * 16)
    assert isinstance(adapter, RayVllmEngineClient) and adapter.world_size == 2 and adapter.engine_key() == ("ray_vllm", "10.0.0.2", 4000)
    with pytest.raises(ValueError, match="unknown key.*url"):
        ray_vllm_factory("e", {"host": "h", "port": 1, "url": "x"}, 5.0, token="t" * 16)
    with pytest.raises(ValueError, match=r"port must be an int in \[1, 65535\], got 0"):
        ray_vllm_factory("e", {"host": "h", "port": 0}, 5.0, token="t" * 16)
    with pytest.raises(ValueError, match="no job token"):
        ray_vllm_factory("e", {"host": "h", "port": 1}, 5.0)


def test_the_trainer_group_port_is_listening_when_rank_0_hands_it_out() -> None:
    """Rank 0 hands out a port its store already listens on. A port found free and bound only at the
    group's set-up could be taken in between: a CI run's two-node Ray test failed with EADDRINUSE."""
    from ckpt_engine.trainer.ray_workers import FsdpRankActor

    rank0 = FsdpRankActor.__new__(FsdpRankActor)  # its Ray-bound start-up skipped: only `rendezvous` runs
    rank0.job, rank0.world_size, rank0.host, rank0._store = load_job_config({}), 2, "127.0.0.1", None
    host, port = rank0.rendezvous()
    with socket.create_connection((host, port), timeout=10):  # a port found free and released: refused
        pass


def test_vllm_job_on_ray_needs_fsdp2_and_a_big_enough_vocab() -> None:
    pytest.importorskip("ray")
    from ckpt_engine.trainer.ray_job import RayJob

    with pytest.raises(ValueError, match="set trainer.backend=fsdp2"):
        RayJob(load_job_config(None, ["rollout.engine=vllm", "trainer.backend=tiny"]))
    with pytest.raises(ValueError, match="rollout.model.vocab_size=8 cannot hold the task's tokens"):
        RayJob(load_job_config(None, ["rollout.engine=vllm", "trainer.backend=fsdp2", "rollout.model={vocab_size: 8}"]))


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def _wait_resources_back(ray: Any, total: dict[str, float], timeout_s: float = 120.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    free = ray.available_resources()
    while time.monotonic() < deadline and free.get("CPU", 0.0) < total["CPU"]:
        time.sleep(0.2)
        free = ray.available_resources()
    return free


def test_an_engine_that_dies_after_the_run_is_reported_not_raised(ray_cluster: Any, tmp_path: Any) -> None:
    """The job's end asks every engine for its info: one whose restart failed after the run (or
    that ran out of restarts) is named dead in the summary, and the run's results stand."""
    from ckpt_engine.trainer.ray_job import RayJob

    class Engine:  # defined here so Ray ships it by value to its workers
        """An engine actor's `info()`; with `marker`, an incarnation after the first cannot come
        up (as a restarted vLLM engine whose registration finds the job's daemon closed)."""

        def __init__(self, name: str, marker: str | None = None) -> None:
            if marker is not None:
                if os.path.exists(marker):
                    raise RuntimeError("registration refused: the daemon is gone")
                open(marker, "w").close()
            self.name = name

        def info(self) -> dict[str, Any]:
            return {"name": self.name, "pid": os.getpid()}

    job = RayJob(load_job_config(None, ["ray.enabled=true", "rollout.engine=vllm", "trainer.backend=fsdp2", f"ray.start_timeout_s={START_S}"]))
    actor = ray_cluster.remote(num_cpus=0.1)(Engine)
    live = actor.remote("vllm0")
    dying = actor.options(max_restarts=1).remote("vllm1", str(tmp_path / "first-incarnation"))
    first_pid = ray_cluster.get(dying.info.remote(), timeout=START_S)["pid"]
    ray_cluster.kill(dying, no_restart=False)  # Ray restarts it; the restart's constructor raises
    job.engines = {"vllm0": live, "vllm1": dying}
    job._pids = {"vllm0": None, "vllm1": first_pid}
    info = job._engine_info()
    assert info["vllm0"]["name"] == "vllm0" and info["vllm0"]["pid"] != os.getpid()
    assert info["vllm1"]["name"] == "vllm1" and "pid" not in info["vllm1"] and "died after the run" in info["vllm1"]["error"]
    assert [(e["event"], e["engine"], e["pid"]) for e in job.events] == [("died", "vllm1", first_pid)]
    ray_cluster.kill(live)


@pytest.mark.slow
def test_fully_async_job_on_ray_actors(ray_cluster: Any) -> None:
    from ckpt_engine.trainer.demo import run_job  # the same entry point as without Ray

    job = load_job_config(None, [
        "ray.enabled=true", "ray.trainer_num_cpus=0.5", "ray.engine_num_cpus=0.5", f"ray.start_timeout_s={START_S}", f"ray.job_timeout_s={JOB_S}",
        "checkpoint_engine.backend=gloo", "checkpoint_engine.timeout_s=30",
        "trainer.steps=16", "trainer.sync_every=2", "trainer.max_staleness=1", "trainer.seed=1",
        "rollout.num_engines=2",
    ])
    total = ray_cluster.cluster_resources()
    result = run_job(job, echo=False)

    versions = result["versions"]
    assert versions == sorted(set(versions)) and versions[0] == 1 and len(versions) >= 16 // 2
    assert result["final_version"] == versions[-1]
    assert result["engine_versions"] == {"rollout0": versions[-1], "rollout1": versions[-1]}
    assert 0 <= result["staleness_max"] <= job.trainer.max_staleness
    assert result["samples_used"] == 16 * job.trainer.batch_size
    assert all(s["ok"] for s in result["syncs"]) and sum(s["bytes"] for s in result["syncs"]) > 0
    # The engines' outputs changed with the weights they received.
    for name, before in result["greedy_before"].items():
        assert before is not None and result["greedy_after"][name] not in (None, before)
    # Trainer and engines each ran in their own Ray worker process, and the engines hold the
    # final version complete (not paused, not stale).
    pids = {result["trainer"]["pid"], *(h["pid"] for h in result["engines"].values())}
    assert len(pids) == 3 and os.getpid() not in pids
    for health in result["engines"].values():
        assert (health["version"], health["paused"], health["stale"]) == (versions[-1], False, False)
        assert health["node_ip"] == result["trainer"]["node_ip"] == ray_cluster.util.get_node_ip_address()
    # Actors and placement group were released; the cluster this test owns is left connected.
    assert ray_cluster.is_initialized()
    assert _wait_resources_back(ray_cluster, total).get("CPU", 0.0) == total["CPU"]


@pytest.mark.slow
def test_unplaceable_job_fails_within_timeout(ray_cluster: Any) -> None:
    from ckpt_engine.trainer.ray_job import run_ray_job

    job = load_job_config(None, ["ray.enabled=true", "ray.engine_num_cpus=8", "ray.start_timeout_s=3", "rollout.num_engines=1"])
    with pytest.raises(RuntimeError, match=r"placement group .* not placed within 3s; cluster has"):
        run_ray_job(job, echo=False)  # only the 3 s placement wait raises this, and nothing else waits on the way
    assert _wait_resources_back(ray_cluster, ray_cluster.cluster_resources()).get("CPU", 0.0) == 2.0
