"""One placement group per job: where each trainer rank and each rollout engine may run.

Bundle layout is a pure function of the job config (`placement_bundles`), so it can be checked
without Ray. Bundles come first for the trainer, then one per engine. Under STRICT_SPREAD (no two
bundles on one node) the trainer's ranks share a single bundle sized for all of them, so "trainer
on one node, each engine on another" is expressible; under the other strategies each rank has its
own bundle and Ray packs or spreads them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ckpt_engine.trainer.config import JobConfig

__all__ = ["JobPlacement", "end_job", "import_ray", "placement_bundles", "trainer_bundle_index"]

logger = logging.getLogger(__name__)


def import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise RuntimeError("ray.enabled=true needs Ray: pip install 'ckpt-engine[ray]'") from exc
    return ray


def _bundle(num_cpus: float, num_gpus: float, custom: dict[str, float], copies: int = 1) -> dict[str, float]:
    out = {k: float(v) * copies for k, v in (("CPU", num_cpus), ("GPU", num_gpus)) if v > 0}
    out.update({k: float(v) * copies for k, v in custom.items()})
    return out


def _shared_trainer_bundle(job: JobConfig) -> bool:
    return job.ray.placement_strategy == "STRICT_SPREAD"


def placement_bundles(job: JobConfig, world_size: int | None = None) -> list[dict[str, float]]:
    """Trainer bundle(s) first (one per rank, or one shared under STRICT_SPREAD), then one per engine."""
    cfg = job.ray
    world = job.trainer.world_size if world_size is None else world_size
    if _shared_trainer_bundle(job):
        trainer = [_bundle(cfg.trainer_num_cpus, cfg.trainer_num_gpus, cfg.trainer_resources, world)]
    else:
        trainer = [_bundle(cfg.trainer_num_cpus, cfg.trainer_num_gpus, cfg.trainer_resources) for _ in range(world)]
    return trainer + [_bundle(cfg.engine_num_cpus, cfg.engine_num_gpus, cfg.engine_resources) for _ in range(job.rollout.num_engines)]


def trainer_bundle_index(job: JobConfig, rank: int) -> int:
    return 0 if _shared_trainer_bundle(job) else rank


@dataclass
class JobPlacement:
    """The job's reserved placement group and the actor options that land an actor in its bundle."""

    job: JobConfig
    world_size: int
    group: Any = None

    def reserve(self) -> JobPlacement:
        """Create the group and wait until Ray placed every bundle (bounded by ray.start_timeout_s)."""
        ray = import_ray()
        from ray.util.placement_group import placement_group

        cfg = self.job.ray
        bundles = placement_bundles(self.job, self.world_size)
        self.group = placement_group(bundles, strategy=cfg.placement_strategy)
        try:
            ray.get(self.group.ready(), timeout=cfg.start_timeout_s)
        except ray.exceptions.GetTimeoutError:
            self.release()
            raise RuntimeError(
                f"ray job: placement group {bundles} ({cfg.placement_strategy}) not placed within {cfg.start_timeout_s:.0f}s; "
                f"cluster has {ray.cluster_resources()}, free {ray.available_resources()}"
            ) from None
        logger.info("ray job: placement group %s (%s) ready", bundles, cfg.placement_strategy)
        return self

    def _options(self, index: int, cpus: float, gpus: float, custom: dict[str, float]) -> dict[str, Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(placement_group=self.group, placement_group_bundle_index=index)
        opts: dict[str, Any] = {"num_cpus": cpus, "num_gpus": gpus, "scheduling_strategy": strategy}
        if custom:
            opts["resources"] = dict(custom)
        return opts

    def trainer_options(self, rank: int) -> dict[str, Any]:
        cfg = self.job.ray
        return self._options(trainer_bundle_index(self.job, rank), cfg.trainer_num_cpus, cfg.trainer_num_gpus, cfg.trainer_resources)

    def engine_options(self, index: int) -> dict[str, Any]:
        cfg = self.job.ray
        first = 1 if _shared_trainer_bundle(self.job) else self.world_size
        return self._options(first + index, cfg.engine_num_cpus, cfg.engine_num_gpus, cfg.engine_resources)

    def release(self) -> None:
        if self.group is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self.group)
            except Exception as exc:  # the cluster may already be gone
                logger.debug("ray job: removing the placement group failed: %s", exc)
            self.group = None


def end_job(actors: list[Any], placement: JobPlacement) -> None:
    """Kill a job's actors and release its placement group, while this process is still connected.
    After `ray.shutdown()` (a caller that shut Ray down while the job ran) every Ray call would start
    a new local cluster on this thread, whose processes Ray kills when the thread ends; a minute later
    Ray ends this whole process (exit 1, nothing flushed). The actors and the group went with the
    cluster anyway."""
    ray = import_ray()
    if not ray.is_initialized():
        logger.warning("ray job: Ray was shut down while the job ran; nothing left to kill or release")
        placement.group = None
        return
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception as exc:  # already gone
            logger.debug("ray job: kill failed: %s", exc)
    placement.release()
