"""Where the delta encode's time goes on one GPU: memory-bound references against the codec's kernels.

Times, on one bucket of bf16 words with a chosen fraction changed at random positions:
  copy        torch copy_ of the bucket (reads 1x, writes 1x: the HBM reference)
  ne_sum      torch.ne(old, new).sum() (reads both images once)
  codec       ckpt_engine.delta.codec.encode_into_base (the sender's call for a packed bucket: the
              same one-pass diff over one piece, sized to the whole bucket), including its host sync
  direct      ckpt_engine.delta.direct.BucketDiff over the bucket as one piece (one pass, the patch
              written in block order), including its host sync; direct_pieces: the same bucket cut
              into Qwen2.5-7B layer-sized pieces (one kernel each); direct_table: those pieces in
              one launch through a table (direct_kernels.py); moe_pieces / moe_table: the bucket cut
              into Qwen3-30B-A3B expert-sized pieces (768 x 2048), a launch each / one launch
and checks that `direct` writes the same positions, values, checksum change and base as the codec.

    python bench/delta_kernel_probe.py --gib 1 --changed 0.02 0.13
"""

from __future__ import annotations

import argparse
import json

import torch

from ckpt_engine.delta import codec, direct, kernels

# bench/ is the script's directory, on sys.path when run as `python bench/...`
from cuda_timing import best_seconds


def probe(gib: float, changed: float, reps: int, sweep: bool) -> dict[str, float]:
    n = int(gib * (1 << 30)) // 2
    dev = torch.device("cuda")
    old = torch.randint(-(2**15), 2**15, (n,), dtype=torch.int16, device=dev)
    new = old.clone()
    pick = torch.rand(n, device=dev) < changed
    new[pick] ^= 1
    del pick
    nbytes = n * 2
    out = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    base = old.clone()
    row: dict[str, float] = {"gib": gib, "changed": changed}
    scratch = torch.empty_like(old)
    row["copy_s"] = best_seconds(lambda: scratch.copy_(new), reps)
    row["ne_sum_s"] = best_seconds(lambda: torch.ne(old, new).sum(), reps)

    def run_codec() -> None:
        base.copy_(old)
        codec.encode_into_base(base.view(torch.uint8), new.view(torch.uint8), 2, out)

    t_reset = best_seconds(lambda: base.copy_(old), reps)
    row["codec_s"] = best_seconds(run_codec, reps) - t_reset
    layer = [3584 * 3584, 3584, 512 * 3584, 512, 512 * 3584, 512, 3584 * 3584, 18944 * 3584, 18944 * 3584, 3584 * 18944, 3584]
    cuts, at = [], 0
    while at < n:
        for w in layer:
            if at >= n:
                break
            cuts.append((at, min(w, n - at)))
            at += w

    expert = 768 * 2048
    moe = [(at, min(expert, n - at)) for at in range(0, n, expert)]

    cache: dict[int, dict] = {}  # as the sender keeps per bucket: the device table, built once
    below = 1 / 4  # the CUDA senders' default scatter limit: the patch holds up to a quarter of the words

    def run_direct(pieces: list[tuple[int, int]], table: bool = False) -> int | None:
        base.copy_(old)
        bd = direct.BucketDiff(out[: direct.out_bytes(nbytes, 2, below)], nbytes, 2, below)
        if table:
            bd.add_pieces([(new[first:].data_ptr(), w, first) for first, w in pieces], base, cache.setdefault(id(pieces), {}))
        else:
            for first, w in pieces:
                bd.add(new[first : first + w], base[first : first + w], first)
        return bd.finish()[0]

    if sweep:
        settings = [(32, 4), (64, 4), (128, 4), (128, 8), (256, 8), (256, 16), (512, 8), (512, 16)]
        for rows_, warps in settings:
            kernels.DIFF_ROWS, kernels.DIFF_NUM_WARPS = rows_, warps
            row[f"direct_{rows_}x32_{warps}_s"] = best_seconds(lambda: run_direct([(0, n)]), reps) - t_reset
        kernels.DIFF_ROWS, kernels.DIFF_NUM_WARPS = min(settings, key=lambda s: row[f"direct_{s[0]}x32_{s[1]}_s"])
        row["best"] = f"{kernels.DIFF_ROWS}x32 warps {kernels.DIFF_NUM_WARPS}"
    row["direct_s"] = best_seconds(lambda: run_direct([(0, n)]), reps) - t_reset
    row["direct_pieces_s"] = best_seconds(lambda: run_direct(cuts), reps) - t_reset
    row["direct_table_s"] = best_seconds(lambda: run_direct(cuts, table=True), reps) - t_reset
    row["moe_pieces_s"] = best_seconds(lambda: run_direct(moe), reps) - t_reset
    row["moe_table_s"] = best_seconds(lambda: run_direct(moe, table=True), reps) - t_reset
    row["pieces"], row["moe_count"] = len(cuts), len(moe)
    size = run_direct(cuts, table=True)
    ok_base = bool(torch.equal(base, new))
    ref_base = old.clone()
    ref_out = torch.empty_like(out)
    ref_size = codec.encode_into_base(ref_base.view(torch.uint8), new.view(torch.uint8), 2, ref_out)
    row["direct_bytes"] = float(size or -1)
    row["codec_bytes"] = float(ref_size or -1)
    if size is not None:
        patch = codec.decode(out[:size], nbytes, 2)
        applied = old.clone()
        want = codec.checksum(new.view(torch.uint8), 2)
        got = codec.checksum(old.view(torch.uint8), 2) + codec.delta_checksum(applied.view(torch.uint8), patch)
        codec.apply(applied.view(torch.uint8), patch)
        row["exact"] = float(ok_base and torch.equal(applied, new) and int(got) == int(want))
    for k in ("copy", "ne_sum"):
        row[k + "_TBps"] = nbytes * (2 if k == "copy" else 2) / row[k + "_s"] / 1e12
    for k in ("codec", "direct", "direct_pieces", "direct_table", "moe_pieces", "moe_table"):
        row[k + "_dense_TBps"] = nbytes / row[k + "_s"] / 1e12
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--changed", type=float, nargs="+", default=[0.02, 0.13])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--sweep", action="store_true", help="time the one-pass kernel's block sizes and warps")
    args = ap.parse_args()
    rows = [probe(args.gib, c, args.reps, args.sweep) for c in args.changed]
    for r in rows:
        print(json.dumps(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
