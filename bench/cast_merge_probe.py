"""What a trainer that syncs every k steps pays for the recording cast's merge (CPU or one GPU).

One bucket of `--gib` GiB of bf16 weights with fp32 masters, bound to a CastRecorder and marked
synced; then k steps, each moving a random `--changed` fraction of the masters to the next bf16
value, each written through `recorder.cast_()`. The first cast after a sync records afresh; each
later one records on top and merges the repeats (BucketDiff.merge_repeats). Reported per cast:
seconds, the recorded words; and a plain `copy_` of the masters for scale. The patch after the
last cast is checked against the words that changed since the sync.

    python bench/cast_merge_probe.py --gib 1 --changed 0.02 --steps 3 [--device cuda] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from ckpt_engine.delta import codec
from ckpt_engine.delta.recorder import CastBucket, CastRecorder, CastSlice


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _warm_up(device: torch.device, scatter_below: float) -> None:
    """Two casts on a tiny bucket: compiles numba's loops (or Triton's kernel) outside the timing."""
    n = 1 << 14
    weight = torch.zeros(n, dtype=torch.bfloat16, device=device)
    master = weight.float()
    rec = CastRecorder([CastBucket(0, 2 * n, 2, (CastSlice("w", (n,), "bfloat16", 0, 0, 2 * n, 0),))], device, scatter_below)
    rec.bind({"w": (master, weight)})
    rec.synced(1, {0})
    for _ in range(2):
        master[:: 97] += 1.0
        rec.cast_()
    _sync(device)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--changed", type=float, default=0.02, help="fraction of words each step changes")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--scatter-below", type=float, default=0.25)
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    device = torch.device(args.device)
    _warm_up(device, args.scatter_below)
    n = int(args.gib * (1 << 30)) // 2
    g = torch.Generator(device=device).manual_seed(args.seed)
    weight = (torch.randn(n, generator=g, device=device) * 0.02).to(torch.bfloat16)
    master = weight.float()
    base = weight.clone()
    bucket = CastBucket(0, 2 * n, 2, (CastSlice("w", (n,), "bfloat16", 0, 0, 2 * n, 0),))
    rec = CastRecorder([bucket], device, args.scatter_below)
    rec.bind({"w": (master, weight)})
    rec.synced(1, {0})
    t0 = time.perf_counter()
    base.copy_(master)  # a plain cast for scale (same bytes read and written)
    _sync(device)
    plain_s = time.perf_counter() - t0
    rows = []
    for step in range(1, args.steps + 1):
        hit = (torch.rand(n, generator=g, device=device) < args.changed).nonzero().reshape(-1)
        master.view(torch.int32).index_add_(0, hit, torch.full_like(hit, 1 << 16, dtype=torch.int32))  # the next bf16 value up
        _sync(device)
        t0 = time.perf_counter()
        rec.cast_()
        _sync(device)
        rows.append({"step": step, "cast_s": time.perf_counter() - t0, "step_changed": hit.numel()})
    size, _delta, count = rec.take(0, 1).finish()
    want = int((weight.view(torch.int16) != base.view(torch.int16)).sum())
    assert size is not None and count == want, (size, count, want)
    patch = codec.decode(rec._states[0].out[:size], 2 * n, 2)
    assert patch.positions.numel() == want
    out = {"gib": args.gib, "changed": args.changed, "steps": args.steps, "device": str(device), "threads": torch.get_num_threads(),
           "plain_cast_s": plain_s, "casts": rows, "patch_words": count, "patch_fraction": count / n}
    for r in rows:
        print(f"cast {r['step']}: {r['cast_s']:.3f} s ({r['step_changed'] / n:.2%} of words moved this step)")
    print(f"plain copy_: {plain_s:.3f} s; patch after {args.steps} casts: {count / n:.2%} of {n} words, exact")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
