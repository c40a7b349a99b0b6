"""Delta codec throughput, in GB/s of DENSE bytes (the image size over the seconds taken).

Two images of one bf16 bucket (default 1 GiB on CUDA, 256 MiB on CPU) whose words differ in ~2 %
and ~15 % of places (the lowest mantissa bit flipped, as an optimizer step at RL learning rates
does), per implementation: the fused Triton kernels and plain torch ops on CUDA, numpy views
("host") and plain torch ops on CPU. Per case: encode, encode_into_base, decode, apply,
delta_checksum, and a full checksum; on CUDA also a plain `torch.ne` compare and a device copy of
the same bytes for scale, and the host syncs one encode makes. Checks the round trip bit for bit.

    python bench/delta_codec_bench.py --device cuda --size-mib 1024 --json out.json
    python bench/delta_codec_bench.py --device cpu --size-mib 256
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback
import warnings
from collections.abc import Callable

import torch

from ckpt_engine.delta import accel, codec, kernels


def _timer(device: torch.device, fn: Callable[[], object], repeats: int, setup: Callable[[], None] | None = None) -> float:
    """Median seconds of `fn` after one warm-up call; `setup` runs untimed before each call."""
    times = []
    for i in range(repeats + 1):
        if setup is not None:
            setup()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def _images(nbytes: int, frac: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(0)
    n = nbytes // 2
    base = torch.empty(n, dtype=torch.bfloat16, device=device)
    new_bits = torch.empty(n, dtype=torch.int16, device=device)
    step = 1 << 24
    for s in range(0, n, step):  # chunks keep the float32 temporaries small
        e = min(s + step, n)
        base[s:e] = torch.randn(e - s, generator=g, device=device) * 0.02
        flip = (torch.rand(e - s, generator=g, device=device) < frac).to(torch.int16)
        new_bits[s:e] = base[s:e].view(torch.int16) ^ flip
    return base.view(torch.uint8), new_bits.view(torch.uint8)


def _host_syncs(fn: Callable[[], object]) -> int:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum(str(w.message).startswith("called a synchronizing") for w in caught)


def _kernel_split(device: torch.device, base: torch.Tensor, new: torch.Tensor, kind: str, repeats: int) -> tuple[float, float]:
    """Seconds of the Triton compare+count+pack pass and of the compact pass alone (each with the
    delta sum when kernels.DELTA_IN_COMPACT puts it there)."""
    bw, nw = base.view(torch.int16), new.view(torch.int16)
    late = kernels.DELTA_IN_COMPACT
    t_pack = _timer(device, lambda: kernels.compare_pack(bw, nw, with_delta=not late), repeats)
    counts, _, mask = kernels.compare_pack(bw, nw, with_delta=not late)
    offsets = torch.cumsum(counts, 0) - counts
    c = int(counts.sum())
    values = torch.empty(c, dtype=torch.int16, device=device)
    positions = torch.empty(c, dtype=torch.int32, device=device) if kind == "positions32" else None
    t_compact = _timer(
        device,
        lambda: kernels.compact(
            mask, (bw.numel() + 7) // 8, counts, offsets, new_w=nw, values_out=values, positions_out=positions, old_w=bw if late else None
        ),
        repeats,
    )
    return t_pack, t_compact


# Settings the sweep tries: (words per block, warps, delta sum in the compact pass, set bits each
# row peels per compact round).
SWEEP = [
    (1024, 2, True, 1),
    (1024, 2, True, 2),
    (1024, 2, False, 2),
    (2048, 2, True, 2),
    (2048, 4, True, 1),
    (2048, 4, True, 2),
    (2048, 4, False, 1),
    (4096, 4, True, 1),
    (4096, 4, True, 2),
    (4096, 8, True, 2),
    (8192, 8, True, 2),
]


def sweep(device: torch.device, base: torch.Tensor, new: torch.Tensor, repeats: int) -> list[dict]:
    """Time Triton encode and encode_into_base under the SWEEP settings; keep the fastest
    encode_into_base (the sender's call)."""
    out = torch.empty_like(base)
    work = torch.empty_like(base)
    gb = base.numel() / 1e9
    rows = []
    kind = codec.decode(out[: codec.encode(base, new, 2, out, impl="torch")], base.numel(), 2, impl="torch").kind
    for block, warps, late, walk in SWEEP:
        kernels.BLOCK_WORDS, kernels.NUM_WARPS, kernels.DELTA_IN_COMPACT, kernels.WALK_BITS = block, warps, late, walk
        try:  # one setting that fails to compile must not hide the others
            t_enc = _timer(device, lambda: codec.encode(base, new, 2, out, impl="triton"), repeats)
            t_into = _timer(
                device, lambda: codec.encode_into_base(work, new, 2, out, impl="triton"), repeats, setup=lambda: work.copy_(base)
            )
            t_pack, t_compact = _kernel_split(device, base, new, kind, repeats)
            t_sum = _timer(device, lambda: codec.checksum(base, 2, impl="triton"), repeats)
        except Exception:
            traceback.print_exc()
            continue
        rows.append(
            {"op": "sweep", "block_words": block, "num_warps": warps, "delta_in_compact": late, "walk_bits": walk}
            | {"encode_s": t_enc}
            | {"encode_into_base_s": t_into, "compare_pack_s": t_pack, "compact_s": t_compact, "checksum_s": t_sum}
        )
        print(
            f"  sweep block {block:5d} warps {warps:2d} walk {walk} delta in {'compact' if late else 'pack   '}: encode {t_enc * 1e3:.3f} ms "
            f"into_base {t_into * 1e3:.3f} ms  compare+pack {t_pack * 1e3:.3f} ms  compact {t_compact * 1e3:.3f} ms  "
            f"checksum {gb / t_sum:7.1f} GB/s",
            flush=True,
        )
    best = min(rows, key=lambda r: r["encode_into_base_s"])
    kernels.BLOCK_WORDS, kernels.NUM_WARPS = best["block_words"], best["num_warps"]
    kernels.DELTA_IN_COMPACT, kernels.WALK_BITS = best["delta_in_compact"], best["walk_bits"]
    print(f"  using block {best['block_words']} warps {best['num_warps']} walk {best['walk_bits']} delta in compact {best['delta_in_compact']}")
    return rows


def run(device: torch.device, nbytes: int, fracs: list[float], impls: list[str], repeats: int, do_sweep: bool) -> list[dict]:
    rows = []
    gb = nbytes / 1e9
    for frac in fracs:
        base, new = _images(nbytes, frac, device)
        changed = float((base.view(torch.int16) != new.view(torch.int16)).float().mean())
        out = torch.empty(codec.max_patch_bytes(nbytes, 2), dtype=torch.uint8, device=device)
        work = torch.empty_like(base)
        if not rows:
            t_ne = _timer(device, lambda: torch.ne(base.view(torch.int16), new.view(torch.int16)), repeats)
            t_cp = _timer(device, lambda: work.copy_(new), repeats)
            print(f"{device.type} reference: torch.ne compare {gb / t_ne:8.1f} GB/s, device copy {gb / t_cp:8.1f} GB/s")
            rows.append({"device": device.type, "op": "reference", "ne_gbps": gb / t_ne, "copy_gbps": gb / t_cp})
        if device.type == "cuda" and "triton" in impls and do_sweep:  # per fraction: the best may differ
            try:
                rows += [r | {"changed": changed} for r in sweep(device, base, new, repeats)]
            except Exception:
                traceback.print_exc()
        for impl in impls:
            try:
                rows.append(_measure(device, impl, base, new, out, work, changed, repeats))
            except Exception:  # one failing implementation must not hide the others' figures
                traceback.print_exc()
        del base, new, out, work
    return rows


def _measure(
    device: torch.device, impl: str, base: torch.Tensor, new: torch.Tensor, out: torch.Tensor, work: torch.Tensor, changed: float, repeats: int
) -> dict:
    """Check one implementation's round trip on the two images, then time each operation."""
    nbytes = base.numel()
    gb = nbytes / 1e9
    n = codec.encode(base, new, 2, out, impl=impl)
    assert n is not None, "a 2-15 % change must give a patch"
    patch = codec.decode(out[:n], nbytes, 2, impl=impl)
    work.copy_(base)
    codec.apply(work, patch, impl=impl)
    assert torch.equal(work, new), "round trip is not bit-exact"
    assert int(codec.checksum(base, 2, impl=impl) + codec.delta_checksum(base, patch, impl=impl)) == int(
        codec.checksum(new, 2, impl=impl)
    )
    row = {"device": device.type, "impl": impl, "changed": changed, "patch_ratio": n / nbytes, "kind": patch.kind}
    row["encode_s"] = _timer(device, lambda: codec.encode(base, new, 2, out, impl=impl), repeats)
    row["encode_into_base_s"] = _timer(
        device, lambda: codec.encode_into_base(work, new, 2, out, impl=impl), repeats, setup=lambda: work.copy_(base)
    )
    row["decode_s"] = _timer(device, lambda: codec.decode(out[:n], nbytes, 2, impl=impl), repeats)
    row["apply_s"] = _timer(device, lambda: codec.apply(work, patch, impl=impl), repeats)
    row["delta_checksum_s"] = _timer(device, lambda: codec.delta_checksum(base, patch, impl=impl), repeats)
    row["checksum_s"] = _timer(device, lambda: codec.checksum(base, 2, impl=impl), repeats)
    if device.type == "cuda":
        row["encode_host_syncs"] = _host_syncs(lambda: codec.encode(base, new, 2, out, impl=impl))
    if impl == "triton":
        row["compare_pack_s"], row["compact_s"] = _kernel_split(device, base, new, patch.kind, repeats)
        row["block_words"], row["num_warps"], row["walk_bits"] = kernels.BLOCK_WORDS, kernels.NUM_WARPS, kernels.WALK_BITS
        row["delta_in_compact"] = kernels.DELTA_IN_COMPACT
    figures = "  ".join(
        f"{k[:-2]} {gb / row[k]:8.2f} GB/s ({row[k] * 1e3:7.2f} ms)"
        for k in ("encode_s", "encode_into_base_s", "decode_s", "apply_s", "delta_checksum_s", "checksum_s")
    )
    syncs = f"  syncs/encode {row['encode_host_syncs']}" if "encode_host_syncs" in row else ""
    if "compare_pack_s" in row:
        syncs += f"  [compare+pack {row['compare_pack_s'] * 1e3:.2f} ms, compact {row['compact_s'] * 1e3:.2f} ms]"
    print(
        f"{device.type} {impl:6s} changed {changed * 100:5.2f} %  patch {row['patch_ratio'] * 100:5.2f} % "
        f"({row['kind']}){syncs}\n    {figures}",
        flush=True,
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size-mib", type=int, default=None, help="image size (default 1024 on CUDA, 256 on CPU)")
    parser.add_argument("--fracs", default="0.02,0.15", help="fractions of words changed")
    parser.add_argument("--impls", default=None, help="comma list of triton,torch,host (default: all that run here)")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats, median reported (default 5 CUDA, 2 CPU)")
    parser.add_argument("--json", default=None, help="write the figures here")
    parser.add_argument("--no-sweep", action="store_true", help="skip the Triton block/warps/delta-pass sweep")
    args = parser.parse_args()
    device = torch.device(args.device)
    size_mib = args.size_mib if args.size_mib is not None else (1024 if device.type == "cuda" else 256)
    if args.impls is not None:
        impls = args.impls.split(",")
    elif device.type == "cuda":
        impls = ["triton", "torch"] if accel.triton_on(device) else ["torch"]
    else:
        impls = ["host", "torch"]
    repeats = args.repeats if args.repeats is not None else (5 if device.type == "cuda" else 2)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"delta codec bench: {name}, {size_mib} MiB bf16 image, torch {torch.__version__}, threads {torch.get_num_threads()}")
    rows = run(device, size_mib << 20, [float(f) for f in args.fracs.split(",")], impls, repeats, not args.no_sweep)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "size_mib": size_mib, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
