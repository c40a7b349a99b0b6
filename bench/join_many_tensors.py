"""A peer join of many small tensors on the CPU box (issue 43: Qwen3-30B-A3B's 9,435 checkpoint
tensors made the per-tensor work of a join, not its bytes, set its time). Two processes: a serving
peer holding N tensors allocated one by one (as a staged sync's copies are) offers them
(`PeerSource.offer`); the joiner prepares its NIXL agent and the copy it reads into beside the offer
(`JoinPrep.prepare`), then reads and checks (`pull.read_checked`). Prints each phase's seconds,
the regions registered on each side and the reads. `--joiner-slab`: the joiner's copy is one slab
(`LoaderCopy.slab`, as a vLLM joiner's staging copy), laid again in the offer's order at the pull;
`--peer-slab`: the peer holds a slab too (a peer that itself joined by a pull); `--ahead`: the peer
made its agent, registrations and checksums ahead (`PeerSource.ready_ahead`, timed apart as
`peer_ahead_s`), so its offer only packs its head.

    .venv/bin/python bench/join_many_tensors.py --tensors 9435 --min-kib 4 --max-kib 64 [--joiner-slab] [--peer-slab] [--ahead]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass
class Held:
    """What a reference receiver offers: named tensors of one version."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    version: int | None = 1
    stale: bool = False
    receiving: bool = False


def shapes(n: int, min_kib: int, max_kib: int, seed: int) -> dict[str, tuple[int, ...]]:
    """N float16/bfloat16-sized tensors of min..max KiB (2-byte elements, odd counts among them)."""
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(min_kib * 512, max_kib * 512 + 1, (n,), generator=g).tolist()
    return {f"model.layers.{i // 400}.mlp.experts.{i % 400}.w": (s,) for i, s in enumerate(sizes)}


def peer(args: argparse.Namespace) -> None:
    from ckpt_engine.elastic.peer_source import PeerSource

    g = torch.Generator().manual_seed(1)
    specs = shapes(args.tensors, args.min_kib, args.max_kib, 0)
    if args.peer_slab:
        from ckpt_engine.rollout_adapters.vllm.staging import LoaderCopy

        held = Held(LoaderCopy().slab([(n, s, torch.bfloat16) for n, s in sorted(specs.items())], torch.device("cpu")))
        for t in held.tensors.values():
            t.view(torch.int16).copy_(torch.randint(-2**15, 2**15, t.shape, generator=g, dtype=torch.int16))
    else:
        held = Held({n: torch.randint(-2**15, 2**15, s, generator=g, dtype=torch.int16).view(torch.bfloat16) for n, s in specs.items()})
    source = PeerSource(held, ahead=args.ahead)
    t0 = time.perf_counter()
    source.ready_ahead()  # with --ahead: as a peer does when a sync installs, long before a joiner comes
    if not source.ahead_done(600.0):
        raise RuntimeError("the peer's agent was not made ahead within 600 s")
    ahead_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    raw = source.offer(1, 600.0)
    seconds = time.perf_counter() - t0
    Path(args.offer + ".tmp").write_bytes(raw)
    os.replace(args.offer + ".tmp", args.offer)
    print(json.dumps({"offer_s": seconds, "ahead_s": ahead_s, "offer_bytes": len(raw)}), flush=True)
    sys.stdin.readline()  # the joiner is done
    source.close()


def joiner(args: argparse.Namespace) -> dict[str, object]:
    from ckpt_engine.elastic.offer import PeerOffer
    from ckpt_engine.elastic.prepared import JoinPrep
    from ckpt_engine.elastic.pull import read_checked
    from ckpt_engine.rollout_adapters.vllm.staging import LoaderCopy

    with tempfile.TemporaryDirectory() as tmp:
        offer_file = os.path.join(tmp, "offer")
        child = subprocess.Popen([sys.executable, __file__, "--peer", "--offer", offer_file, *args.passed], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            specs = shapes(args.tensors, args.min_kib, args.max_kib, 0)
            copy = LoaderCopy()
            if args.joiner_slab:
                into = copy.slab([(n, s, torch.bfloat16) for n, s in sorted(specs.items())], torch.device("cpu"))
            else:
                into = {n: torch.empty(s, dtype=torch.bfloat16) for n, s in sorted(specs.items())}
            prep = JoinPrep("bench")
            prepared = prep.prepare(into, 600.0)
            deadline = time.monotonic() + 600
            while not os.path.exists(offer_file):
                if child.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the peer made no offer")
                time.sleep(0.01)
            raw = Path(offer_file).read_bytes()
            t0 = time.perf_counter()
            offer = PeerOffer.decode(raw, "peer")  # once a join, in the joiner
            decode_s = time.perf_counter() - t0
            if args.joiner_slab:  # as `VllmPeer.start_pull`: the prepare's slab in the offer's order
                into = copy.slab([(t.name, t.shape, torch.bfloat16) for t in offer.tensors], torch.device("cpu"))
            nbytes, phases, used = read_checked(into, offer, "peer", 600.0, lambda: None, prep)
            child.stdin.write("done\n")
            child.stdin.flush()
            peer_out = json.loads(child.stdout.readline())
        finally:
            child.stdin.close()
            child.wait(60)
    return {"tensors": len(into), "bytes": nbytes, "peer_ahead_s": round(peer_out["ahead_s"], 3), "peer_offer_s": round(peer_out["offer_s"], 3),
            "offer_bytes": peer_out["offer_bytes"], "decode_s": round(decode_s, 4), "prepare_s": round(prepared["seconds"], 3),
            **{f"{k}_s": round(v, 3) for k, v in phases.items()}, "prepare": used, "peer_regions": len(offer.regions),
            "joiner_regions": prepared["regions"], "reads": reads(offer, into)}


def reads(offer: object, into: dict[str, torch.Tensor]) -> int:
    """How many reads the pull made (`pull._runs`' rule): tensors following each other by the same
    gap of at most `MAX_GAP` bytes at the peer and here (both slabs here) share one read."""
    from ckpt_engine.elastic.pull import MAX_GAP

    n, last = 0, None
    for t in offer.tensors:  # type: ignore[attr-defined]
        if not t.nbytes:
            continue
        here = into[t.name].data_ptr()
        if last is None or last[0] != t.region or not 0 <= t.offset - last[1] <= MAX_GAP or here - last[2] != t.offset - last[1]:
            n += 1
        last = (t.region, t.offset + t.nbytes, here + t.nbytes)
    return n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tensors", type=int, default=9435)
    p.add_argument("--min-kib", type=int, default=4)
    p.add_argument("--max-kib", type=int, default=64)
    p.add_argument("--joiner-slab", action="store_true", help="the joiner's copy is one slab (a vLLM joiner's staging copy)")
    p.add_argument("--peer-slab", action="store_true", help="the peer holds one slab (a peer that joined by a pull)")
    p.add_argument("--ahead", action="store_true", help="the peer makes its agent, registrations and checksums ahead (`PeerSource.ready_ahead`), untimed in its offer")
    p.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--offer", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.passed = ["--tensors", str(args.tensors), "--min-kib", str(args.min_kib), "--max-kib", str(args.max_kib), *(["--peer-slab"] if args.peer_slab else []),
                   *(["--ahead"] if args.ahead else [])]
    if args.peer:
        return peer(args)
    print(json.dumps(joiner(args)))


if __name__ == "__main__":
    main()
