"""Host time of the FP8 sender's walk, per quantized weight, on any machine (issue 41).

Why: on 2xH200 a Qwen3-30B-A3B (12 layers) FP8 sync is bound by the sender's walk (`export`: 63.5 ms
for 4,656 quantized weights, 13.6 us of host a weight), not by its kernels or the link. That cost is
Python on one host thread, so it shows on a CPU box too. This drives `Fp8WireSource` over the
preset's real shapes (`torch.empty`: no page is touched) through the grouped path exactly as CUDA
takes it (`fp8/quantize_kernel.py`'s host side: checks, the pointer table, the result views), with
only the Triton launch left out (no GPU here), then through the checks the pipeline's sender runs on
a fresh walk's bucket (`PieceReader.fresh_entries`, its copies left out). The bf16 walk of the same
weights through the sender's known-tensor path (`take_known`) is the reference. Then the whole send
path of the pipeline's `Sender` (the walk, its checks, the pack into slot memory; `export` and `pack`
as a sync reports them) against the bf16 send of the same weights, over a transport that posts
nothing, at the preset's tensor count with tiny dims (`--tiny-dims`: hidden 128, experts 64 x 128,
buckets scaled to hold as many tensors as 1 GiB buckets at the real dims), so the pack's host work
shows and its memcpy stays small. Last, what wrapping the whole preset's source in the FP8 wire
costs (once a sync: `fp8_wire`). `--device cuda:0` walks the real CUDA path, launches included (a
GPU box). The source is stable (a state dict), so the first FP8 walk is recorded and every later
one replays it (`sources/fp8_walk.py`), as a sync of a trainer's held weights does from its second
sync on: `first` is the recording walk, best and median the replays. The FP8 send twice: `filled`,
as a sync sends (from the second send on, the walk writes each bucket into the sender's slot
itself: `sources/fp8_fill.py`, issue 41), and `replayed + packed`, a walk started before the sender
offers its buckets (the path before the fills: views a weight, the sender's checks and pack).

    python bench/fp8_walk_host.py --layers 2 --rounds 61
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterator
from itertools import chain
from typing import Any

import torch

import ckpt_engine.sources.fp8 as wire
from ckpt_engine.benchmark.presets import checkpoint_specs, load_preset_config
from ckpt_engine.fp8 import quantize_kernel
from ckpt_engine.fp8.layout import fp8_specs, quantizes
from ckpt_engine.engine import SendStats
from ckpt_engine.manifest import BucketManifest, TensorMeta, TensorSpec
from ckpt_engine.pipeline.options import PipelineOptions
from ckpt_engine.pipeline.piece_reader import Known, PieceReader, take_known
from ckpt_engine.pipeline.plan_state import PlanState
from ckpt_engine.pipeline.sender import Sender
from ckpt_engine.pipeline.wire_views import has_wire_layout
from ckpt_engine.planning.buckets import plan_buckets
from ckpt_engine.sources.base import StateDictSource, WatchedWeights
from ckpt_engine.sources.fp8_walk import WalkCounts
from ckpt_engine.sources.wire import torch_dtype
from ckpt_engine.transports.transport import Transport, TransportOptions


class _PostsNothing(Transport):
    """A sender's end that posts nothing: what is left of a send is its host work and its copies."""

    name = "posts-nothing"

    @classmethod
    def resolve_device(cls, device: str | int | torch.device | None) -> torch.device:
        return torch.device("cpu" if device is None else device)

    def join(self, rendezvous: Any, rank: int) -> None:
        self.rank, self.world_size = rank, 2

    @property
    def group(self) -> Any:
        return None

    def abort(self) -> None: ...

    def close(self) -> None: ...

    def wait_slot(self, slot: int, works: list[Any]) -> None:
        works[slot] = None

    def post(self, gid: int, slot: int, msg: torch.Tensor) -> Any:
        return None

    def post_group(self, gid: int, slot: int, msgs: list[torch.Tensor]) -> Any:
        return None

    def finish(self, k: int, sender: int, slot: int, work: Any, label: str) -> None: ...

    def release(self, slot: int) -> None: ...

    def drain_slots(self, works: list[Any]) -> None: ...


