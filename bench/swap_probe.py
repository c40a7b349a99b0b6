"""The swap of a staged patch sync (issue 28) on one device: what an engine stalls for.

Qwen2.5-7B's checkpoint shapes in bf16 (15.2 GB; `--layers N` keeps N layers, for a CPU check)
live in separate tensors, like an engine's weights, planned into buckets as a sync plans them; each
bucket's words lie in those tensors (`ScatteredImage`, 4-byte words). A patch of `--changed` of each
bucket's words (sorted positions, random values) is staged the way a staged receive keeps it
(`pipeline/staging.py` `StagedPatch`: positions, new words, the old words read at the stream).
Times (CUDA events on a GPU, wall clock on a CPU; median of --reps, after warm-up) of:
  staged_swap   StagedPatches.apply: the stamps check, one scatter per bucket (the swap's stall)
  inplace_apply ScatteredImage.swap_in per bucket: today's in-place apply (read, checksum, write),
                which runs inside the paused window of an unstaged patch sync
  full_copy     one batched copy of every tensor from a staging copy (a dense staged sync's swap,
                and a lower bound of any swap that touches every byte)

    python bench/swap_probe.py --changed 0.02 --json bench/results/swap_probe.json      # one GPU
    python bench/swap_probe.py --device cpu --layers 2 --reps 3                          # CPU check
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from ckpt_engine.benchmark.presets import checkpoint_specs, load_preset_config
from ckpt_engine.copies import batched_copy_
from ckpt_engine.delta.pieces import ScatteredImage
from ckpt_engine.pipeline.delta_bases import Bases
from ckpt_engine.pipeline.staging import StagedPatch, StagedPatches
from ckpt_engine.planning.buckets import plan_buckets

WORD = 4


def _timed(fn: Callable[[], object], reps: int, device: torch.device, warmup: int = 1) -> float:
    """Median seconds of `fn` over `reps` runs (CUDA events on a GPU, else wall clock)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen2.5-7b")
    p.add_argument("--layers", type=int, default=None, help="keep this many layers (default: the whole model)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--changed", type=float, nargs="+", default=[0.02])
    p.add_argument("--bucket-mb", type=float, default=1024.0)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--no-full-copy", action="store_true", help="skip the full copy (it needs a second copy of the model)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    device = torch.device(args.device)
    gen = torch.Generator(device=device).manual_seed(0)

    specs = checkpoint_specs(load_preset_config(args.preset), "bfloat16", num_layers=args.layers)
    manifest = plan_buckets(specs, int(args.bucket_mb * 2**20))
    live = {s.name: torch.randint(-(2**15), 2**15, s.shape, dtype=torch.int16, device=device, generator=gen).view(torch.bfloat16) for s in specs}
    total = sum(t.numel() * t.element_size() for t in live.values())
    places: dict[int, ScatteredImage] = {}
    for b in manifest.buckets:
        regions = []
        for e in b.entries:
            if e.chunk_size:
                flat = live[e.name].reshape(-1).view(torch.uint8)[e.chunk_offset : e.chunk_offset + e.chunk_size]
                regions.append((e.bucket_offset // WORD, flat.view(torch.int32)))
        if regions:
            places[b.index] = ScatteredImage(regions, b.nbytes // WORD)
    rows = []
    print(f"{args.preset}: {len(specs)} tensors, {total / 1e9:.2f} GB bf16, {len(places)} buckets on {device}")
    full_copy = None
    if not args.no_full_copy:
        staging = {n: t.clone() for n, t in live.items()}
        names = list(live)
        full_copy = _timed(lambda: batched_copy_([live[n] for n in names], [staging[n] for n in names]), args.reps, device)
        del staging
    for changed in args.changed:
        frames = []
        for k, image in places.items():
            words = torch.cat([torch.arange(f, f + v.numel(), device=device) for f, v in image.regions])
            pick = torch.randperm(words.numel(), device=device, generator=gen)[: max(1, int(changed * words.numel()))]
            positions = words[pick].sort().values.to(torch.int32)
            values = torch.randint(-(2**31), 2**31 - 1, (positions.numel(),), dtype=torch.int32, device=device, generator=gen)
            old, _bad = image.gather(positions)
            frames.append(StagedPatch(k, 0, values, old, positions))
        patch_bytes = sum(f.positions.numel() * 8 for f in frames if f.positions is not None)

        def staged_swap() -> None:
            bases = Bases(digest="probe", sync_id=0, inplace=True, sums={k: torch.zeros((), dtype=torch.int64, device=device) for k in places})
            bases.stamps = {n: (t.data_ptr(), t._version) for n, t in live.items()}
            for _ in StagedPatches(bases, places, frames, 1, live, lambda: iter(()), lambda what: None).apply():
                pass

        def inplace_apply() -> None:
            for f in frames:
                assert f.positions is not None
                places[f.bucket].swap_in(f.positions, f.values)

        swap_s = _timed(staged_swap, args.reps, device)
        inplace_s = _timed(inplace_apply, args.reps, device)
        row = {
            "preset": args.preset, "layers": args.layers, "device": str(device), "model_gb": total / 1e9, "changed": changed,
            "patch_gb": patch_bytes / 1e9, "staged_swap_ms": swap_s * 1e3, "inplace_apply_ms": inplace_s * 1e3,
            "full_copy_ms": full_copy * 1e3 if full_copy is not None else None,
        }
        rows.append(row)
        copy = f"{full_copy * 1e3:9.2f} ms" if full_copy is not None else "   skipped"
        print(
            f"changed {changed:5.3f}: staged swap {swap_s * 1e3:9.2f} ms | today's in-place apply {inplace_s * 1e3:9.2f} ms | "
            f"full copy of {total / 1e9:.2f} GB {copy} | patch {patch_bytes / 1e9:.3f} GB"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
