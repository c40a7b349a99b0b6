"""What an in-place receiver pays per bucket to check and apply a patch (one GPU).

A bucket of int32 words spread over layer-sized tensors (separate allocations, a little padding
between them, like a receiver's own weights behind ckpt_engine.delta.pieces.ScatteredImage), and
a scatter32-like patch: a fraction of the tensors' words, positions sorted within runs of 8192
words (the sender's tiles) with the runs in shuffled order, random new values. Times (CUDA events,
warm-up, median of --reps) of:
  old        ScatteredImage.gather + scatter + pair_delta on int64 positions (the receiver before
             swap_in)
  old_range  what decode added to it for scatter32: int32 -> int64 copy, min/max range check and
             its host sync
  swap       ScatteredImage.swap_in on the int32 positions (decode(check_range=False) leaves them)
`vs before` is (old + old_range) / swap: the receiver before swap_in against now. It
also checks once that swap_in's old words, outside count, checksum change and written tensors
equal the old path's.

    python bench/delta_apply_probe.py --gib 1 --changed 0.02 0.13 --json results/apply.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable

import torch

from ckpt_engine.delta.pieces import ScatteredImage, pair_delta

# Qwen2.5-7B's tensors of one layer in bf16 elements (q, q bias, k, k bias, v, v bias, o, gate,
# up, down, two norms): region sizes follow them, in words of two elements.
_LAYER = [3584 * 3584, 3584, 512 * 3584, 512, 512 * 3584, 512, 3584 * 3584, 18944 * 3584, 18944 * 3584, 3584 * 18944, 3584, 3584]
_GAP = 64  # padding words before every region (alignment in the bucket)
_TILE = 8192  # words per sender tile: positions are sorted within one


def _timed(fn: Callable[[], object], reps: int, warmup: int = 2) -> float:
    """Median seconds of `fn` over `reps` runs, by CUDA events around each."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _regions(num_words: int, count: int, dev: torch.device, gen: torch.Generator) -> list[tuple[int, torch.Tensor]]:
    """`count` separate int32 tensors sized like a layer's, filling `num_words` with _GAP padding."""
    weights = [_LAYER[i % len(_LAYER)] for i in range(count)]
    room = num_words - count * _GAP
    sizes = [max(1, room * w // sum(weights)) for w in weights]
    sizes[-1] += room - sum(sizes)
    out, at = [], 0
    for size in sizes:
        at += _GAP
        t = torch.randint(-(2**31), 2**31 - 1, (size,), dtype=torch.int32, device=dev, generator=gen)
        out.append((at, t))
        at += size
    return out


def _patch(regions: list[tuple[int, torch.Tensor]], changed: float, dev: torch.device, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(int32 positions, int32 values): each region word changes with probability `changed`;
    positions sorted within tiles of _TILE words, tiles in shuffled order."""
    parts = []
    for first, t in regions:
        pick = torch.rand(t.numel(), device=dev, generator=gen) < changed
        parts.append(pick.nonzero().reshape(-1) + first)
    pos = torch.cat(parts)
    tile = pos // _TILE
    perm = torch.randperm(int(tile.max()) + 1, device=dev, generator=gen)
    pos = pos[torch.argsort(perm[tile] * _TILE + pos % _TILE)]
    vals = torch.randint(-(2**31), 2**31 - 1, (pos.numel(),), dtype=torch.int32, device=dev, generator=gen)
    return pos.to(torch.int32), vals


def _check(image: ScatteredImage, pos32: torch.Tensor, vals: torch.Tensor) -> bool:
    """swap_in gives the old path's old words, outside count, change and written tensors."""
    snapshot = [t.clone() for _f, t in image.regions]
    pos64 = pos32.long()
    old, bad = image.gather(pos64)
    image.scatter(pos64, vals)
    change = pair_delta(pos64, vals, old)
    after = [t.clone() for _f, t in image.regions]
    for (_f, t), s in zip(image.regions, snapshot):
        t.copy_(s)
    s_old, s_bad, s_change = image.swap_in(pos32, vals)
    same = torch.equal(old, s_old) and int(bad) == int(s_bad) == 0 and int(change) == int(s_change)
    return same and all(torch.equal(t, a) for (_f, t), a in zip(image.regions, after))


def probe(gib: float, changed: float, num_regions: int, reps: int, seed: int) -> dict[str, float]:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(seed)
    num_words = int(gib * (1 << 30)) // 4
    regions = _regions(num_words, num_regions, dev, gen)
    image = ScatteredImage(regions, num_words)
    pos32, vals = _patch(regions, changed, dev, gen)
    pos64 = pos32.long()
    row: dict[str, float] = {"gib": gib, "changed": changed, "positions": float(pos32.numel()), "regions": float(num_regions)}
    row["match"] = float(_check(image, pos32, vals))

    def old_path() -> None:
        old, bad = image.gather(pos64)
        image.scatter(pos64, vals)
        change = pair_delta(pos64, vals, old)
        torch.stack([change.reshape(()), bad.reshape(()).to(torch.int64)]).tolist()

    def old_range() -> None:
        p = pos32.to(torch.int64)
        torch.stack([p.min() >= 0, p.max() < num_words]).tolist()

    def swap() -> None:
        _old, bad, change = image.swap_in(pos32, vals)
        torch.stack([change.reshape(()), bad.reshape(()).to(torch.int64)]).tolist()

    row["old_s"] = _timed(old_path, reps)
    row["swap_s"] = _timed(swap, reps)
    row["old_range_s"] = _timed(old_range, reps)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0, help="bucket size in GiB")
    ap.add_argument("--changed", type=float, nargs="+", default=[0.02, 0.13], help="fractions of words changed")
    ap.add_argument("--regions", type=int, default=30, help="tensors the bucket is spread over")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the rows to this path")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this probe needs a CUDA GPU (and Triton)")
    rows = []
    for changed in args.changed:
        rows.append(probe(args.gib, changed, args.regions, args.reps, args.seed))
        torch.cuda.empty_cache()
    head = f"{'changed':>7} {'old ms':>8} {'+range':>7} {'swap ms':>8} {'vs before':>9} match"
    print(f"{torch.cuda.get_device_name()}: {args.gib} GiB bucket of int32 words in {args.regions} tensors, median of {args.reps}")
    print(head)
    for r in rows:
        speedup = (r["old_s"] + r["old_range_s"]) / r["swap_s"]
        print(
            f"{r['changed']:>7.2%} {r['old_s'] * 1e3:>8.3f} {r['old_range_s'] * 1e3:>7.3f} "
            f"{r['swap_s'] * 1e3:>8.3f} {speedup:>8.2f}x {bool(r['match'])}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
