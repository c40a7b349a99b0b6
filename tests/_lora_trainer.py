"""One rank of a 2-rank FSDP2 trainer of a PEFT LoRA adapter on a tiny Qwen2 (gloo), for test_lora_vllm.

Rank 0 runs inside the test process (it holds the vLLM engine); rank 1 runs this file as a script:
`python tests/_lora_trainer.py '{"port": P, "model_dir": D, "syncs": N, "die_at_sync": K}'`. Both
train one step per sync, then walk the adapter (the HF reference) and sync it; rank 1 exits by
itself (`os._exit`) in sync `die_at_sync`, before its own pieces go out, as a sender killed mid-sync would.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

LORA = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj", "down_proj"]}
STEP_LR = 0.05


def peft_model(model_dir: str, lora: dict[str, Any] | None = None) -> torch.nn.Module:
    """The base from `model_dir` (fp32) with a fresh LoRA adapter (same seed on every rank)."""
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(1)
    return peft.get_peft_model(base, peft.LoraConfig(**(lora if lora is not None else LORA), init_lora_weights="gaussian"))


def lm_loss(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    ids = batch["input_ids"]
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))


def train_and_sync(
    rank: int, model_dir: str, syncs: int, rollouts: Any, config: Any, *,
    after_sync: Callable[[int, dict[str, torch.Tensor]], None] | None = None, fail_at: int = -1, die: bool = False,
) -> list[BaseException]:
    """`syncs` rounds of: one training step, walk the adapter (every rank), sync it (every rank).
    Sync `fail_at` is expected to fail (its error is returned); with `die` this rank dies in it."""
    from ckpt_engine.sync.api import sync_rollout_weights
    from ckpt_engine.trainer.engines.fsdp2 import FSDP2Config, FSDP2TrainEngine

    group = dist.group.WORLD
    engine = FSDP2TrainEngine(
        peft_model(model_dir),
        config=FSDP2Config(lr=STEP_LR, wire_dtype=None, max_grad_norm=None, weights="adapters"),
        process_group=group,
    )
    for step in range(syncs):
        g = torch.Generator().manual_seed(100 + 10 * step + rank)
        batch = {"input_ids": torch.randint(3, 500, (2, 16), generator=g)}
        engine.forward_backward(batch, lm_loss)
        engine.optimizer_step()
        reference = {n: t.clone() for n, t in engine.source.iter_weights()}
        if step == fail_at and die:
            # Dies once the sync has been announced, validated and the engines are receiving, before
            # this rank's pieces went out: a sender killed mid-sync.
            engine.source.begin_pieces = lambda: os._exit(9)  # type: ignore[method-assign]
        try:
            sync_rollout_weights(engine.source, rollouts, config=config)
        except Exception as exc:
            if step != fail_at:
                raise
            return [exc]
        if after_sync is not None:
            after_sync(step, reference)
    return []


def init_group(rank: int, port: int, timeout_s: float) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=timeout_s))


def main() -> None:
    from ckpt_engine import CheckpointEngineConfig

    job = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    init_group(1, job["port"], job["timeout_s"])
    config = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.25, timeout_s=job["timeout_s"], weights="adapters")
    train_and_sync(1, job["model_dir"], job["syncs"], None, config, fail_at=job["die_at_sync"], die=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
