"""The fully-async job on a local Ray cluster (CPU): trainer rank 0 and 2 rollout engines as actors.

The config tests need no Ray; the job test skips cleanly when Ray is not installed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

from ckpt_engine.config import ConfigError
from ckpt_engine.trainer.config import load_job_config
from ckpt_engine.trainer.ray_job import placement_bundles

pytestmark = pytest.mark.timeout(240)


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


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def _wait_resources_back(ray: Any, total: dict[str, float], timeout_s: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    free = ray.available_resources()
    while time.monotonic() < deadline and free.get("CPU", 0.0) < total["CPU"]:
        time.sleep(0.2)
        free = ray.available_resources()
    return free


@pytest.mark.slow
def test_fully_async_job_on_ray_actors(ray_cluster: Any) -> None:
    from ckpt_engine.trainer.demo import run_job  # the same entry point as without Ray

    job = load_job_config(None, [
        "ray.enabled=true", "ray.trainer_num_cpus=0.5", "ray.engine_num_cpus=0.5", "ray.start_timeout_s=90", "ray.job_timeout_s=150",
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
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"placement group .* not placed within 3s; cluster has"):
        run_ray_job(job, echo=False)
    assert time.monotonic() - t0 < 30
    assert _wait_resources_back(ray_cluster, ray_cluster.cluster_resources()).get("CPU", 0.0) == 2.0
