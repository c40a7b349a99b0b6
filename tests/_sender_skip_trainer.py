"""A trainer rank for tests/test_sync_senders_rank0_fails.py: two gloo ranks sync three versions
with `senders=all` into reference engines; rank 0 asks for an explicit version per step (the
second repeats the first, which rank 0 refuses before anything is sent) and may pass no engines at
one step (refused before any announcement). JSON log, no pickle."""

from __future__ import annotations

import datetime
import json
import os
from typing import Any

import torch

from ckpt_engine import CheckpointEngineConfig, sync_rollout_weights
from ckpt_engine.rollout_adapters.torch_ref import TorchRefRollout
from ckpt_engine.benchmark.sharded_source import ShardedStateDictSource
from multisender import model_state, wire


def skip_trainer_main(
    rank: int, world: int, port: int, engines: list[dict[str, Any]], out_dir: str, versions: list[int | None], timeout_s: float,
    no_engines_at: int | None = None, bad_join_at: int | None = None,
) -> None:
    """Every rank logs each step's outcome and carries on to the next step (as a training loop that
    catches a failed sync would): the ranks must stay in step after a failure on rank 0. At step
    `no_engines_at` rank 0 passes no engines (refused before any announcement); at step
    `bad_join_at` the sync runs over nccl_handoff (gloo on CPU) with `local_senders` naming a sender
    the group lacks: every rank's join fails after rank 0 announced the group, as an engine's join
    that fails on a device would."""
    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    config = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.0625, timeout_s=timeout_s, senders="all")
    bad = CheckpointEngineConfig(
        backend="nccl_handoff", bucket_size_mb=0.0625, timeout_s=timeout_s, senders="all", engine_kwargs={"nccl_handoff": {"local_senders": [5]}},
    )
    handles = [TorchRefRollout(e["name"], e["host"], e["port"], None, timeout_s, token=e["token"]) for e in engines] if rank == 0 else None
    log: list[dict[str, Any]] = []
    for step, version in enumerate(versions):
        source = ShardedStateDictSource(wire(model_state(step, lr=1e-5)), rank, world)
        source.is_sender = rank == 0
        try:
            report = sync_rollout_weights(
                source, None if step == no_engines_at else handles, version=version, config=bad if step == bad_join_at else config,
            )
            log.append({"ok": True, "version": report.version if report is not None else None})
        except Exception as exc:  # noqa: BLE001 - the test reads what happened
            log.append({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(log, f)
    from ckpt_engine.sync.api import close_sessions

    close_sessions()
    torch.distributed.destroy_process_group()
