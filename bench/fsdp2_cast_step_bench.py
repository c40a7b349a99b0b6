"""What recording the casts (`delta_base: cast`) costs an FSDP2 trainer's optimizer step.

One FSDP2 rank (a world of one: NCCL on a GPU, gloo on a CPU) holds a preset's shapes as fp32
masters with a bf16 wire. Gradients are set to random values of --grad-scale before each step (no
forward pass: the step is what is timed), so AdamW at --lr moves a realistic share of bf16 words.
Median of --repeats steps per row, after a warm-up:
  plain     : `optimizer_step()` with no recorder (what a trainer pays without `cast`)
  recorded 1: the first step after a sync with the adapter's shadows bound to a recorder of
              --bucket-mb buckets (the step also casts every master into its shadow and records
              each bucket's changed words)
  recorded k: the k-th step since the sync (records on top of the patch, then merges)
Also prints the memory the shadows and the patch areas take, the patch share after k steps, and
whether every shadow equals torch's cast of its master at the end.

    python bench/fsdp2_cast_step_bench.py --preset qwen2.5-7b --layers 8 --lr 1e-6 --json out.json
    python bench/fsdp2_cast_step_bench.py --device cpu --preset qwen2.5-7b --layers 1 --repeats 1   # smoke test
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from ckpt_engine.benchmark.presets import load_preset_config
from ckpt_engine.delta.recorder import CastBucket, CastRecorder, CastSlice


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _buckets(specs: list[Any], bucket_bytes: int) -> list[CastBucket]:
    """The bf16 tensors in checkpoint order, cut into buckets of `bucket_bytes` (a tensor larger
    than a bucket spans several), as a one-sender plan lays them out."""
    buckets: list[CastBucket] = []
    slices: list[CastSlice] = []
    at = 0
    for spec in specs:
        if spec.dtype != "bfloat16":
            continue
        nbytes, done = 2 * int(torch.Size(spec.shape).numel()), 0
        while done < nbytes:
            take = min(nbytes - done, bucket_bytes - at)
            slices.append(CastSlice(spec.name, tuple(spec.shape), "bfloat16", 0, done, take, at))
            done, at = done + take, at + take
            if at == bucket_bytes:
                buckets.append(CastBucket(len(buckets), at, 2, tuple(slices)))
                slices, at = [], 0
    if slices:
        buckets.append(CastBucket(len(buckets), at, 2, tuple(slices)))
    return buckets


def _step(engine: Any, device: torch.device, scale: float, g: torch.Generator) -> float:
    """Set every gradient (untimed), then time one optimizer step."""
    for p in engine.model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        noise = torch.randn(local.shape, generator=g, device=device) * scale
        p.grad = torch.distributed.tensor.DTensor.from_local(noise, p.device_mesh, p.placements) if hasattr(p, "device_mesh") else noise
    _sync(device)
    t0 = time.perf_counter()
    engine.optimizer_step()
    _sync(device)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen2.5-7b")
    p.add_argument("--layers", type=int, default=4, help="decoder layers kept from the preset")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--grad-scale", type=float, default=1e-3)
    p.add_argument("--steps-between", type=int, default=3, help="steps between two syncs (k)")
    p.add_argument("--bucket-mb", type=int, default=1024)
    p.add_argument("--scatter-below", type=float, default=0.25)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()

    from transformers import AutoConfig

    from ckpt_engine.trainer_adapters.common import hf_model_from_config
    from ckpt_engine.trainer_adapters.fsdp2 import FSDP2Config, FSDP2TrainEngine

    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=0, world_size=1)
    config = load_preset_config(args.preset)
    config["num_hidden_layers"] = args.layers
    if "layer_types" in config:
        config["layer_types"] = config["layer_types"][: args.layers]
    if "max_window_layers" in config:
        config["max_window_layers"] = min(config["max_window_layers"], args.layers)
    with torch.device("meta"):
        model = hf_model_from_config(AutoConfig.for_model(**config), torch.float32)
    engine = FSDP2TrainEngine(model, config=FSDP2Config(lr=args.lr, weight_decay=0.0, wire_dtype="bfloat16", max_grad_norm=None),
                              process_group=dist.group.WORLD, device=device)
    engine.materialize()
    g = torch.Generator(device=device).manual_seed(0)
    _step(engine, device, args.grad_scale, g)  # warm-up: AdamW's state
    plain = [_step(engine, device, args.grad_scale, g) for _ in range(args.repeats)]
    buckets = _buckets(engine.metadata(), args.bucket_mb << 20)
    rec = CastRecorder(buckets, device, args.scatter_below)
    assert engine.record_casts(lambda: rec, pieces=True)
    keys = rec.bound_keys()
    for _ in range(2):  # warm-up: kernels, the merge's first allocations
        rec.synced(1, keys)
        _step(engine, device, args.grad_scale, g)
        _step(engine, device, args.grad_scale, g)
    recorded: list[list[float]] = [[] for _ in range(args.steps_between)]
    words = sum(b.nbytes for b in buckets) // 2
    patch = 0
    for r in range(args.repeats):
        rec.synced(2 + r, keys)
        for k in range(args.steps_between):
            recorded[k].append(_step(engine, device, args.grad_scale, g))
        patch = sum(d.finish()[2] for d in (rec.take(key, 2 + r) for key in keys) if d is not None)
    exact = all(torch.equal(engine.local_piece(n), engine._master_piece(n).to(torch.bfloat16)) for n in rec.names)
    out = {
        "shadows_equal_the_cast": exact,
        "preset": args.preset, "layers": args.layers, "device": str(device), "lr": args.lr, "grad_scale": args.grad_scale,
        "bucket_mb": args.bucket_mb, "buckets": len(keys), "bf16_words": words,
        "plain_step_s": statistics.median(plain), "recorded_step_s": [statistics.median(x) for x in recorded],
        "shadow_bytes": engine._cast_shadows.nbytes, "patch_area_bytes": rec.nbytes,
        "master_bytes": 4 * words, "patch_fraction_after_k": patch / words if words else 0.0,
    }
    print(f"{args.preset} ({args.layers} layers) on {device}: {words / 1e9:.2f} G bf16 words in {len(keys)} buckets, lr {args.lr}")
    print(f"optimizer step, plain: {out['plain_step_s'] * 1e3:.1f} ms")
    for k, s in enumerate(out["recorded_step_s"], 1):
        print(f"optimizer step {k} since the sync, recorded: {s * 1e3:.1f} ms (+{(s - out['plain_step_s']) * 1e3:.1f} ms)")
    print(f"memory: shadows {out['shadow_bytes'] / 2**30:.2f} GiB + patch areas {out['patch_area_bytes'] / 2**30:.2f} GiB "
          f"(masters {out['master_bytes'] / 2**30:.2f} GiB); patch after {args.steps_between} steps: {out['patch_fraction_after_k']:.2%} of words")
    print(f"the shadows equal torch's cast of the masters: {exact}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
