"""A candidate for the one-pass diff at RL learning rates of 1e-5 and up: each tile's changed words
placed by a prefix sum (a scan along each row plus the rows' running count) instead of the
library's per-row bit walk. Not in the library; this probe times it against the kernel the library
runs (`ckpt_engine.delta.kernels.diff_into`) and checks that both write the same patch, count, delta
sum and base.

Why: the library's kernel walks each row's changed words one round per change, as many rounds as the
busiest row of a tile. At 2 % changed that is 1-4 rounds; at ~11 % (lr 1e-5 after a few steps) ~10,
and the kernel falls to ~0.65 TB/s of one image's bytes (1 GiB, H200). A scan places every changed
word in one step whatever the rate; its cost is a compare, two scans and the delta sum's multiply on
every word, changed or not. The patch layout is the library's: row-major within a tile, one atomic
per tile for the slots and one for the delta sum, so the outputs are bit-identical.

    python bench/diff_scan_probe.py --gib 1 --changed 0.02 0.11 0.2 [--rows 64 128 256]
    TRITON_INTERPRET=1 python bench/diff_scan_probe.py --check   # correctness only, on a CPU
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton
import triton.language as tl

from ckpt_engine.delta import kernels
from ckpt_engine.delta.kernels import _mix_a, _mix_b, _weighted
from ckpt_engine.delta.mixing import GROUP_BITS, GROUP_WORDS


@triton.jit
def _scan_kernel(new_ptr, old_ptr, n_words, first, counter_ptr, delta_ptr, pos_ptr, val_ptr, cap, ROWS: tl.constexpr,
                 GROUP: tl.constexpr, GROUP_BITS: tl.constexpr, SMALL: tl.constexpr, SUM: tl.constexpr):
    """Per-word work in int32 (a tile's offsets, group index and positions): the int64 part is
    one widening multiply per word for the delta sum, taken over every word of the tile (an
    unchanged word adds 0, so no mask and no branch)."""
    start = tl.program_id(0).to(tl.int64) * (ROWS * 32)
    l = tl.arange(0, ROWS)[:, None] * 32 + tl.arange(0, 32)[None, :]
    inb = l < tl.minimum(n_words - start, ROWS * 32).to(tl.int32)
    a = tl.load(old_ptr + start + l, mask=inb, other=0)
    b = tl.load(new_ptr + start + l, mask=inb, other=0)
    changed = a != b
    f = changed.to(tl.int32)
    per_row = tl.sum(f, axis=1)
    cnt = tl.sum(per_row, axis=0)
    if cnt > 0:
        at = tl.atomic_add(counter_ptr, cnt)
        dest = at + (tl.cumsum(per_row, axis=0) - per_row)[:, None] + (tl.cumsum(f, axis=1) - f)
        q0 = first + start
        keep = changed & (dest < cap)
        tl.store(pos_ptr + dest, q0.to(tl.int32) + l, mask=keep)
        tl.store(val_ptr + dest, b, mask=keep)
        tl.store(old_ptr + start + l, b, mask=changed)
        if SUM:
            j = (q0 & (GROUP - 1)).to(tl.int32) + l  # a tile is shorter than a group: spans g0 and g0 + 1 at most
            upper = j >= GROUP
            if SMALL:
                d = b.to(tl.int32) - a.to(tl.int32)
            else:
                d = b.to(tl.int64) - a.to(tl.int64)
            t = _weighted(d, _mix_a(tl.where(upper, j - GROUP, j)), SMALL)
            g0 = q0 >> GROUP_BITS
            s0 = tl.sum(tl.sum(tl.where(upper, 0, t), axis=1), axis=0)
            s1 = tl.sum(tl.sum(tl.where(upper, t, 0), axis=1), axis=0)
            tl.atomic_add(delta_ptr, s0 * _mix_b(g0) + s1 * _mix_b(g0 + 1))


def scan_diff(new_w: torch.Tensor, base_w: torch.Tensor, first: int, counter: torch.Tensor, delta: torch.Tensor,
              positions: torch.Tensor, values: torch.Tensor, rows: int, warps: int = 8, delta_sum: bool = True) -> None:
    """`kernels.diff_into`'s contract, each tile's changes placed by a scan."""
    n = new_w.numel()
    words = rows * 32
    nb = (n + words - 1) // words
    if nb:
        _scan_kernel[(nb,)](new_w, base_w, n, first, counter, delta, positions, values, positions.numel(), ROWS=rows,
                            GROUP=GROUP_WORDS, GROUP_BITS=GROUP_BITS, SMALL=new_w.element_size() <= 2, SUM=delta_sum,
                            num_warps=warps)


def _case(n: int, changed: float, device: torch.device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    old = torch.randint(-(2**15), 2**15, (n,), dtype=torch.int16, generator=g)
    new = old.clone()
    pick = torch.rand(n, generator=g) < changed
    new[pick] ^= 1
    return old.to(device), new.to(device)


def _run(rows: int, old: torch.Tensor, new: torch.Tensor, first: int = 12345) -> tuple[torch.Tensor, ...]:
    """rows 0: the library's kernel."""
    n = old.numel()
    cap = n // 4
    base = old.clone()
    state = torch.zeros(2, dtype=torch.int64, device=old.device)
    pos = torch.zeros(cap, dtype=torch.int32, device=old.device)
    val = torch.zeros(cap, dtype=torch.int16, device=old.device)
    if rows == 0:
        kernels.diff_into(new, base, first, state.view(torch.int32)[:1], state[1], pos, val)
    else:
        scan_diff(new, base, first, state.view(torch.int32)[:1], state[1], pos, val, rows)
    return base, state, pos, val


def check(device: torch.device, rows_values: list[int]) -> bool:
    """Both kernels write the same base, count, delta sum and patch (tiles claim their slots in any
    order, so the patch is compared as sorted (position, value) pairs; a tile's own run is in row order
    either way); above the patch's capacity only the count, delta sum and base."""
    ok = True
    for changed in (0.0, 0.01, 0.11, 0.3, 1.0):
        for n, first in ((8192 * 3 + 77, 12345), (8192, 0), (8192 * 2, GROUP_WORDS - 4099)):  # the last spans two groups
            old, new = _case(n, changed, device, seed=int(changed * 1000) + n)
            ref = _run(0, old, new, first)
            for rows in rows_values:
                got = _run(rows, old, new, first)
                count = int(ref[1].view(torch.int32)[0])
                same = torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])
                if count <= ref[2].numel():  # above the cap the patch is dropped (dense), whatever slots it held
                    a = sorted(zip(ref[2][:count].tolist(), ref[3][:count].tolist()))
                    b = sorted(zip(got[2][:count].tolist(), got[3][:count].tolist()))
                    same = same and a == b
                print(f"changed {changed:.2f} n {n} first {first} rows {rows}: count {count} {'same' if same else 'DIFFERENT'}")
                ok = ok and same
    return ok


