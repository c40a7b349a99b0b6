"""The reference job on Ray: a single-rank `tiny` trainer and reference engines as Ray actors.

The cheap path of `ray.enabled=true` (`rollout.engine=torch_ref`): same trainer, same daemon, same
reference engines as `ckpt_engine.trainer.demo.run_job`, each in a Ray actor placed through the
job's placement group. Each `RolloutEngineActor` holds a `TorchRefWorker` whose msgpack RPC
server listens on the actor's node IP and an OS-chosen port; the trainer actor registers their
descriptors with its embedded daemon, whose rendezvous binds its own node IP. Ray carries only
control (config, tensor specs, descriptors, the summary); weights go through the weight-sync group.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from typing import TYPE_CHECKING, Any

from ckpt_engine.trainer.ray_placement import JobPlacement, end_job, import_ray

if TYPE_CHECKING:
    from ckpt_engine.trainer.config import JobConfig
    from ckpt_engine.trainer.loop import FullyAsyncTrainer, SyncRecord

__all__ = ["RolloutEngineActor", "TrainerRankActor", "run_ref_ray_job"]

logger = logging.getLogger(__name__)

_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _node_ip() -> str:
    import ray

    return str(ray.util.get_node_ip_address())


# --- actors (plain classes; `ray.remote` wraps them at launch so importing this needs no Ray) ----
class RolloutEngineActor:
    """One rollout engine: a reference receiver serving its msgpack RPC from inside the actor.

    The RPC server runs on its own threads, so the daemon's control calls and the weight-sync
    group's collectives never wait on Ray's actor queue; the actor methods only report where the
    engine is and how it is.
    """

    def __init__(self, name: str, specs: list[list[Any]], load_delay_s: float = 0.0, *, token: str) -> None:
        import torch

        from ckpt_engine.control.server import RpcServer
        from ckpt_engine.rollout_adapters.torch_ref.worker import TorchRefWorker

        self.name = name
        self.host = _node_ip()
        tensors = {str(n): torch.zeros(tuple(shape), dtype=getattr(torch, str(dtype))) for n, dtype, shape in specs}
        self.worker = TorchRefWorker(tensors, load_delay_s=load_delay_s)
        self.server = RpcServer(self.worker.handlers(), token=token, host=self.host, port=0).start()  # the job's token
        logger.info("rollout engine %s serving at %s:%d (pid %d)", name, self.host, self.server.port, os.getpid())

    def descriptor(self) -> dict[str, Any]:
        """How the daemon reaches this engine: the `torch_ref` engine kind's descriptor."""
        return {"kind": "torch_ref", "host": self.host, "port": int(self.server.port)}

    def health(self) -> dict[str, Any]:
        return {**self.worker.health(), "node_ip": self.host}

    def stop(self) -> None:
        self.server.close()


