"""The fully-async job on Ray: trainer rank 0 and the rollout engines as Ray actors.

Same trainer, same daemon, same engines as `ckpt_engine.trainer.demo.run_job`; only where the
processes live changes. With `ray.enabled: true` in the job YAML (or the override
`ray.enabled=true`) the launcher

1. reserves one placement-group bundle per actor (`ray.trainer_num_cpus/gpus`,
   `ray.engine_num_cpus/gpus`, strategy `ray.placement_strategy`), so a cluster of several
   machines can host the job and Ray decides where each piece goes;
2. starts `TrainerRankActor` (the TrainEngine, the embedded `WeightSyncDaemon`, the rollout
   workers and the `FullyAsyncTrainer` loop) and asks it for the weights' metadata;
3. starts `rollout.num_engines` `RolloutEngineActor`s, each holding a reference receiver
   (`TorchRefWorker`) whose msgpack RPC server listens on the actor's node IP and a port the OS
   picked; each answers with an engine descriptor `{"kind": "torch_ref", "host", "port"}`;
4. hands the descriptors to the trainer actor, which registers them with its daemon exactly as a
   remote engine would register over the daemon protocol, and runs the loop.

Ray carries only control: the job config, tensor specs, descriptors and the summary (small plain
objects). Weights never touch Ray's object store: they go through the weight-sync process group
the daemon's rendezvous (on the trainer actor's node IP, free port from the OS) creates, and
control goes over the existing msgpack RPC, as without Ray.

Without `ray.enabled` the same job runs as plain processes on one machine (`run_job`); the
training loop does not branch on the launcher.

Multi-machine note: gloo picks its network interface from the host name; set
`GLOO_SOCKET_IFNAME` (through the Ray runtime env) when that does not resolve to a routable one.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckpt_engine.config import ConfigError

if TYPE_CHECKING:
    from ckpt_engine.trainer.config import JobConfig
    from ckpt_engine.trainer.loop import FullyAsyncTrainer, SyncRecord

__all__ = ["RayConfig", "RolloutEngineActor", "TrainerRankActor", "placement_bundles", "run_ray_job"]

logger = logging.getLogger(__name__)

PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(kw_only=True)
class RayConfig:
    """`ray:` section of the job YAML: whether and how the job's processes become Ray actors."""

    enabled: bool = False
    """Run trainer rank 0 and the rollout engines as Ray actors; false runs plain local processes."""
    address: str | None = None
    """`ray.init(address=...)` when this process has not connected yet: None starts a local cluster,
    "auto" joins the cluster this machine belongs to, "ray://host:port" a remote one."""
    trainer_num_cpus: float = 1.0
    """CPUs reserved for the trainer rank actor (it also runs the rollout worker threads)."""
    trainer_num_gpus: float = 0.0
    """GPUs reserved for the trainer rank actor."""
    engine_num_cpus: float = 1.0
    """CPUs reserved for each rollout engine actor."""
    engine_num_gpus: float = 0.0
    """GPUs reserved for each rollout engine actor."""
    placement_strategy: str = "PACK"
    """Placement-group strategy over the bundles (PACK, SPREAD, STRICT_PACK, STRICT_SPREAD)."""
    start_timeout_s: float = 120.0
    """Bound on reserving the placement group and on each actor's start-up call."""
    job_timeout_s: float = 3600.0
    """Bound on the whole training run inside the trainer actor."""

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ConfigError(f"ray.enabled must be a bool, got {self.enabled!r}")
        if self.address is not None and (not isinstance(self.address, str) or not self.address):
            raise ConfigError(f"ray.address must be null or a non-empty string such as 'auto', got {self.address!r}")
        for role in ("trainer", "engine"):
            cpus, gpus = getattr(self, f"{role}_num_cpus"), getattr(self, f"{role}_num_gpus")
            for name, value in ((f"{role}_num_cpus", cpus), (f"{role}_num_gpus", gpus)):
                if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                    raise ConfigError(f"ray.{name} must be a number >= 0, got {value!r}")
            if cpus == 0 and gpus == 0:  # Ray refuses an empty placement-group bundle
                raise ConfigError(f"ray.{role}_num_cpus and ray.{role}_num_gpus are both 0; reserve at least one of them")
        if self.placement_strategy not in PLACEMENT_STRATEGIES:
            raise ConfigError(f"ray.placement_strategy must be one of {', '.join(PLACEMENT_STRATEGIES)}, got {self.placement_strategy!r}")
        for name in ("start_timeout_s", "job_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"ray.{name} must be a number > 0, got {value!r}")


def _bundle(num_cpus: float, num_gpus: float) -> dict[str, float]:
    return {k: float(v) for k, v in (("CPU", num_cpus), ("GPU", num_gpus)) if v > 0}


def placement_bundles(job: JobConfig) -> list[dict[str, float]]:
    """Bundle 0 is the trainer rank, bundle 1 + i is rollout engine i (a pure function of the config)."""
    cfg = job.ray
    return [_bundle(cfg.trainer_num_cpus, cfg.trainer_num_gpus)] + [
        _bundle(cfg.engine_num_cpus, cfg.engine_num_gpus) for _ in range(job.rollout.num_engines)
    ]


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise RuntimeError("ray.enabled=true needs Ray: pip install 'ckpt-engine[ray]'") from exc
    return ray


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

    def __init__(self, name: str, specs: list[list[Any]], load_delay_s: float = 0.0) -> None:
        import torch

        from ckpt_engine.rollout_adapters.torch_ref import TorchRefWorker
        from ckpt_engine.wire import RpcServer

        self.name = name
        self.host = _node_ip()
        tensors = {str(n): torch.zeros(tuple(shape), dtype=getattr(torch, str(dtype))) for n, dtype, shape in specs}
        self.worker = TorchRefWorker(tensors, load_delay_s=load_delay_s)
        self.server = RpcServer(self.worker.handlers(), host=self.host, port=0).start()
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

    def __init__(self, job: JobConfig, echo: bool = False) -> None:
        import ckpt_engine.trainer  # noqa: F401  (registers the `tiny` TrainEngine)
        from ckpt_engine.trainer_adapters.base import TrainEngineRegistry

        self.job = job
        self.echo = echo
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
        return [[s.name, s.dtype, list(s.shape)] for s in self.engine.metadata()]

    def run(self, engines: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """Register `engines` (name -> descriptor) with an embedded daemon and train; returns the summary."""
        import torch

        from ckpt_engine.daemon import WeightSyncDaemon
        from ckpt_engine.trainer.loop import FullyAsyncTrainer
        from ckpt_engine.trainer.rollout import TorchRefPolicyGenerator

        job = self.job
        daemon = WeightSyncDaemon(job.checkpoint_engine, job.daemon, rendezvous_host=self.host)
        generators: list[TorchRefPolicyGenerator] = []
        try:
            daemon.serve(host=self.host if job.daemon.host in _LOOPBACK else job.daemon.host)
            self._say(f"daemon at {daemon.address} (ckpt-engine status --address {daemon.address} --token {daemon.token})")
            for i, (name, descriptor) in enumerate(engines.items()):
                daemon.register(name, descriptor)
                generators.append(
                    TorchRefPolicyGenerator(name, descriptor["host"], descriptor["port"], timeout_s=job.checkpoint_engine.timeout_s, seed=job.trainer.seed + i)
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
def run_ray_job(job: JobConfig, *, echo: bool = True) -> dict[str, Any]:
    """Run one job with trainer rank 0 and the engines as Ray actors; returns the summary dict.

    Connects to Ray (`ray.address`) unless this process already did, and then leaves the
    connection as found. Every wait is bounded by `ray.start_timeout_s` / `ray.job_timeout_s`;
    the actors and the placement group are released on every exit path.
    """
    if job.rollout.engine != "torch_ref":
        raise ValueError(f"the Ray launcher hosts reference engines only; rollout.engine={job.rollout.engine!r} is not supported here yet")
    ray = _import_ray()
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    cfg = job.ray
    connected_here = not ray.is_initialized()
    if connected_here:
        ray.init(address=cfg.address, include_dashboard=False, log_to_driver=echo)
    bundles = placement_bundles(job)
    pg = placement_group(bundles, strategy=cfg.placement_strategy)
    actors: list[Any] = []
    t0 = time.monotonic()

    def wait(refs: Any, stage: str, timeout_s: float) -> Any:
        try:
            return ray.get(refs, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(f"ray job: {stage} did not finish within {timeout_s:.0f}s") from None
        except ray.exceptions.RayError as exc:
            raise RuntimeError(f"ray job: {stage} failed: {exc}") from exc

    def on(index: int, cpus: float, gpus: float) -> dict[str, Any]:
        strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index)
        return {"num_cpus": cpus, "num_gpus": gpus, "scheduling_strategy": strategy, "max_restarts": 0}

    try:
        try:
            ray.get(pg.ready(), timeout=cfg.start_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(
                f"ray job: placement group {bundles} ({cfg.placement_strategy}) not placed within {cfg.start_timeout_s:.0f}s; "
                f"cluster has {ray.cluster_resources()}, free {ray.available_resources()}"
            ) from None
        trainer = ray.remote(TrainerRankActor).options(**on(0, cfg.trainer_num_cpus, cfg.trainer_num_gpus)).remote(job, echo)
        actors.append(trainer)
        specs = wait(trainer.specs.remote(), "trainer rank 0 start-up", cfg.start_timeout_s)
        engine_cls = ray.remote(RolloutEngineActor)
        names = [f"rollout{i}" for i in range(job.rollout.num_engines)]
        engines = [
            engine_cls.options(**on(1 + i, cfg.engine_num_cpus, cfg.engine_num_gpus)).remote(name, specs, job.rollout.load_delay_s)
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
        for actor in actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception as exc:  # already gone; nothing left to release
                logger.debug("ray job: kill failed: %s", exc)
        remove_placement_group(pg)
        if connected_here:
            ray.shutdown()
