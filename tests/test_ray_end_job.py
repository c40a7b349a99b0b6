"""A Ray job whose caller shut Ray down while it ran ends without starting a cluster of its own.

Ray's public calls start a local cluster when the process is not connected (`auto_init_hook`). A
job's cleanup (`trainer/ray_placement.end_job`: kill its actors, remove its placement group) that
ran after `ray.shutdown()` did so on the job's thread; Ray kills such a cluster when the thread that
started it ends, and a minute later ended the whole process with exit code 1 (a test suite then
stopped with no summary). The suite's conftest turns the auto-connect off as a safety net; this test
turns it back on, as outside the suite, and asserts that no cluster started."""

from __future__ import annotations

import pytest

from ckpt_engine.trainer.config import load_job_config

pytestmark = pytest.mark.slow


def test_a_job_ended_after_ray_was_shut_down_starts_no_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    ray = pytest.importorskip("ray")
    from ray._private import auto_init_hook

    from ckpt_engine.trainer.ray_placement import JobPlacement, end_job

    job = load_job_config(None, ["ray.enabled=true", "ray.trainer_num_cpus=0.5", "ray.engine_num_cpus=0.5", "rollout.num_engines=1", "ray.start_timeout_s=60"])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        placement = JobPlacement(job, 1).reserve()
        assert placement.group is not None
    finally:
        ray.shutdown()
    monkeypatch.setattr(auto_init_hook, "enable_auto_connect", True)  # as a process outside this suite runs
    try:
        end_job([], placement)  # on this (main) thread: a cluster started here would outlive the call
        assert not ray.is_initialized(), "ending the job started a new Ray cluster"
        assert placement.group is None
    finally:
        if ray.is_initialized():
            ray.shutdown()
