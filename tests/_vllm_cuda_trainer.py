"""One FSDP2 trainer rank for tests/test_vllm_cuda.py (GPUs, nccl) and tests/test_vllm_fsdp2_senders.py
(CPU, gloo): shards an HF model (built from a seed) over the trainer ranks and syncs it into a vLLM
server through `sync_rollout_weights`, every rank sending its own shards (`senders: all`). Writes
its reports, or the error that ended its loop, as JSON (no pickle)."""

from __future__ import annotations

import datetime
import json
import logging
import os
import traceback
from typing import Any

import torch


def trainer_rank(
    rank: int, world: int, port: int, devices: list[int] | None, backend: str, url: str, model_dir: str, seeds: list[int], out_dir: str,
    engine_kwargs: dict[str, Any] | None = None, dtype: str = "bfloat16", verify_installed: str | int = "first",
) -> None:
    """`devices`: each rank's GPU (nccl trainer group), or None for CPU ranks (gloo). Each sync's
    outcome is written to rank{rank}.json as it happens, so a later hang still leaves the record
    (with the bytes each engine rank received)."""
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ckpt_engine import CheckpointEngineConfig, sync_rollout_weights
    from ckpt_engine.rollout_adapters.vllm import VllmServerRollout
    from ckpt_engine.sources.fsdp2 import FSDP2Source
    from ckpt_engine.sync.api import close_sessions

    logging.basicConfig(level=logging.INFO, format=f"trainer rank {rank} %(asctime)s %(name)s %(levelname)s: %(message)s")
    if devices is not None:
        torch.cuda.set_device(devices[rank])
        device = torch.device("cuda", devices[rank])
        torch.distributed.init_process_group(
            "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=90),
            device_id=device,
        )
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
        torch.distributed.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=90),
        )
    mesh = init_device_mesh(device.type, (world,))
    config = transformers.AutoConfig.from_pretrained(model_dir)
    handle = VllmServerRollout("vllm-fsdp2", url, timeout_s=60.0) if rank == 0 else None
    sync_config = CheckpointEngineConfig(backend=backend, timeout_s=60.0, senders="all", engine_kwargs=engine_kwargs or {},
                                        verify_installed=verify_installed)
    log: list[dict[str, Any]] = []

    def write() -> None:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(log, f)

    try:
        for seed in seeds:
            torch.manual_seed(seed)  # the test's hf_model(): the same init on CPU, then to the device
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype)).to(device)
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            report = sync_rollout_weights(FSDP2Source(model), [handle] if handle is not None else None, config=sync_config)
            if report is not None:
                log.append({"seed": seed, "version": report.version, "senders": report.senders, "staged": report.staged,
                            "wire_per_sender": report.wire_bytes_per_sender, "bytes": report.bytes,
                            "received": report.received_bytes.get("vllm-fsdp2")})
                write()
            del model
    except Exception as exc:  # noqa: BLE001 - the test reads what happened
        logging.getLogger(__name__).exception("trainer rank %d: the sync failed", rank)  # on stderr too: a pytest timeout shows it
        log.append({"error": f"{type(exc).__name__}: {exc}", "where": traceback.format_exc(limit=12)})
        write()
    finally:
        write()
        close_sessions()  # the engine leaves this job's group (and the follower its own)
        torch.distributed.destroy_process_group()
