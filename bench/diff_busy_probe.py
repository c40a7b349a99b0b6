"""A candidate for the one-pass diff at RL learning rates of 1e-5 and up: busy tiles written in one
vectorized step instead of the per-row bit walk. Not in the library; this probe times it against the
kernel the library runs (`ckpt_engine.delta.kernels.diff_into`) and checks that both write the same
patch, count, delta sum and base.

Why: the library's kernel walks each row's changed words one round per change, as many rounds as the
busiest row of a tile. At 2 % changed that is 1-4 rounds; at ~11 % (lr 1e-5 after a few steps) ~10,
and the kernel falls to ~0.5 TB/s of dense bytes (26.5 ms for Qwen2.5-7B's 15.2 GB on an H200:
0.63 x a raw NCCL broadcast before a byte moves). Here a tile whose busiest row has more than `busy`
changes is written in slices of SUB rows: each changed word's slot is its row's start plus the set
bits below it in the row's mask (no rounds), and the delta sum is taken over the slice under the
change mask. The patch layout is the library's: row-major within a tile, one atomic per tile for
the slots and one for the delta sum, so the outputs are bit-identical.

    python bench/diff_busy_probe.py --gib 1 --changed 0.02 0.11 0.2 [--busy 4 6 8]
    TRITON_INTERPRET=1 python bench/diff_busy_probe.py --check   # correctness only, on a CPU
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton
import triton.language as tl

from ckpt_engine.delta import kernels
from ckpt_engine.delta.kernels import _change_a, _mix_b, _popc32
from ckpt_engine.delta.mixing import GROUP_BITS, GROUP_WORDS


@triton.jit
def _busy_kernel(new_ptr, old_ptr, n_words, first, counter_ptr, delta_ptr, pos_ptr, val_ptr, cap, ROWS: tl.constexpr, SUB: tl.constexpr,
                 BUSY: tl.constexpr, GROUP: tl.constexpr, GROUP_BITS: tl.constexpr):
    tl.static_assert(ROWS % SUB == 0)
    tile = tl.program_id(0).to(tl.int64)
    row = tl.arange(0, ROWS)
    col = tl.arange(0, 32)
    row_start = tile * (ROWS * 32) + row * 32
    offs = row_start[:, None] + col[None, :]
    inb = offs < n_words
    a = tl.load(old_ptr + offs, mask=inb, other=0)
    b = tl.load(new_ptr + offs, mask=inb, other=0)
    bits = tl.sum(tl.where(a != b, 1 << col[None, :], 0), axis=1)
    per_row = _popc32(bits)
    cnt = tl.sum(per_row, axis=0)
    if cnt > 0:
        at = tl.atomic_add(counter_ptr, cnt)
        g0 = (first + tile * (ROWS * 32)) >> GROUP_BITS
        if tl.max(per_row, axis=0) > BUSY:
            # vectorized: slices of SUB rows reloaded (cache hits), slots from the masks' popcounts
            s0 = tl.zeros([], dtype=tl.int64)
            s1 = tl.zeros([], dtype=tl.int64)
            base = at
            sub = tl.arange(0, SUB)
            below = (1 << col) - 1  # bits of the columns left of each column (col 31: 0x7fffffff)
            for s in tl.static_range(ROWS // SUB):
                r_start = tile * (ROWS * 32) + (s * SUB + sub) * 32
                o = r_start[:, None] + col[None, :]
                m_in = o < n_words
                x = tl.load(old_ptr + o, mask=m_in, other=0)
                y = tl.load(new_ptr + o, mask=m_in, other=0)
                changed = x != y
                rb = tl.sum(tl.where(changed, 1 << col[None, :], 0), axis=1)
                pr = _popc32(rb)
                b_dest = base + (tl.cumsum(pr, axis=0) - pr)[:, None] + _popc32(rb[:, None] & below[None, :])
                b_q = first + o
                b_keep = changed & (b_dest < cap)
                tl.store(pos_ptr + b_dest, b_q.to(tl.int32), mask=b_keep)
                tl.store(val_ptr + b_dest, y, mask=b_keep)
                tl.store(old_ptr + o, y, mask=changed)
                b_t = tl.where(changed, _change_a(y, x, b_q, GROUP), 0)
                b_upper = (b_q >> GROUP_BITS) != g0
                s0 += tl.sum(tl.sum(tl.where(b_upper, 0, b_t), axis=1), axis=0)
                s1 += tl.sum(tl.sum(tl.where(b_upper, b_t, 0), axis=1), axis=0)
                base += tl.sum(pr, axis=0)
            tl.atomic_add(delta_ptr, s0 * _mix_b(g0) + s1 * _mix_b(g0 + 1))
        else:  # the library's row walk
            dest = at + tl.cumsum(per_row, axis=0) - per_row
            acc0 = tl.zeros([ROWS], dtype=tl.int64)
            acc1 = tl.zeros([ROWS], dtype=tl.int64)
            for _ in range(0, tl.max(per_row, axis=0)):
                live = bits != 0
                p = row_start + _popc32((bits & (0 - bits)) - 1)
                bits = bits & (bits - 1)
                v = tl.load(new_ptr + p, mask=live, other=0)
                ov = tl.load(old_ptr + p, mask=live, other=0)
                q = first + p
                t = tl.where(live, _change_a(v, ov, q, GROUP), 0)
                upper = (q >> GROUP_BITS) != g0
                acc0 += tl.where(upper, 0, t)
                acc1 += tl.where(upper, t, 0)
                keep = live & (dest < cap)
                tl.store(pos_ptr + dest, q.to(tl.int32), mask=keep)
                tl.store(val_ptr + dest, v, mask=keep)
                tl.store(old_ptr + p, v, mask=live)
                dest += live.to(tl.int32)
            tl.atomic_add(delta_ptr, tl.sum(acc0, axis=0) * _mix_b(g0) + tl.sum(acc1, axis=0) * _mix_b(g0 + 1))


def busy_diff(new_w: torch.Tensor, base_w: torch.Tensor, first: int, counter: torch.Tensor, delta: torch.Tensor,
              positions: torch.Tensor, values: torch.Tensor, busy: int, sub: int = 32) -> None:
    """`kernels.diff_into`'s contract, with busy tiles written in one step."""
    n = new_w.numel()
    words = kernels.DIFF_ROWS * 32
    nb = (n + words - 1) // words
    if nb:
        _busy_kernel[(nb,)](new_w, base_w, n, first, counter, delta, positions, values, positions.numel(), ROWS=kernels.DIFF_ROWS,
                            SUB=sub, BUSY=busy, GROUP=GROUP_WORDS, GROUP_BITS=GROUP_BITS, num_warps=kernels.DIFF_NUM_WARPS)


