"""The trainer as a Ray worker group: N FSDP2 ranks as actors, driven by one controller.

Each `FsdpRankActor` is one data-parallel rank. The controller asks rank 0 for an address (its
node IP as Ray reports it, a port the OS picked there), every rank joins the trainer's gloo group
on it, and then rank 0 leads and the others follow exactly as in the process launcher
(`ckpt_engine.trainer.ranks`): same loop, same daemon (embedded in rank 0, bound to its node IP),
same collective walk of `iter_weights()` on every rank for every sync. Only where the processes
live differs.
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from typing import Any

import torch

__all__ = ["GREEDY_PROMPTS", "FsdpRankActor"]

logger = logging.getLogger(__name__)

GREEDY_PROMPTS = [[5, 6, 7, 8], [100, 3, 250, 17, 42]]
"""Prompts the job answers greedily at its end, on every engine and on HF with the trainer's weights."""
GREEDY_TOKENS = 8


def _node_ip() -> str:
    import ray

    return str(ray.util.get_node_ip_address())


class FsdpRankActor:
    """One FSDP2 trainer rank; rank 0 also hosts the daemon and runs the fully-async loop."""

    def __init__(self, job: dict[str, Any], rank: int, world_size: int, model_config: dict[str, Any]) -> None:
        import ray

        from ckpt_engine.trainer.config import load_job_config

        torch.set_num_threads(1)
        self.job = load_job_config(job)
        self.rank, self.world_size = rank, world_size
        self.model_config = model_config
        self.host = _node_ip()
        self.node_id = ray.get_runtime_context().get_node_id()
        self.engine: Any = None
        self.group: Any = None
        self.daemon: Any = None
        self._store: Any = None
        """The trainer group's store: rank 0's listens since `rendezvous`; the others connect in `setup`."""

    def info(self) -> dict[str, Any]:
        return {"rank": self.rank, "pid": os.getpid(), "node_ip": self.host, "node_id": self.node_id}

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0: where the trainer group meets: this node's IP and the port its store listens on,
        chosen by the OS as it binds. A port found free and bound only later, at the group's set-up,
        could be taken in between (EADDRINUSE in CI, beside Ray's own connections)."""
        from ckpt_engine.store import serve_store

        self._store = serve_store(self.host, self.group_timeout_s(), world_size=self.world_size)
        return self.host, int(self._store.port)

    def group_timeout_s(self) -> float:
        job = self.job
        # Every collective waits at most this long: a batch, a whole sync with its re-sync attempts,
        # and (rank 0 waiting for its engines) an engine start.
        bound = job.trainer.batch_timeout_s + job.rollout.start_timeout_s + 6 * job.checkpoint_engine.timeout_s * (job.daemon.max_resync_attempts + 1)
        return min(bound, job.ray.job_timeout_s)

    def setup(self, host: str, port: int) -> dict[str, Any]:
        """Join the trainer group and build this rank's shard of the model (collective)."""
        import torch.distributed as dist
        from transformers import Qwen2Config

        from ckpt_engine.trainer.engines.common import hf_model_from_config
        from ckpt_engine.trainer.engines.fsdp2 import FSDP2Config, FSDP2TrainEngine

        timeout = datetime.timedelta(seconds=self.group_timeout_s())
        if self._store is None:  # rank 0 holds the store `rendezvous` bound; the others connect to it
            self._store = dist.TCPStore(host, port, self.world_size, False, timeout=timeout)
        dist.init_process_group("gloo", store=self._store, rank=self.rank, world_size=self.world_size, timeout=timeout)
        self.group = dist.group.WORLD
        torch.manual_seed(self.job.trainer.seed)  # identical initial weights on every rank
        model = hf_model_from_config(Qwen2Config(**self.model_config), torch.float32, attn_implementation="eager")
        kwargs = {"lr": self.job.trainer.lr, "wire_dtype": None, **self.job.trainer.engine_kwargs}
        self.engine = FSDP2TrainEngine(model, config=FSDP2Config(**kwargs), process_group=self.group)
        return self.info()

    def start_daemon(self, token: str) -> str:
        """Rank 0: the embedded daemon on this node's IP; engines register with it by name."""
        from ckpt_engine.daemon import WeightSyncDaemon
        from ckpt_engine.trainer.ray_engine_client import register_ray_vllm_kind

        register_ray_vllm_kind()
        self.daemon = WeightSyncDaemon(self.job.checkpoint_engine, self.job.daemon, token=token, rendezvous_host=self.host)
        self.daemon.serve(host=self.host)
        return str(self.daemon.address)

    def follow(self) -> dict[str, int]:
        """Ranks > 0: do what rank 0 announces until it says STOP."""
        from ckpt_engine.trainer.lm_task import TokenTask
        from ckpt_engine.trainer.ranks import follow_leader

        try:
            return follow_leader(self.engine, self.group, TokenTask(self.job.rollout.vocab_size), self.job.checkpoint_engine)
        finally:
            torch.distributed.destroy_process_group()

    def lead(self, engine_names: list[str], echo: bool = False) -> dict[str, Any]:
        """Rank 0: wait for the engines to register, then train; returns the job summary."""
        from ckpt_engine.trainer.summary import format_summary, format_sync, summarize
        from ckpt_engine.trainer.lm_task import TokenTask
        from ckpt_engine.trainer.loop import FullyAsyncTrainer, SyncRecord
        from ckpt_engine.trainer.ranks import DataParallelLeader
        from ckpt_engine.trainer.ray_engine_client import RayVllmGenerator

        job, daemon = self.job, self.daemon
        if daemon is None:
            raise RuntimeError("start_daemon() must run on rank 0 before lead()")
        say = (lambda line: print(line, flush=True)) if echo else (lambda line: None)
        task = TokenTask(job.rollout.vocab_size)
        leader = DataParallelLeader(self.engine, self.group)
        generators: list[RayVllmGenerator] = []
        try:
            t0 = time.monotonic()
            deadline = t0 + job.rollout.start_timeout_s
            while set(engine_names) - {e["name"] for e in daemon.members()["engines"]}:
                if time.monotonic() > deadline:
                    missing = sorted(set(engine_names) - {e["name"] for e in daemon.members()["engines"]})
                    raise RuntimeError(f"engine(s) {', '.join(missing)} did not register within rollout.start_timeout_s={job.rollout.start_timeout_s:.0f}s")
                time.sleep(0.2)
            engines_up_s = time.monotonic() - t0
            say(f"{len(engine_names)} vLLM engine actor(s) registered with the daemon at {daemon.address}")
            generators = [RayVllmGenerator(n, self._resolver(n), task, token=daemon.token, timeout_s=job.checkpoint_engine.timeout_s) for n in engine_names]

            def on_sync(rec: SyncRecord) -> None:
                say(format_sync(rec, trainer.steps[-1] if trainer.steps else None))

            trainer = FullyAsyncTrainer(job, leader, daemon, generators, on_sync=on_sync, task=task, peers=leader)
            trainer.sync(0, "initial")
            prompts = torch.arange(job.rollout.vocab_size)
            before = {g.name: _as_list(g.greedy(prompts)) for g in generators}
            summary = trainer.run(initial_sync=False)
            after = {g.name: _as_list(g.greedy(prompts)) for g in generators}
            result = summarize(job, summary, before, after, task.answer(prompts))
            weights = self._walk_weights(leader)
            result["hf_greedy"] = _hf_greedy(self.model_config, weights)
            result["engine_greedy"] = {g.name: g.complete(GREEDY_PROMPTS, GREEDY_TOKENS) for g in generators}
            result["discarded_requests"] = {g.name: g.discarded for g in generators}
            result["engines_up_s"] = engines_up_s
            result["status"] = {k: daemon.status()[k] for k in ("departed", "history")}
            for line in format_summary(job, result):
                say(line)
            return result
        finally:
            leader.stop()
            for g in generators:
                g.close()
            daemon.close()
            torch.distributed.destroy_process_group()

    def _resolver(self, name: str) -> Any:
        def resolve() -> tuple[str, int] | None:
            rec = self.daemon.membership.get(name)
            return None if rec is None else (str(rec.engine["host"]), int(rec.engine["port"]))

        return resolve

    def _walk_weights(self, leader: Any) -> dict[str, torch.Tensor]:
        """One more collective walk (the followers take it for a sync) that keeps full HF tensors."""
        barrier = leader.announce_sync()
        weights = {n: t.detach().clone() for n, t in self.engine.source.iter_weights()}
        barrier(False)
        return weights


def _as_list(t: torch.Tensor | None) -> list[int] | None:
    return None if t is None else [int(v) for v in t.tolist()]


@torch.no_grad()
def _hf_greedy(model_config: dict[str, Any], weights: dict[str, torch.Tensor]) -> list[list[int]]:
    """Greedy tokens of an HF model holding `weights` (the reference the engines must match)."""
    from transformers import Qwen2Config

    from ckpt_engine.trainer.engines.common import hf_model_from_config

    model: Any = hf_model_from_config(Qwen2Config(**model_config), torch.float32, attn_implementation="eager").eval()  # transformers' Qwen2ForCausalLM (not read by the type checker)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"trainer weights do not fit the HF model: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    out = []
    for prompt in GREEDY_PROMPTS:
        ids = torch.tensor([prompt])
        tokens: list[int] = []
        for _ in range(GREEDY_TOKENS):
            nxt = int(model(ids).logits[0, -1].argmax())
            tokens.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
        out.append(tokens)
    return out
