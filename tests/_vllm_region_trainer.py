"""A trainer rank for the vLLM region test with two senders: joins a gloo trainer group and syncs
each version file (safetensors) into a vLLM HTTP server with `senders=all`; writes a JSON log."""

from __future__ import annotations

import datetime
import json
import os
from typing import Any

import torch


def vllm_region_trainer_main(rank: int, world: int, port: int, url: str, files: list[str], out_dir: str) -> None:
    from safetensors.torch import load_file

    from ckpt_engine import CheckpointEngineConfig, sync_rollout_weights
    from ckpt_engine.rollout_adapters.vllm import VllmServerRollout
    from ckpt_engine.benchmark.sharded_source import ShardedStateDictSource

    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120)
    )
    cfg = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.25, timeout_s=120, delta="on", senders="all")
    handles = [VllmServerRollout("vllm-http-tp2", url, timeout_s=120.0)] if rank == 0 else None
    log: list[dict[str, Any]] = []
    try:
        for path in files:
            source = ShardedStateDictSource(load_file(path), rank, world)
            source.is_sender = rank == 0  # rank 0 drives the sync; with senders=all every rank sends its rows
            try:
                report = sync_rollout_weights(source, handles, config=cfg)
                log.append({"ok": True, "delta": report.delta if report else None, "senders": report.senders if report else None,
                            "received": report.received_bytes if report else None})
            except Exception as exc:
                log.append({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
                break
    finally:
        from ckpt_engine.sync.api import close_sessions

        close_sessions()  # the engines leave this job's group: the test's next session may claim them
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(log, f)
