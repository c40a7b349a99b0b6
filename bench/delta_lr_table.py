"""What a user's learning rate and step count do to a delta sync: a small table, on a CPU.

Versions come from the delta bench's own generator (`ckpt_engine.benchmark.versions.AdamWChain`:
fp32 masters, std 0.02 matrices and ones for norms, torch AdamW with Gaussian gradients of scale
1e-3, two warm-up steps, bf16 wire). For each lr the chain runs 8 more steps; version 1 is the
engines' base and version 1 + k the next sync after k optimizer steps. Reported per cell: the
fraction of bf16 words that changed and the patch bytes that `ckpt_engine.delta.codec.encode`
writes (per tensor, the smaller encoding, dense where no patch is smaller) over the dense bytes.

The shapes are Qwen2.5-7B's decoder layer(s) and embeddings with every tensor's rows cut to a
fraction (default 1/8) and the vocabulary reduced: changes are elementwise, so which and how many
words change does not depend on a tensor's row count, and the run takes ~2 minutes.

    python bench/delta_lr_table.py [--layers 1] [--rows-div 8] [--vocab 4096] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from rich.console import Console
from rich.table import Table

from ckpt_engine.benchmark.presets import checkpoint_specs, load_preset_config
from ckpt_engine.benchmark.versions import AdamWChain, MemoryVersions
from ckpt_engine.delta import codec
from ckpt_engine.manifest import TensorSpec

LRS = (1e-7, 1e-6, 3e-6, 1e-5, 3e-5, 1e-4)
STEPS = (1, 2, 4, 8)


def table_specs(layers: int, rows_div: int, vocab: int) -> list[TensorSpec]:
    config = dict(load_preset_config("qwen2.5-7b"), vocab_size=vocab)
    specs = checkpoint_specs(config, dtype="bfloat16", num_layers=layers)
    return [TensorSpec(s.name, s.dtype, (max(1, s.shape[0] // rows_div), *s.shape[1:])) for s in specs]


def patch_stats(base: list[torch.Tensor], new: list[torch.Tensor]) -> tuple[float, float]:
    """(changed fraction of words, patch bytes / dense bytes) over every tensor."""
    changed = words = wire = dense = 0
    for b, n in zip(base, new):
        bu, nu = b.reshape(-1).view(torch.uint8), n.reshape(-1).view(torch.uint8)
        changed += int((b.reshape(-1).view(torch.int16) != n.reshape(-1).view(torch.int16)).sum())
        words += b.numel()
        out = torch.empty(codec.max_patch_bytes(nu.numel(), 2), dtype=torch.uint8)
        size = codec.encode(bu, nu, 2, out)
        wire += nu.numel() if size is None else size
        dense += nu.numel()
    return changed / words, wire / dense


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--rows-div", type=int, default=8, help="divide every tensor's rows by this")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--json", default=None, help="write the cells as JSON to this file")
    args = p.parse_args()
    specs = table_specs(args.layers, args.rows_div, args.vocab)
    params = sum(s.numel for s in specs)
    count = 1 + max(STEPS)
    cells: list[dict[str, float]] = []
    t0 = time.perf_counter()
    for lr in LRS:
        chain = AdamWChain(lr=lr)
        store = MemoryVersions(specs, count, torch.device("cpu"))
        chain.generate(specs, count, torch.device("cpu"), store.sink)
        for k in STEPS:
            changed, wire = patch_stats(store.versions[0], store.versions[k])
            cells.append({"lr": lr, "steps": k, "changed_fraction": changed, "wire_fraction": wire})
    seconds = time.perf_counter() - t0
    table = Table(title=f"bf16 words changed / patch wire bytes over dense ({params / 1e6:.1f} M params, {seconds:.0f} s)")
    table.add_column("lr \\ optimizer steps between syncs")
    for k in STEPS:
        table.add_column(str(k), justify="right")
    for lr in LRS:
        row = [c for c in cells if c["lr"] == lr]
        table.add_row(f"{lr:g}", *(f"{100 * c['changed_fraction']:.2f}% / {100 * c['wire_fraction']:.1f}%" for c in row))
    Console().print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"layers": args.layers, "rows_div": args.rows_div, "vocab": args.vocab, "params": params, "seconds": seconds, "cells": cells}, f, indent=2)


if __name__ == "__main__":
    main()
