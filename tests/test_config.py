"""CheckpointEngineConfig: YAML, dicts, dotted overrides, and errors that name the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckpt_engine.config import CheckpointEngineConfig, ConfigError, apply_overrides, load_config


def test_defaults_and_auto_bucket() -> None:
    cfg = load_config()
    assert cfg.backend == "auto" and cfg.num_buffers == 2 and cfg.bucket_size_mb is None and cfg.bucket_size_bytes is None


def test_yaml_file_and_dotted_overrides(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("checkpoint_engine:\n  backend: gloo\n  bucket_size_mb: 8\n  engine_kwargs:\n    gloo: {}\nother: 1\n")
    cfg = load_config(path, ["checkpoint_engine.num_buffers=3", "checkpoint_engine.verify=true"])
    assert (cfg.backend, cfg.bucket_size_bytes, cfg.num_buffers, cfg.verify) == ("gloo", 8 << 20, 3, True)
    assert load_config({"checkpoint_engine": {"timeout_s": 5}}).timeout_s == 5


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("checkpoint_engine.backend=carrier_pigeon", r"checkpoint_engine\.backend='carrier_pigeon'.*allowed: auto, colocated, gloo, hccl, nccl"),
        ("checkpoint_engine.num_buffers=1", r"checkpoint_engine\.num_buffers must be in \[2, 64\]"),
        ("checkpoint_engine.num_buffers=1000000000", r"checkpoint_engine\.num_buffers must be in \[2, 64\].*got 1000000000"),
        ("checkpoint_engine.timeout_s=1e9", r"got '1e9' \(YAML reads a number such as 1e9 as text: write 1\.0e9\)"),
        ("checkpoint_engine.bucket_size_mb=1e-3", r"bucket_size_mb must be a finite number, got str '1e-3' \(YAML reads"),
        ("checkpoint_engine.num_buffers=two", r"checkpoint_engine\.num_buffers must be int"),
        ("checkpoint_engine.bucket_size_mb=-4", r"checkpoint_engine\.bucket_size_mb must be in"),
        ("checkpoint_engine.timeout_s=0", r"checkpoint_engine\.timeout_s must be a finite number of seconds in \(0, 604800\]"),
        ("checkpoint_engine.timeout_s=.inf", r"checkpoint_engine\.timeout_s must be a finite number of seconds in \(0, 604800\]"),
        ("checkpoint_engine.engine_kwargs.gloo.bogus_opt=1", r"checkpoint_engine\.engine_kwargs\.gloo: unknown option\(s\) bogus_opt; allowed: "),
        ("checkpoint_engine.verify=maybe", r"checkpoint_engine\.verify must be bool"),
        ("checkpoint_engine.pause_mode=sleep", r"checkpoint_engine\.pause_mode must be one of keep, abort, none"),
        ("checkpoint_engine.stage=later", r"checkpoint_engine\.stage must be one of auto, patches, full, off, got 'later'"),
        ("checkpoint_engine.engine_kwargs=3", r"checkpoint_engine\.engine_kwargs must map"),
        ("checkpoint_engine.bucket_sz=3", r"unknown key\(s\) under checkpoint_engine: bucket_sz; allowed: .*bucket_size_mb"),
        ("checkpoint_engine.delta_base=device", r"unknown key\(s\) under checkpoint_engine: delta_base; allowed: "),
        ("checkpoint_engine.engine_kwargs.gloo.delta_base=device", r"checkpoint_engine\.engine_kwargs\.gloo: unknown option\(s\) delta_base; allowed: "),
    ],
)
def test_bad_values_name_the_field(override: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config({}, [override])


def test_malformed_override_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="must look like section.field=value"):
        apply_overrides({}, ["checkpoint_engine.backend"])
    with pytest.raises(ConfigError, match="is a value, not a section"):
        apply_overrides({"a": 1}, ["a.b=2"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_keyword_only() -> None:
    with pytest.raises(TypeError):
        CheckpointEngineConfig("gloo")  # type: ignore[misc]


def test_stage_defaults_to_auto_and_yaml_off_means_off(tmp_path: Path) -> None:
    """Issue 28: syncs are staged by default; YAML 1.1 reads a bare `off` as False."""
    assert CheckpointEngineConfig().stage == "auto"
    path = tmp_path / "job.yaml"
    path.write_text("checkpoint_engine:\n  stage: off\n")
    assert load_config(path).stage == "off"


def test_pause_mode_recompute_is_accepted() -> None:
    """Issue 28: `recompute` (in-flight requests re-prefill under the new weights) is a config value."""
    assert load_config({}, ["checkpoint_engine.pause_mode=recompute"]).pause_mode == "recompute"
    assert CheckpointEngineConfig(pause_mode="recompute").pause_mode == "recompute"


def test_a_misspelt_section_is_refused_and_other_sections_pass(tmp_path: Path) -> None:
    """Settings under a near miss of `checkpoint_engine` were silently ignored (every value at its
    default); a job YAML's other sections are still read by whoever owns them."""
    with pytest.raises(ConfigError, match=r"unknown section 'checkpoint_engin': did you mean 'checkpoint_engine'"):
        load_config(None, ["checkpoint_engin.backend=nccl"])
    path = tmp_path / "job.yaml"
    path.write_text("checkpoint-engine:\n  backend: nccl\n")
    with pytest.raises(ConfigError, match=r"unknown section 'checkpoint-engine': did you mean 'checkpoint_engine'"):
        load_config(path)
    path.write_text("trainer:\n  lr: 1.0e-6\ncheckpoint_engine:\n  backend: gloo\n")
    assert load_config(path, ["rollout.engines=2"]).backend == "gloo"
