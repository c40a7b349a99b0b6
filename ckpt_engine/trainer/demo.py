"""`ckpt-engine demo`: a short fully-async job on CPU with the reference rollout engines.

Spawns `rollout.num_engines` reference receivers, embeds the daemon in this (trainer) process,
trains the tiny policy on the synthetic task and prints, per sync, version, bytes, seconds,
GB/s and the consumed samples' staleness, then a summary showing the engines' greedy answers
before and after training (the rollout outputs change with the weights).

    ckpt-engine demo [--config job.yaml] [trainer.steps=40 rollout.num_engines=2 ...]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

__all__ = ["main", "run_job"]

logger = logging.getLogger(__name__)


def run_job(job: Any, *, echo: bool = True) -> dict[str, Any]:
    """Run one job with reference engines; returns the summary as a plain dict."""
    if job.ray.enabled:  # the same job with trainer rank 0 and the engines as Ray actors
        from ckpt_engine.trainer.ray_job import run_ray_job

        return run_ray_job(job, echo=echo)
    import ckpt_engine.trainer  # noqa: F401  (registers the `tiny` TrainEngine)
    from ckpt_engine.daemon import WeightSyncDaemon
    from ckpt_engine.rollout_adapters.torch_ref import TorchRefRollout, write_spec_file
    from ckpt_engine.trainer.loop import FullyAsyncTrainer, SyncRecord
    from ckpt_engine.trainer.rollout import TorchRefPolicyGenerator
    from ckpt_engine.trainer_adapters.base import TrainEngineRegistry

    if job.rollout.engine != "torch_ref":
        raise ValueError(f"the demo drives reference engines only; rollout.engine={job.rollout.engine!r} is not supported here yet")
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
                r = TorchRefRollout.spawn(f"rollout{i}", spec_file=str(spec), load_delay_s=job.rollout.load_delay_s, timeout_s=job.checkpoint_engine.timeout_s)
                engines.append(r)
                daemon.register(r.name, {"kind": "torch_ref", "host": r.rpc.host, "port": r.rpc.port})
                generators.append(TorchRefPolicyGenerator(r.name, r.rpc.host, r.rpc.port, seed=job.trainer.seed + i))
            prompts = torch.arange(job.rollout.vocab_size)

            def on_sync(rec: SyncRecord) -> None:
                stale = trainer.steps[-1] if trainer.steps else None
                say(
                    f"sync v{rec.version:<3} step {rec.step:<4} {rec.reason:<9} {rec.bytes / 1e3:8.1f} kB "
                    f"{rec.seconds:7.3f} s {rec.gbps:7.4f} GB/s  staleness max {stale.staleness_max if stale else 0} "
                    f"mean {stale.staleness_mean if stale else 0.0:.2f}  reward {stale.reward if stale else 0.0:.2f}"
                    + (f"  dropped {rec.dropped}" if rec.dropped else "")
                )

            trainer = FullyAsyncTrainer(job, engine, daemon, generators, on_sync=on_sync)
            trainer.sync(0, "initial")
            before = _greedy(generators, prompts)
            summary = trainer.run(initial_sync=False)
            after = _greedy(generators, prompts)
            answer = trainer.task.answer(prompts)
            result = {
                **{k: v for k, v in vars(summary).items() if k != "syncs"},
                "syncs": [vars(s) for s in summary.syncs],
                "greedy_before": before,
                "greedy_after": after,
                "accuracy_before": _accuracy(before, answer),
                "accuracy_after": _accuracy(after, answer),
                "max_staleness": job.trainer.max_staleness,
            }
            say(
                f"summary: {summary.steps} steps, versions {summary.versions[0] if summary.versions else '-'}..{summary.final_version}, "
                f"engines {summary.engine_versions}, staleness max {summary.staleness_max} (bound {job.trainer.max_staleness}) "
                f"mean {summary.staleness_mean:.2f}, reward {summary.reward_first:.2f} -> {summary.reward_last:.2f}, "
                f"greedy accuracy {result['accuracy_before']} -> {result['accuracy_after']}"
            )
            for name in before:
                say(f"  {name}: greedy answers before {before[name]}  after {after.get(name)}")
            return result
        finally:
            for g in generators:
                g.close()
            daemon.close()
            for r in engines:
                r.close()


def _greedy(generators: list[Any], prompts: torch.Tensor) -> dict[str, list[int] | None]:
    out = {}
    for g in generators:
        ans = g.greedy(prompts)
        out[g.name] = None if ans is None else ans.tolist()
    return out


def _accuracy(answers: dict[str, list[int] | None], truth: torch.Tensor) -> dict[str, float | None]:
    return {n: None if a is None else float((torch.tensor(a) == truth).float().mean()) for n, a in answers.items()}


def main(argv: list[str] | None = None) -> int:
    from ckpt_engine.config import ConfigError
    from ckpt_engine.trainer.config import load_job_config

    p = argparse.ArgumentParser(prog="ckpt-engine demo", description="a short fully-async RL job on CPU (reference engines, gloo)")
    p.add_argument("--config", help="job YAML with sections trainer, rollout, checkpoint_engine, daemon")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.steps=20")
    args = p.parse_args(argv)
    logging.basicConfig(level=os.environ.get("CKPT_ENGINE_LOG", "WARNING"), stream=sys.stderr)
    try:
        job = load_job_config(args.config, ["checkpoint_engine.backend=gloo", "checkpoint_engine.timeout_s=60", *args.overrides])
        run_job(job)
    except (ConfigError, ValueError) as exc:
        print(f"ckpt-engine demo: {exc}", file=sys.stderr)
        return 2
    return 0