class TrainerRankActor:
    """Trainer rank 0: the TrainEngine, the embedded daemon and the fully-async loop.

    The tiny trainer is single-rank; the daemon's rendezvous and control server bind this actor's
    node IP so engines on other machines can join.
    """

    def __init__(self, job: JobConfig, echo: bool = False, *, token: str | None = None) -> None:
        import ckpt_engine.trainer  # noqa: F401  (registers the `tiny` TrainEngine)
        from ckpt_engine.trainer.engines.base import TrainEngineRegistry

        self.job = job
        self.echo = echo
        self.token = token
        self.host = _node_ip()
        kwargs = dict(job.trainer.engine_kwargs)
        if job.trainer.backend == "tiny":
            kwargs.setdefault("vocab_size", job.rollout.vocab_size)
            kwargs.setdefault("lr", job.trainer.lr)
            kwargs.setdefault("seed", job.trainer.seed)
        self.engine = TrainEngineRegistry.new(job.trainer.backend, **kwargs)
        self._trainer: FullyAsyncTrainer | None = None

    def specs(self) -> list[list[Any]]:
        """The weights every engine must hold, as [name, dtype, shape] (no tensors gathered)."""
        return [[s.name, s.dtype, list(s.shape)] for s in self.engine.source.metadata()]

    def run(self, engines: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """Register `engines` (name -> descriptor) with an embedded daemon and train; returns the summary."""
        import torch

        from ckpt_engine.daemon import WeightSyncDaemon
        from ckpt_engine.trainer.loop import FullyAsyncTrainer
        from ckpt_engine.trainer.rollout import TorchRefPolicyGenerator

        job = self.job
        daemon = WeightSyncDaemon(job.checkpoint_engine, job.daemon, token=self.token, rendezvous_host=self.host)
        generators: list[TorchRefPolicyGenerator] = []
        try:
            daemon.serve(host=self.host if job.daemon.host in _LOOPBACK else job.daemon.host)
            self._say(f"daemon at {daemon.address} (ckpt-engine status --address {daemon.address} --token {daemon.token})")
            for i, (name, descriptor) in enumerate(engines.items()):
                daemon.register(name, descriptor)
                generators.append(
                    TorchRefPolicyGenerator(
                        name, descriptor["host"], descriptor["port"], timeout_s=job.checkpoint_engine.timeout_s, seed=job.trainer.seed + i, token=daemon.token
                    )
                )
            self._trainer = FullyAsyncTrainer(job, self.engine, daemon, generators, on_sync=self._on_sync)
            self._trainer.sync(0, "initial")
            prompts = torch.arange(job.rollout.vocab_size)
            before = _greedy(generators, prompts)
            summary = self._trainer.run(initial_sync=False)
            after = _greedy(generators, prompts)
            answer = self._trainer.task.answer(prompts)
        finally:
            for g in generators:
                g.close()
            daemon.close()
        return {
            **{k: v for k, v in vars(summary).items() if k != "syncs"},
            "syncs": [vars(s) for s in summary.syncs],
            "greedy_before": before,
            "greedy_after": after,
            "accuracy_before": _accuracy(before, answer),
            "accuracy_after": _accuracy(after, answer),
            "max_staleness": job.trainer.max_staleness,
            "trainer": {"node_ip": self.host, "pid": os.getpid()},
        }

    def _say(self, line: str) -> None:
        if self.echo:
            print(line, flush=True)

    def _on_sync(self, rec: SyncRecord) -> None:
        last = self._trainer.steps[-1] if self._trainer is not None and self._trainer.steps else None
        self._say(
            f"sync v{rec.version:<3} step {rec.step:<4} {rec.reason:<9} {rec.bytes / 1e3:8.1f} kB "
            f"{rec.seconds:7.3f} s {rec.gbps:7.4f} GB/s  staleness max {last.staleness_max if last else 0} "
            f"mean {last.staleness_mean if last else 0.0:.2f}  reward {last.reward if last else 0.0:.2f}"
            + (f"  dropped {rec.dropped}" if rec.dropped else "")
        )


def _greedy(generators: list[Any], prompts: Any) -> dict[str, list[int] | None]:
    """Each engine's greedy answers from the weights it serves (None while it serves none)."""
    answers = {g.name: g.greedy(prompts) for g in generators}
    return {name: None if a is None else a.tolist() for name, a in answers.items()}


def _accuracy(answers: dict[str, list[int] | None], truth: Any) -> dict[str, float | None]:
    return {n: None if a is None else float((truth.new_tensor(a) == truth).float().mean()) for n, a in answers.items()}


# --- launcher ------------------------------------------------------------------------------------
def run_ref_ray_job(job: JobConfig, *, echo: bool = True) -> dict[str, Any]:
    """Trainer rank 0 and the reference engines as Ray actors (the caller connected to Ray)."""
    ray = import_ray()
    cfg = job.ray
    placement = JobPlacement(job, 1).reserve()
    actors: list[Any] = []
    t0 = time.monotonic()

    def wait(refs: Any, stage: str, timeout_s: float) -> Any:
        try:
            return ray.get(refs, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(f"ray job: {stage} did not finish within {timeout_s:.0f}s") from None
        except ray.exceptions.RayError as exc:
            raise RuntimeError(f"ray job: {stage} failed: {exc}") from exc

    try:
        token = secrets.token_hex(16)  # the job token: the daemon's and every engine's control port
        trainer = ray.remote(TrainerRankActor).options(**placement.trainer_options(0), max_restarts=0).remote(job, echo, token=token)
        actors.append(trainer)
        specs = wait(trainer.specs.remote(), "trainer rank 0 start-up", cfg.start_timeout_s)
        engine_cls = ray.remote(RolloutEngineActor)
        names = [f"rollout{i}" for i in range(job.rollout.num_engines)]
        engines = [
            engine_cls.options(**placement.engine_options(i), max_restarts=0).remote(name, specs, job.rollout.load_delay_s, token=token)
            for i, name in enumerate(names)
        ]
        actors += engines
        descriptors = wait([e.descriptor.remote() for e in engines], "rollout engine start-up", cfg.start_timeout_s)
        logger.info("ray job: engines %s", {n: f"{d['host']}:{d['port']}" for n, d in zip(names, descriptors)})
        result = wait(trainer.run.remote(dict(zip(names, descriptors))), "training run", cfg.job_timeout_s)
        result["engines"] = dict(zip(names, wait([e.health.remote() for e in engines], "engine health", cfg.start_timeout_s)))
        result["seconds"] = time.monotonic() - t0
        if echo:
            print(
                f"summary: {result['steps']} steps, versions {result['versions'][0] if result['versions'] else '-'}..{result['final_version']}, "
                f"engines {result['engine_versions']}, staleness max {result['staleness_max']} (bound {job.trainer.max_staleness}) "
                f"mean {result['staleness_mean']:.2f}, reward {result['reward_first']:.2f} -> {result['reward_last']:.2f}, "
                f"greedy accuracy {result['accuracy_before']} -> {result['accuracy_after']}, {result['seconds']:.1f} s on Ray"
            )
        return result
    finally:
        end_job(actors, placement)
