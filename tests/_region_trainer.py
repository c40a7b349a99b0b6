"""A trainer rank for the region-delivery many-sender test: joins a gloo trainer group, syncs
versions of the tiny Qwen2 through `sync_rollout_weights` with `senders=all`, writes a JSON log."""

from __future__ import annotations

import datetime
import json
import os
from typing import Any

import torch

from ckpt_engine import CheckpointEngineConfig, sync_rollout_weights
from ckpt_engine.rollout_adapters.torch_ref import TorchRefRollout
from ckpt_engine.sources.sharded import ShardedStateDictSource
from regionranks import qwen2_specs, weights


def region_trainer_main(rank: int, world: int, port: int, engines: list[dict[str, Any]], out_dir: str, versions: int) -> None:
    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30)
    )
    cfg = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.0625, timeout_s=20, delta="on", senders="all")
    handles = [TorchRefRollout(e["name"], e["host"], e["port"], None, 20, token=e["token"]) for e in engines] if rank == 0 else None
    log: list[dict[str, Any]] = []
    for v in range(versions):
        source = ShardedStateDictSource(weights(qwen2_specs(), v), rank, world)
        source.is_sender = rank == 0
        try:
            report = sync_rollout_weights(source, handles, config=cfg)
            log.append({"ok": True, "delta": report.delta if report else None, "senders": report.senders if report else None,
                        "received": report.received_bytes if report else None})
        except Exception as exc:
            log.append({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
            break
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(log, f)
