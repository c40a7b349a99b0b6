"""Write a weight source as a Hugging Face safetensors checkpoint (sharded files + index).

Collective contract: every trainer rank calls `save_hf_weights` (it walks `iter_weights()`, whose
gathers are collectives); only the sender rank writes files. Shards are planned from `metadata()`
before anything is gathered, so file names (`model-00001-of-0000N.safetensors`) are final when the
first one is written and at most one shard is held in host memory.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import torch

from ckpt_engine.manifest import TensorSpec
from ckpt_engine.sources.base import WeightSource

__all__ = ["plan_shards", "save_hf_weights"]

logger = logging.getLogger(__name__)


def plan_shards(specs: list[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Consecutive groups of at most `max_shard_bytes` (a larger tensor gets a shard of its own)."""
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for s in specs:
        if shards[-1] and size + s.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(s)
        size += s.nbytes
    return [s for s in shards if s]


def save_hf_weights(
    source: WeightSource,
    path: str | os.PathLike[str],
    *,
    max_shard_bytes: int = 5 * 1024**3,
    hf_config: Any = None,
) -> list[str]:
    """Walk `source.iter_weights()` on every rank; the sender writes safetensors shards to `path`.

    Returns the files written (empty on non-sender ranks). `hf_config` (a transformers config) is
    saved beside the weights when given, so the directory loads with `from_pretrained`.
    """
    from safetensors.torch import save_file

    specs = list(source.metadata())
    shards = plan_shards(specs, max_shard_bytes)
    sender = source.is_sender
    if sender:
        os.makedirs(path, exist_ok=True)
    n = len(shards)
    files: list[str] = []
    weight_map: dict[str, str] = {}
    it = iter(source.iter_weights())
    for i, shard in enumerate(shards):
        fname = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        held: dict[str, torch.Tensor] = {}
        for spec in shard:
            name, t = next(it)
            if name != spec.name:
                raise ValueError(f"the weight source yielded {name!r} where its metadata put {spec.name!r}")
            if sender:
                held[name] = t.detach().to("cpu", copy=True).contiguous()
                weight_map[name] = fname
        if sender:
            save_file(held, os.path.join(path, fname), metadata={"format": "pt"})
            files.append(os.path.join(path, fname))
    if next(it, None) is not None:
        raise ValueError("the weight source yielded more tensors than its metadata lists")
    if sender:
        if n > 1:
            index = {"metadata": {"total_size": sum(s.nbytes for s in specs)}, "weight_map": weight_map}
            with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
                json.dump(index, f, indent=2)
        if hf_config is not None:
            hf_config.save_pretrained(path)
        logger.info("wrote %d tensors in %d safetensors files to %s", len(specs), n, path)
    return files
