"""One FSDP2 trainer rank for tests/test_vllm_cuda.py: shards an HF model (bf16, built from a seed)
over the trainer ranks' GPUs and syncs it into a vLLM server through `sync_rollout_weights`, every
rank sending its own shards (`senders: all`). Writes its reports as JSON (no pickle)."""

from __future__ import annotations

import datetime
import json
import os
from typing import Any

import torch


def trainer_rank(
    rank: int, world: int, port: int, devices: list[int], backend: str, url: str, model_dir: str, seeds: list[int], out_dir: str,
) -> None:
    import transformers
    from torch.distributed.fsdp import fully_shard

    from ckpt_engine import CheckpointEngineConfig, sync_rollout_weights
    from ckpt_engine.rollout_adapters.vllm import VllmServerRollout
    from ckpt_engine.sources.fsdp2 import FSDP2Source

    torch.cuda.set_device(devices[rank])
    torch.distributed.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=90),
        device_id=torch.device("cuda", devices[rank]),
    )
    config = transformers.AutoConfig.from_pretrained(model_dir)
    handle = VllmServerRollout("vllm-fsdp2", url, timeout_s=60.0) if rank == 0 else None
    sync_config = CheckpointEngineConfig(backend=backend, timeout_s=60.0, senders="all")
    log: list[dict[str, Any]] = []
    try:
        for seed in seeds:
            torch.manual_seed(seed)  # the test's hf_model(): the same init on CPU, then to the GPU
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).to(f"cuda:{devices[rank]}")
            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model)
            report = sync_rollout_weights(FSDP2Source(model), [handle] if handle is not None else None, config=sync_config)
            if report is not None:
                log.append({"seed": seed, "version": report.version, "senders": report.senders, "staged": report.staged,
                            "wire_per_sender": report.wire_bytes_per_sender})
            del model
    except Exception as exc:  # noqa: BLE001 - the test reads what happened
        log.append({"error": f"{type(exc).__name__}: {exc}"})
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(log, f)
        torch.distributed.destroy_process_group()
