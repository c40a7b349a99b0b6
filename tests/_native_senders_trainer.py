"""A trainer rank for the many-senders test through vLLM's weight-transfer API: joins a gloo trainer
group and syncs each version file (safetensors) into a native-backend vLLM server with
`senders=all` (rank 0 holds `VllmRollout` over a `WeightTransferChannel`); writes a JSON log."""

from __future__ import annotations

import datetime
import json
import os
from typing import Any

import torch


def native_senders_trainer_main(rank: int, world: int, port: int, url: str, files: list[str], out_dir: str) -> None:
    from safetensors.torch import load_file

    from ckpt_engine import CheckpointEngineConfig, sync_rollout_weights
    from ckpt_engine.rollout_adapters.vllm import VllmRollout, WeightTransferChannel
    from ckpt_engine.rollout_adapters.vllm.clients import HTTPWeightSyncClient
    from ckpt_engine.benchmark.sharded_source import ShardedStateDictSource
    from ckpt_engine.sync.api import close_sessions

    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120)
    )
    cfg = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.25, timeout_s=120, delta="on", senders="all", stage="off")
    client = HTTPWeightSyncClient(url, timeout=120.0)
    handles = [VllmRollout("vllm-native", WeightTransferChannel(client), timeout_s=120.0)] if rank == 0 else None
    log: list[dict[str, Any]] = []
    try:
        for path in files:
            source = ShardedStateDictSource(load_file(path), rank, world)
            source.is_sender = rank == 0  # rank 0 drives the sync; with senders=all every rank sends its rows
            try:
                report = sync_rollout_weights(source, handles, config=cfg)
                log.append({"ok": True, "delta": report.delta if report else None, "senders": report.senders if report else None})
            except Exception as exc:
                log.append({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
                break
    finally:
        close_sessions()  # the engine leaves this job's group
        client.close()
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(log, f)