def time_it(gib: float, changed: float, rows_values: list[int], warps: list[int], reps: int) -> dict[str, float]:
    from cuda_timing import best_seconds  # bench/ is on sys.path when run as `python bench/...`

    n = int(gib * (1 << 30)) // 2
    dev = torch.device("cuda")
    old, new = _case(n, changed, dev, seed=1)
    base = old.clone()
    cap = n // 4
    state = torch.zeros(2, dtype=torch.int64, device=dev)
    pos = torch.empty(cap, dtype=torch.int32, device=dev)
    val = torch.empty(cap, dtype=torch.int16, device=dev)
    t_reset = best_seconds(lambda: (base.copy_(old), state.zero_()), reps)
    row: dict[str, float] = {"gib": gib, "changed": changed}

    def lib() -> None:
        base.copy_(old)
        state.zero_()
        kernels.diff_into(new, base, 0, state.view(torch.int32)[:1], state[1], pos, val)

    row["library_TBps"] = n * 2 / (best_seconds(lib, reps) - t_reset) / 1e12
    for rows in rows_values:
        for w in warps:
            def cand(rows: int = rows, w: int = w) -> None:
                base.copy_(old)
                state.zero_()
                scan_diff(new, base, 0, state.view(torch.int32)[:1], state[1], pos, val, rows, w)

            row[f"scan{rows}w{w}_TBps"] = n * 2 / (best_seconds(cand, reps) - t_reset) / 1e12

            def place_only(rows: int = rows, w: int = w) -> None:  # how much of it the delta sum costs
                base.copy_(old)
                state.zero_()
                scan_diff(new, base, 0, state.view(torch.int32)[:1], state[1], pos, val, rows, w, delta_sum=False)

            row[f"scan{rows}w{w}_nosum_TBps"] = n * 2 / (best_seconds(place_only, reps) - t_reset) / 1e12
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--changed", type=float, nargs="+", default=[0.02, 0.11, 0.2])
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--check", action="store_true", help="only check both kernels write the same (a CPU with TRITON_INTERPRET=1)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu")
    ok = check(device, args.rows)
    print("outputs identical" if ok else "OUTPUTS DIFFER")
    if args.check or device.type != "cuda":
        raise SystemExit(0 if ok else 1)
    rows = [time_it(args.gib, c, args.rows, args.warps, args.reps) for c in args.changed]
    for r in rows:
        print(json.dumps(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
