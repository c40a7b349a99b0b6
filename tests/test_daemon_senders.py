"""The trainer loop's syncs through the daemon with every FSDP2 rank sending its own shards.

Two real gloo ranks hold an FSDP2 model. Rank 0 runs what the demo's rank 0 runs: the daemon
(reference engines in their own processes, `senders=all`, `delta=on`), `DataParallelLeader` and
`FullyAsyncTrainer.sync`; rank 1 runs `follow_leader` (it trains on its rows and, per sync,
follows rank 0's announcements through `sync_rollout_weights(engine.source, None)`). A sync with no
engine registered ends on both ranks; then every sync reports two senders, the chain is a seed
then patches, and at the end both engines hold the gathered model bit for bit. A last sync
after rank 0's masters were edited outside a step must carry the edit.
"""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
import torch

from tests._trainer_mp import run_ranks, world_group
from tests.test_trainer_fsdp2 import build_model, collect, engine_config, tiny_config
from refengines import spawn_engine

pytestmark = pytest.mark.timeout(300)

TOKEN = "test-daemon-senders-token"
SYNCS = 3
PRELOAD = ("torch.distributed.fsdp", "transformers.models.qwen2.modeling_qwen2", "ckpt_engine.trainer.engines.fsdp2", "ckpt_engine.daemon")


def _job(senders: str) -> Any:
    from ckpt_engine.trainer.config import load_job_config

    return load_job_config(None, [
        "checkpoint_engine.backend=gloo", "checkpoint_engine.bucket_size_mb=0.05", "checkpoint_engine.timeout_s=60",
        "checkpoint_engine.delta=on", f"checkpoint_engine.senders={senders}", "daemon.heartbeat_timeout_s=0", "rollout.vocab_size=16",
    ])


def _worker(rank: int, world_size: int, engines: list[dict[str, Any]], senders: str) -> dict[str, Any]:
    from ckpt_engine.trainer.lm_task import TokenTask
    from ckpt_engine.trainer.ranks import follow_leader
    from ckpt_engine.trainer.engines.fsdp2 import FSDP2TrainEngine

    job = _job(senders)
    task = TokenTask(job.rollout.vocab_size)
    engine = FSDP2TrainEngine(build_model(tie=True), config=engine_config(wire_dtype="bfloat16", lr=1e-5), process_group=world_group())  # RL-like: int32-position patches pay below ~1/3 changed bf16 words
    if rank != 0:
        counts = follow_leader(engine, world_group(), task, job.checkpoint_engine)
        collect(engine)  # the gather at the end is a collective
        return {"counts": counts}
    return _lead(job, engine, task, engines)


def _lead(job: Any, engine: Any, task: Any, handles: list[dict[str, Any]]) -> dict[str, Any]:
    from ckpt_engine.daemon import WeightSyncDaemon
    from ckpt_engine.rollout_adapters.torch_ref import TorchRefRollout
    from ckpt_engine.trainer.loop import FullyAsyncTrainer
    from ckpt_engine.trainer.ranks import DataParallelLeader

    engines = [TorchRefRollout(h["name"], h["host"], h["port"], None, 60, token=TOKEN) for h in handles]
    leader = DataParallelLeader(engine, world_group())
    daemon = WeightSyncDaemon(job.checkpoint_engine, job.daemon, token=TOKEN)
    try:
        trainer = FullyAsyncTrainer(job, leader, daemon, [], task=task, peers=leader)
        # An attempt that ends before any group exists: rank 1 still finishes it with rank 0.
        empty = trainer.sync(0, "no engines")
        assert not empty.ok and empty.error == "no engines are registered", empty.error
        for r in engines:
            daemon.register(r.name, {"kind": "torch_ref", "host": r.rpc.host, "port": r.rpc.port})  # as the demo does
        g = torch.Generator().manual_seed(7)
        records = []
        for step in range(SYNCS):
            if step:
                prompts = task.prompts(8, g)
                actions = torch.randint(0, job.rollout.vocab_size, (8,), generator=g)
                batch = task.to_batch({"prompts": prompts, "actions": actions, "rewards": task.reward(prompts, actions)})
                leader.train_mode()
                leader.forward_backward(batch, task.loss_fn)
                leader.optimizer_step()
                trainer._stepped_since_sync = True  # what FullyAsyncTrainer.run() notes after a step
            outcome = trainer.sync(step, "test")
            assert outcome.ok, outcome.error
            rec = trainer.syncs[-1]
            records.append({"version": rec.version, "delta": rec.delta, "senders": rec.senders, "wire": rec.wire_bytes, "dense": rec.dense_bytes})
        # A write to rank 0's masters outside the optimizer step (a user's own edit): the next sync
        # must carry it, under a new version (one version labels one set of weights: the same
        # version again is refused).
        with torch.no_grad():
            local = next(engine.model.parameters()).to_local()
            local.view(-1)[:5].add_(0.01)
        trainer._stepped_since_sync = True  # what a user who changed the weights tells the loop
        outcome = trainer.sync(SYNCS, "edited")
        assert outcome.ok, outcome.error
        rec = trainer.syncs[-1]
        edited = {"delta": rec.delta, "wire": rec.wire_bytes, "dense": rec.dense_bytes}
        leader.stop()
        expected = collect(engine)
        got = {f"{r.name}/{n}": r.get_tensor(n) for r in engines for n in expected}
        return {"records": records, "tensors": {**{f"exp/{k}": v for k, v in expected.items()}, **got}, "edited": edited}
    finally:
        leader.stop()
        daemon.close()
        for r in engines:
            r.close()


def test_loop_syncs_through_the_daemon_from_every_rank() -> None:
    senders = "all"  # (senders=rank0, the demo's path: tests/test_demo.py, tests/test_trainer_fsdp2.py)
    with tempfile.TemporaryDirectory() as d:
        tiny_config(tie=True).save_pretrained(d)
        engines = [spawn_engine(f"ref{i}", model_dir=d, dtype="bfloat16", timeout_s=60, token=TOKEN) for i in range(2)]
        try:
            handles = [{"name": e.name, "host": e.rpc.host, "port": e.rpc.port} for e in engines]
            r0, r1 = run_ranks(_worker, engines=handles, senders=senders, preload=PRELOAD)
        finally:
            for e in engines:
                e.close()
    assert r1["counts"] == {"steps": SYNCS - 1, "syncs": SYNCS + 2}
    assert r0["edited"]["delta"] == "patch" and r0["edited"]["wire"] < r0["edited"]["dense"], r0["edited"]
    records = r0["records"]
    assert [r["version"] for r in records] == list(range(1, SYNCS + 1))
    assert [r["senders"] for r in records] == [2 if senders == "all" else 1] * SYNCS
    assert [r["delta"] for r in records] == ["seed"] + ["patch"] * (SYNCS - 1)
    assert all(r["wire"] < r["dense"] for r in records[1:]), records
    t = r0["tensors"]
    names = [k[4:] for k in t if k.startswith("exp/")]
    assert names
    for name in names:
        for e in ("ref0", "ref1"):
            assert torch.equal(t[f"{e}/{name}"], t[f"exp/{name}"]), f"{e} {name}"
