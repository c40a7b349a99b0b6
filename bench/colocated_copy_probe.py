"""How fast one GPU copies a model's tensors into another set of the same shapes, by the ways a
colocated receiver or its loader can copy (the one-copy colocated sync is one such copy plus flags):
  flat        one copy_ of all the bytes as one buffer (the reference: "one D2D copy of the bytes")
  per_tensor  one copy_ per tensor (a device memcpy each; what `shared_sources.py` does for tensors
              of 1 MiB and up when the receiver passes destinations)
  foreach     one torch._foreach_copy_ per bucket of ~1 GiB (what `copies.batched_copy_` does per
              bucket: the bench's loader when the receiver passes no destinations)
  foreach_all one torch._foreach_copy_ over every tensor
  alone       `copies.copy_large_alone_`: a copy_ per tensor of `copies.ALONE_BYTES` and up, the
              rest in one _foreach_copy_ (what the colocated loaders do)
  fused_<KiB> `copy_kernel.FusedCopy` with chunks of that size: one launch of a table built once
  fused_<KiB>_b<words>_w<warps>  the same with other words a step and warps (`--blocks`, `--warps`)

    python bench/colocated_copy_probe.py --preset qwen2.5-7b [--layers N] [--reps 5]
"""

from __future__ import annotations

import argparse
import json

import torch

from ckpt_engine.benchmark.presets import checkpoint_specs, load_preset_config
from ckpt_engine.copies import copy_large_alone_
from ckpt_engine.copy_kernel import FusedCopy
from ckpt_engine.sources.wire import torch_dtype

# bench/ is the script's directory, on sys.path when run as `python bench/...`
from cuda_timing import best_seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen2.5-7b")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--bucket-gib", type=float, default=1.0)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--chunks-kib", default="256,1024,4096", help="FusedCopy chunk sizes to try")
    p.add_argument("--blocks", default="", help="int64 words a step to try beside the kernel's own (e.g. 4096,8192)")
    p.add_argument("--warps", default="", help="warps to try with each of --blocks (e.g. 4,8,16)")
    args = p.parse_args()
    specs = checkpoint_specs(load_preset_config(args.preset), dtype=args.dtype, num_layers=args.layers)
    dev = torch.device("cuda", torch.cuda.current_device())
    src = [torch.randint(-100, 100, s.shape, device=dev).to(torch_dtype(s.dtype)) for s in specs]
    dst = [torch.zeros_like(t) for t in src]
    total = sum(t.numel() * t.element_size() for t in src)
    flat_src = torch.ones(total, dtype=torch.uint8, device=dev)
    flat_dst = torch.empty_like(flat_src)
    limit = int(args.bucket_gib * (1 << 30))
    buckets: list[list[int]] = [[]]
    size = 0
    for i, t in enumerate(src):
        n = t.numel() * t.element_size()
        if buckets[-1] and size + n > limit:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += n

    def per_tensor() -> None:
        for d, s in zip(dst, src):
            d.copy_(s)

    def foreach() -> None:
        for b in buckets:
            torch._foreach_copy_([dst[i] for i in b], [src[i] for i in b])

    times = {
        "flat": best_seconds(lambda: flat_dst.copy_(flat_src), args.reps),
        "per_tensor": best_seconds(per_tensor, args.reps),
        "foreach": best_seconds(foreach, args.reps),
        "foreach_all": best_seconds(lambda: torch._foreach_copy_(dst, src), args.reps),
        "alone": best_seconds(lambda: copy_large_alone_(dst, src), args.reps),
    }
    for kib in map(int, args.chunks_kib.split(",")):
        fused = FusedCopy(dst, src, chunk_bytes=kib << 10)
        for d in dst:
            d.zero_()
        fused.launch()
        if not all(torch.equal(d, s) for d, s in zip(dst, src)):
            raise SystemExit(f"fused_{kib}: the copy differs from its sources")
        times[f"fused_{kib}"] = best_seconds(fused.launch, args.reps)
        for block in [int(b) for b in args.blocks.split(",") if b]:
            for warps in [int(w) for w in (args.warps or "4").split(",")]:
                variant = FusedCopy(dst, src, chunk_bytes=kib << 10, block=block, warps=warps)
                times[f"fused_{kib}_b{block}_w{warps}"] = best_seconds(variant.launch, args.reps)
    out = {
        "preset": args.preset, "bytes": total, "tensors": len(src), "buckets": len(buckets), "device": torch.cuda.get_device_name(dev),
        "seconds": times, "copy_rate_tb_s": {k: total / v / 1e12 for k, v in times.items()},
        "vs_flat": {k: times["flat"] / v for k, v in times.items()},
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