class _NoHooks:
    def _tamper_hook(self, bucket_index: int, message: torch.Tensor) -> None: ...

    def _tamper_size_hook(self, bucket_index: int, kind: int, size: int) -> int:
        return size

    def _tamper_header_hook(self, bucket_index: int, header: torch.Tensor) -> None: ...


def _sender(specs: list[TensorSpec], bucket_bytes: int, device: torch.device) -> tuple[Sender, BucketManifest, PlanState]:
    """The pipeline's sender over `_PostsNothing`, with the plan of `specs` (as a sync makes them)."""
    link = _PostsNothing(TransportOptions(device=device), bucket_size_bytes=bucket_bytes, num_buffers=2, timeout_s=60.0)
    link.join(None, 0)
    link.alloc_buffers(2)
    manifest = plan_buckets(specs, bucket_bytes)
    sender = Sender(link, PipelineOptions(bucket_bytes, 2, 60.0, False, 0), _NoHooks(), scatter_below=0.25)
    return sender, manifest, PlanState(manifest, 2)


def _tiny(config: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """The preset's tensors at tiny dims, and how much smaller an expert weight got."""
    inner = "moe_intermediate_size" if "moe_intermediate_size" in config else "intermediate_size"  # a dense preset: its MLP
    real = config[inner] * config["hidden_size"]
    config = {**config, "hidden_size": 128, "moe_intermediate_size": 64, "intermediate_size": 256, "head_dim": 16,
              "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 1024}
    return config, config[inner] * config["hidden_size"] / real


class _NoLaunch:
    """Stands in for the Triton kernel object: `kernel[grid](...)` queues nothing (no GPU here)."""

    def __getitem__(self, grid: Any) -> Any:
        return lambda *args, **kwargs: None


def _entries(specs: list[TensorSpec]) -> list[TensorMeta]:
    """Whole-tensor manifest entries (bucket offsets do not matter to the checks)."""
    return [TensorMeta(s.name, s.dtype, s.shape, 0, s.nbytes, 0) for s in specs]


def _consume(it: Iterator[tuple[str, torch.Tensor]], entries: list[TensorMeta], dsts: list[torch.Tensor], device: torch.device) -> None:
    """What the sender's `PieceReader.fresh_entries` does with a fresh walk's bucket of whole
    entries, short of the copies."""
    PieceReader(it, None, 0, device, SendStats()).fresh_entries(entries, dsts)


def _consume_known(it: Iterator[tuple[str, torch.Tensor]], entries: list[TensorMeta], device: torch.device, known: Known) -> None:
    """The bf16 walk of a stable source: checks skipped for the tensors seen last sync."""
    for e in entries:
        take_known(it, e, known, lambda t: has_wire_layout(t, e, device))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=61)
    ap.add_argument("--device", default="cpu", help="cuda:N: the real walk, launches included (host time; kernels waited for between rounds)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    device = torch.device(args.device)
    specs = checkpoint_specs(load_preset_config(args.preset), num_layers=args.layers)
    weights = {s.name: torch.empty(s.shape, dtype=torch_dtype(s.dtype), device=device) for s in specs}  # untouched pages on the CPU
    quantized = sum(quantizes(s) for s in specs)
    if device.type == "cpu":
        wire._group_kernel = lambda w: quantize_kernel  # the CUDA path's grouping on these CPU tensors
        quantize_kernel._quantize_many = _NoLaunch()  # type: ignore[assignment]
    src = wire.Fp8WireSource(StateDictSource(weights))
    fp8_entries, bf16_entries = _entries(fp8_specs(specs)), _entries(specs)
    no_copies = [torch.empty(0)] * len(fp8_entries)  # the checks sort the copies; nothing is copied

    def settle() -> None:  # the queued kernels, outside the timed host work
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    known: Known = {}
    runs: dict[str, list[float]] = {"fp8 walk": [], "fp8 walk + sender checks": [], "bf16 walk + sender checks (known)": []}
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        for _ in src.iter_weights():
            pass
        runs["fp8 walk"].append(time.perf_counter() - t0)
        settle()
        t0 = time.perf_counter()
        _consume(src.iter_weights(), fp8_entries, no_copies, device)
        runs["fp8 walk + sender checks"].append(time.perf_counter() - t0)
        settle()
        t0 = time.perf_counter()
        _consume_known(iter(weights.items()), bf16_entries, device, known)
        runs["bf16 walk + sender checks (known)"].append(time.perf_counter() - t0)
    print(f"{args.preset}, {args.layers} layers: {len(specs)} tensors, {quantized} quantized, {src.last_walk}")
    sends = _send_rounds(args.preset, args.layers, args.rounds, device, settle)
    # A sync wraps the trainer's source anew (`fp8_wire`): what that costs, here for the whole preset
    whole = {s.name: torch.empty(s.shape, dtype=torch_dtype(s.dtype), device="meta") for s in checkpoint_specs(load_preset_config(args.preset))}
    whole_src = StateDictSource(whole)
    wraps = []
    for _ in range(5):
        t0 = time.perf_counter()
        wire.Fp8WireSource(whole_src).metadata()
        wraps.append(time.perf_counter() - t0)
    print(f"wrapping the whole {args.preset} ({len(whole)} tensors) in the FP8 wire, with its metadata: best {min(wraps) * 1e3:.1f} ms a sync")
    ref = min(runs["bf16 walk + sender checks (known)"])
    for name, seconds in runs.items():  # best: the least disturbed round on a shared box
        med, best = statistics.median(seconds), min(seconds)
        print(
            f"{name}: best {best * 1e3:.2f} ms ({best / quantized * 1e6:.2f} us a quantized weight, {best / ref:.2f} x the bf16 walk), "
            f"median {med * 1e3:.2f} ms, first {seconds[0] * 1e3:.2f} ms"
        )
    ref = min(sends["bf16 send"][0])  # (the first rounds record the walk, then make the fills: best is a replay)
    for name, (totals, parts) in sends.items():
        best = min(totals)
        export, pack = parts[totals.index(best)]
        print(
            f"{name}: best {best * 1e3:.2f} ms ({best / quantized * 1e6:.2f} us a quantized weight, {best / ref:.2f} x the bf16 send; "
            f"export {export * 1e3:.2f} ms, pack {pack * 1e3:.2f} ms), median {statistics.median(totals) * 1e3:.2f} ms"
        )


def _send_rounds(
    preset: str, layers: int, rounds: int, device: torch.device, settle: Any
) -> dict[str, tuple[list[float], list[tuple[float, float]]]]:
    """The sender's whole send of the preset at tiny dims, FP8 wire (a fresh walk, as a sync sends
    it) against bf16 (the held tensors, stable): each round's seconds and its (export, pack)."""
    config, shrink = _tiny(load_preset_config(preset))
    specs = checkpoint_specs(config, num_layers=layers)
    weights = {s.name: torch.empty(s.shape, dtype=torch_dtype(s.dtype), device=device) for s in specs}
    bucket = max(int((1 << 30) * shrink) // 256 * 256, max(s.nbytes for s in specs))  # as many tensors a bucket as 1 GiB at the real dims
    src = wire.Fp8WireSource(StateDictSource(weights))
    src.fill_slots = True  # only the sender reads the walk
    fp8 = _sender(src.metadata(), bucket, device)
    bf16 = _sender(StateDictSource(weights).metadata(), bucket, device)
    names = ("fp8 send, filled", "fp8 send, replayed + packed", "bf16 send")
    out: dict[str, tuple[list[float], list[tuple[float, float]]]] = {name: ([], []) for name in names}
    walks: dict[str, WalkCounts] = {}
    for _ in range(rounds):
        for name, (sender, manifest, state) in zip(names, (fp8, fp8, bf16)):
            if name == "bf16 send":
                walk: Any = StateDictSource(weights).iter_weights()
            else:
                it = src.iter_weights()
                if name.endswith("packed"):  # started before the sender offers its buckets: the walk yields views, the sender packs
                    it = chain([next(it)], it)
                walk = WatchedWeights(it, fresh=True)
            t0 = time.perf_counter()
            stats = sender.send(state, manifest, walk, stable=name == "bf16 send", delta=None)
            out[name][0].append(time.perf_counter() - t0)
            out[name][1].append((stats.export_s, stats.pack_s))
            walks[name] = src.last_walk
            settle()
    print(f"the sender's send at tiny dims: {len(fp8[1].buckets)} FP8 buckets of {bucket} bytes ({sum(len(b.entries) for b in fp8[1].buckets)} entries)")
    print("the last walks: " + "; ".join(f"{n}: {w}" for n, w in walks.items() if n != "bf16 send"))
    return out


if __name__ == "__main__":
    main()