def _case(n: int, changed: float, device: torch.device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    old = torch.randint(-(2**15), 2**15, (n,), dtype=torch.int16, generator=g)
    new = old.clone()
    pick = torch.rand(n, generator=g) < changed
    new[pick] ^= 1
    return old.to(device), new.to(device)


def _run(kind: str, old: torch.Tensor, new: torch.Tensor, busy: int, first: int = 12345) -> tuple[torch.Tensor, ...]:
    n = old.numel()
    cap = n // 4
    base = old.clone()
    state = torch.zeros(2, dtype=torch.int64, device=old.device)
    pos = torch.zeros(cap, dtype=torch.int32, device=old.device)
    val = torch.zeros(cap, dtype=torch.int16, device=old.device)
    if kind == "library":
        kernels.diff_into(new, base, first, state.view(torch.int32)[:1], state[1], pos, val)
    else:
        busy_diff(new, base, first, state.view(torch.int32)[:1], state[1], pos, val, busy)
    return base, state, pos, val


def check(device: torch.device, busy_values: list[int]) -> bool:
    """Both kernels write the same base, count, delta sum and patch (tiles claim their slots in any
    order, so the patch is compared as sorted (position, value) pairs; a tile's own run is in row order
    either way); above the patch's capacity only the count, delta sum and base."""
    ok = True
    for changed in (0.0, 0.01, 0.11, 0.3, 1.0):
        for n, first in ((8192 * 3 + 77, 12345), (8192, 0), (8192 * 2, GROUP_WORDS - 4099)):  # the last spans two groups
            old, new = _case(n, changed, device, seed=int(changed * 1000) + n)
            ref = _run("library", old, new, 0, first)
            for busy in busy_values:
                got = _run("busy", old, new, busy, first)
                count = int(ref[1].view(torch.int32)[0])
                same = torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])
                if count <= ref[2].numel():  # above the cap the patch is dropped (dense), whatever slots it held
                    a = sorted(zip(ref[2][:count].tolist(), ref[3][:count].tolist()))
                    b = sorted(zip(got[2][:count].tolist(), got[3][:count].tolist()))
                    same = same and a == b
                print(f"changed {changed:.2f} n {n} first {first} busy {busy}: count {count} {'same' if same else 'DIFFERENT'}")
                ok = ok and same
    return ok


def time_it(gib: float, changed: float, busy_values: list[int], reps: int) -> dict[str, float]:
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
    for busy in busy_values:
        def cand(busy: int = busy) -> None:
            base.copy_(old)
            state.zero_()
            busy_diff(new, base, 0, state.view(torch.int32)[:1], state[1], pos, val, busy)

        row[f"busy{busy}_TBps"] = n * 2 / (best_seconds(cand, reps) - t_reset) / 1e12
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--changed", type=float, nargs="+", default=[0.02, 0.11, 0.2])
    ap.add_argument("--busy", type=int, nargs="+", default=[4, 6, 8])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--check", action="store_true", help="only check both kernels write the same (a CPU with TRITON_INTERPRET=1)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu")
    ok = check(device, args.busy)
    print("outputs identical" if ok else "OUTPUTS DIFFER")
    if args.check or device.type != "cuda":
        raise SystemExit(0 if ok else 1)
    rows = [time_it(args.gib, c, args.busy, args.reps) for c in args.changed]
    for r in rows:
        print(json.dumps(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
