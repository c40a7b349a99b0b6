"""The fully-async job on Ray: placement group, FSDP2 trainer ranks and vLLM engines as actors.

Same trainer loop, same daemon, same weight-sync group as the process launcher
(`ckpt_engine.trainer.vllm_job`); only where the processes live changes. With `ray.enabled: true`
(or the override `ray.enabled=true`) the controller (`RayJob`, in the `ckpt-engine demo` process)

1. reserves one placement group for the job (`ray_placement`): a bundle per trainer rank (shared
   under STRICT_SPREAD) and one per engine, CPU/GPU/custom resources from the `ray:` section;
2. starts `trainer.num_processes` `FsdpRankActor`s (`ray_workers`); rank 0 starts the daemon on
   its node IP and picks the trainer group's port there; every rank joins the gloo group on it;
3. starts `rollout.num_engines` `VllmEngineActor`s (`ray_engines`: in-process `vllm.LLM` with the
   worker extension), each of which registers itself with the daemon by name and serves its
   control and generation on an RPC port of its node IP;
4. drives the worker group: rank 0 leads the fully-async loop, the other ranks follow; while they
   run it watches the actors through Ray. An engine actor Ray reports dead is dropped by name
   (`leave`); one Ray restarts (`ray.engine_max_restarts`) registers again and gets the current
   version before it serves. A trainer rank that dies or fails ends the job at once with an error
   naming the rank (its peers would only wait out their collective timeout).

Ray carries only control (the job config, addresses, status maps and the summary); weights never
touch Ray's object store. `rollout.engine=torch_ref` runs the reference engines instead
(`ray_refjob`).

Multi-machine note: gloo (trainer group and weight-sync group) picks its network interface from
the host name; set `GLOO_SOCKET_IFNAME` (NCCL: `NCCL_SOCKET_IFNAME`) in the Ray runtime env when
that does not resolve to a routable one.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import threading
import time
from typing import TYPE_CHECKING, Any

from ckpt_engine.trainer.ray_config import PLACEMENT_STRATEGIES, RayConfig
from ckpt_engine.trainer.ray_placement import JobPlacement, end_job, import_ray, placement_bundles

if TYPE_CHECKING:
    from ckpt_engine.trainer.config import JobConfig

__all__ = ["PLACEMENT_STRATEGIES", "RayConfig", "RayJob", "placement_bundles", "run_ray_job"]

logger = logging.getLogger(__name__)


def run_ray_job(job: JobConfig, *, echo: bool = True) -> dict[str, Any]:
    """Run one job on Ray; returns the summary dict.

    Connects to Ray (`ray.address`) unless this process already did, and then leaves the
    connection as found; actors and the placement group are released on every exit path."""
    if job.rollout.engine not in ("torch_ref", "vllm"):
        raise ValueError(f"the Ray launcher hosts rollout.engine torch_ref or vllm, got {job.rollout.engine!r}")
    ray = import_ray()
    connected_here = not ray.is_initialized()
    if connected_here:
        ray.init(address=job.ray.address, include_dashboard=False, log_to_driver=echo)
    try:
        if job.rollout.engine == "torch_ref":
            from ckpt_engine.trainer.ray_refjob import run_ref_ray_job

            return run_ref_ray_job(job, echo=echo)
        return RayJob(job, echo=echo).run()
    finally:
        if connected_here:
            ray.shutdown()


class RayJob:
    """The controller of one vLLM + FSDP2 job on Ray (the caller has connected to Ray).

    `engines` (name -> actor handle) and `ranks` are filled while `run()` starts them, and
    `events` records what Ray reported about the engines (died, up with a new pid), so a caller
    can watch or drill the job from another thread."""

    def __init__(self, job: JobConfig, *, echo: bool = False) -> None:
        from ckpt_engine.trainer.lm_task import TokenTask
        from ckpt_engine.trainer.tiny_qwen2 import TINY_QWEN2

        if job.trainer.backend != "fsdp2":
            raise ValueError(f"the vLLM job on Ray trains with FSDP2; set trainer.backend=fsdp2 (got {job.trainer.backend!r})")
        self.job, self.echo = job, echo
        self.world_size = job.trainer.world_size
        self.model_config = {**TINY_QWEN2, **job.rollout.model}
        need = TokenTask(job.rollout.vocab_size).min_model_vocab()
        if int(self.model_config["vocab_size"]) < need:
            raise ValueError(f"rollout.model.vocab_size={self.model_config['vocab_size']} cannot hold the task's tokens; it needs >= {need}")
        self.names = [f"vllm{i}" for i in range(job.rollout.num_engines)]
        self.token = secrets.token_hex(16)  # the job token: the daemon's and every engine's control port
        self.ranks: list[Any] = []
        self.engines: dict[str, Any] = {}
        self.events: list[dict[str, Any]] = []
        self.daemon_address: str | None = None
        self.engines_started = threading.Event()
        self._ray = import_ray()
        self._pids: dict[str, int | None] = {}
        self._pings: dict[str, Any] = {}
        self._ever_up: set[str] = set()

    # --- start-up -------------------------------------------------------------------------------
    def _wait(self, refs: Any, stage: str, timeout_s: float | None = None) -> Any:
        ray = self._ray
        timeout = self.job.ray.start_timeout_s if timeout_s is None else timeout_s
        try:
            return ray.get(refs, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(f"ray job: {stage} did not finish within {timeout:.0f}s") from None
        except ray.exceptions.RayError as exc:
            raise RuntimeError(f"ray job: {stage} failed: {exc}") from exc

    def _engine_info(self) -> dict[str, Any]:
        """Each engine's `info()` at the job's end. Ray answers a call to an actor it is restarting,
        or whose restart this process has not heard of yet, with "temporarily unavailable" (the call
        may not have run): `info` only reads, so it is asked again, within `ray.start_timeout_s`.
        An engine Ray reports dead (its restart came after the run closed the daemon, so it could
        not register; or it ran out of restarts) gets `{"name", "error"}` and a "died" event: the
        run's results stand, and the summary says which engine did not outlive it."""
        ray = self._ray
        timeout = self.job.ray.start_timeout_s
        deadline = time.monotonic() + timeout
        info: dict[str, Any] = {}
        while True:
            for name, handle in self.engines.items():
                if name in info:
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"ray job: engine {name!r} was still unavailable (restarting) {timeout:.0f}s after the run ended")
                try:
                    info[name] = self._wait(handle.info.remote(), f"engine {name!r} info", left)
                except RuntimeError as exc:
                    if isinstance(exc.__cause__, ray.exceptions.ActorDiedError):
                        reason = f"died after the run: {type(exc.__cause__).__name__}"
                        info[name] = {"name": name, "error": f"{reason}: {exc.__cause__}"[:1000]}
                        self.events.append({"event": "died", "engine": name, "pid": self._pids.get(name), "t": time.time(), "reason": reason})
                        logger.warning("ray job: engine %s %s", name, reason)
                        continue
                    if not isinstance(exc.__cause__, ray.exceptions.ActorUnavailableError):
                        raise
                    logger.info("ray job: engine %s is restarting; asking for its info again", name)
            if len(info) == len(self.engines):
                return {name: info[name] for name in self.engines}
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))

    def _start(self, placement: JobPlacement) -> list[dict[str, Any]]:
        from ckpt_engine.trainer.ray_engines import VllmEngineActor
        from ckpt_engine.trainer.ray_workers import FsdpRankActor

        ray, job = self._ray, self.job
        plain = dataclasses.asdict(job)
        rank_cls = ray.remote(FsdpRankActor)
        self.ranks = [
            rank_cls.options(**placement.trainer_options(r), max_restarts=0).remote(plain, r, self.world_size, self.model_config)
            for r in range(self.world_size)
        ]
        self.daemon_address = self._wait(self.ranks[0].start_daemon.remote(self.token), "trainer rank 0 start-up (daemon)")
        engine_cls = ray.remote(VllmEngineActor)
        for i, name in enumerate(self.names):  # they start (tens of seconds) while the trainer group forms
            self.engines[name] = engine_cls.options(
                **placement.engine_options(i), max_restarts=job.ray.engine_max_restarts, max_concurrency=4
            ).remote(name, self.model_config, token=self.token, daemon_address=self.daemon_address, timeout_s=job.checkpoint_engine.timeout_s)
            self._pids[name] = None
        self.engines_started.set()
        host, port = self._wait(self.ranks[0].rendezvous.remote(), "trainer rendezvous")
        return list(self._wait([r.setup.remote(host, port) for r in self.ranks], "trainer group set-up"))

    # --- supervision ----------------------------------------------------------------------------
    def _watch_engines(self) -> None:
        """Ask Ray whether each engine actor lives; drop a dead one by name, note a new incarnation."""
        ray = self._ray
        for name, handle in self.engines.items():
            ref = self._pings.get(name)
            if ref is None:
                self._pings[name] = handle.ping.remote()
                continue
            ready, _ = ray.wait([ref], timeout=0)
            if not ready:
                continue  # starting (or restarting): calls queue until __init__ returns
            del self._pings[name]
            try:
                pid = ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                if self._pids.get(name) is not None:
                    self._engine_died(name, exc)
                elif name not in self._ever_up and isinstance(exc, ray.exceptions.ActorDiedError):
                    raise RuntimeError(f"ray job: engine {name!r} failed to start (restarts exhausted): {exc}") from None
                continue
            self._note_up(name, pid)

    def _note_up(self, name: str, pid: int) -> None:
        if pid != self._pids.get(name):
            self._pids[name] = pid
            self._ever_up.add(name)
            self.events.append({"event": "up", "engine": name, "pid": pid, "t": time.time()})
            logger.info("ray job: engine %s is up (pid %d)", name, pid)

    def _engine_died(self, name: str, exc: Exception) -> None:
        pid, self._pids[name] = self._pids[name], None
        reason = f"Ray reports actor {name!r} (pid {pid}) dead: {type(exc).__name__}"
        self.events.append({"event": "died", "engine": name, "pid": pid, "t": time.time(), "reason": reason})
        logger.warning("ray job: %s; dropping it from the daemon", reason)
        threading.Thread(target=self._leave, args=(name, pid), name=f"leave-{name}", daemon=True).start()

    def _leave(self, name: str, pid: int | None) -> None:
        """`leave` waits for a running sync; the restarted incarnation (another pid) is kept."""
        from ckpt_engine.daemon.client import DaemonClient

        assert self.daemon_address is not None
        client = DaemonClient(self.daemon_address, self.token, timeout_s=self.job.checkpoint_engine.timeout_s * 4)
        try:
            for rec in client.members()["engines"]:
                if rec["name"] == name and (rec.get("health") or {}).get("pid") not in (None, pid):
                    return
            client.leave(name)
        except Exception as exc:  # already dropped by the failed sync, or the job is ending
            logger.info("ray job: leave(%s): %s", name, exc)

    def _supervise(self, lead: Any, follows: list[Any]) -> dict[str, Any]:
        ray, cfg = self._ray, self.job.ray
        roles = {lead: 0, **{ref: r + 1 for r, ref in enumerate(follows)}}
        pending = list(roles)
        result: dict[str, Any] | None = None
        deadline = time.monotonic() + cfg.job_timeout_s
        while pending:
            if time.monotonic() > deadline:
                raise RuntimeError(f"ray job: the training run did not finish within ray.job_timeout_s={cfg.job_timeout_s:.0f}s")
            self._watch_engines()
            done, pending = ray.wait(pending, num_returns=1, timeout=cfg.monitor_interval_s)
            for ref in done:
                rank = roles[ref]
                try:
                    value = ray.get(ref)
                except ray.exceptions.RayActorError as exc:
                    raise RuntimeError(f"ray job: trainer rank {rank} died ({type(exc).__name__}); the job is stopped: {exc}") from None
                except ray.exceptions.RayTaskError as exc:
                    raise RuntimeError(f"ray job: trainer rank {rank} failed: {exc.cause!r}") from None
                if rank == 0:
                    result = value
        assert result is not None
        return result

    # --- the job --------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        t0 = time.monotonic()
        placement = JobPlacement(self.job, self.world_size).reserve()
        try:
            trainer = self._start(placement)
            setup_s = time.monotonic() - t0
            lead = self.ranks[0].lead.remote(self.names, self.echo)
            result = self._supervise(lead, [r.follow.remote() for r in self.ranks[1:]])
            result["trainer"] = trainer
            result["engines"] = self._engine_info()
            for name, info in result["engines"].items():  # an incarnation that came up after the last poll
                if "pid" in info:
                    self._note_up(name, int(info["pid"]))
            result["events"] = list(self.events)
            result["startup_s"] = setup_s + float(result.get("engines_up_s", 0.0))
            result["seconds"] = time.monotonic() - t0
            return result
        finally:
            end_job([*self.ranks, *self.engines.values()], placement)
