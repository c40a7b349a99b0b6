"""The fully-async trainer skeleton end to end: real reference engines, gloo, embedded daemon."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckpt_engine.config import ConfigError
from ckpt_engine.trainer.config import load_job_config
from ckpt_engine.trainer.demo import run_job

pytestmark = pytest.mark.timeout(180)


def test_job_config_yaml_and_overrides(tmp_path: Path) -> None:
    cfg = tmp_path / "job.yaml"
    cfg.write_text("trainer:\n  steps: 7\n  sync_every: 3\nrollout:\n  num_engines: 1\ncheckpoint_engine:\n  backend: gloo\n")
    job = load_job_config(cfg, ["trainer.max_staleness=0", "daemon.heartbeat_timeout_s=5", "checkpoint_engine.bucket_size_mb=1"])
    assert (job.trainer.steps, job.trainer.sync_every, job.trainer.max_staleness) == (7, 3, 0)
    assert job.rollout.num_engines == 1 and job.daemon.heartbeat_timeout_s == 5
    assert job.checkpoint_engine.backend == "gloo" and job.checkpoint_engine.bucket_size_mb == 1
    with pytest.raises(ConfigError, match="unknown section"):
        load_job_config({"trainr": {}})
    with pytest.raises(ConfigError, match="unknown key.*under trainer: stepz"):
        load_job_config(cfg, ["trainer.stepz=3"])
    with pytest.raises(ConfigError, match="trainer.sync_every must be an int >= 1, got 0"):
        load_job_config(cfg, ["trainer.sync_every=0"])


def test_fully_async_job_versions_staleness_and_learning() -> None:
    job = load_job_config(None, [
        "checkpoint_engine.backend=gloo", "checkpoint_engine.timeout_s=30",
        "trainer.steps=30", "trainer.sync_every=2", "trainer.max_staleness=1", "trainer.seed=1",
        "rollout.num_engines=2",
    ])
    result = run_job(job, echo=False)
    versions = result["versions"]
    assert versions == sorted(set(versions)) and versions[0] == 1 and len(versions) >= 30 // 2
    assert result["final_version"] == versions[-1]
    assert result["engine_versions"] == {"rollout0": versions[-1], "rollout1": versions[-1]}
    assert 0 <= result["staleness_max"] <= 1
    assert result["samples_used"] == 30 * job.trainer.batch_size
    # The rollout outputs changed with the weights and the policy learned the task.
    for name, before in result["greedy_before"].items():
        assert before is not None and result["greedy_after"][name] != before
        assert result["accuracy_after"][name] > result["accuracy_before"][name] + 0.2
