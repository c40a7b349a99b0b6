"""`ckpt-engine bench`: spawn a sender and N receivers, measure, check, print a table.

The driver hosts the rendezvous store (free port from the OS), starts one process per rank, shows
a progress bar while they run, then prints best and median seconds, GB/s, each mode's speed
relative to `raw` (`ratio_to_raw` = raw seconds / the mode's seconds: higher is better, 1.0 = the
link's own speed; the JSON says so in `ratio_meaning` and what raw moved in `raw_meaning`), the
memory every mode took and what the full model needs per rank, and fails if any receiver's
weights differ from the sender's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from typing import TYPE_CHECKING, Any

import torch

from ckpt_engine.benchmark.memory import MemoryPlan, memory_plan
from ckpt_engine.benchmark.presets import PRESETS, checkpoint_specs, load_preset_config
from ckpt_engine.benchmark.rank_exit import RankDied, collect_results
from ckpt_engine.benchmark.raw_link import raw_meaning, raw_message_bytes
from ckpt_engine.cli_args import OneLineParser, above_zero, at_least, seconds
from ckpt_engine.registry import CheckpointEngineRegistry
from ckpt_engine.store import serve_store
from ckpt_engine.sync.report import RATIO_MEANING
from ckpt_engine.transports.colocated import ColocatedTransport
from ckpt_engine.transports.transport import Transport

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["MODES", "main", "run_bench"]

MODES = ("raw", "bucketed", "naive", "ours")
COLOCATED_MODES = ("raw", "ours")
"""Colocated processes share one device and no process group: raw is a device-to-device copy of
the same bytes; bucketed and naive are broadcasts, which do not exist there."""
PULL_MODES = ("ours",)
"""A one-sided transport (`Transport.one_sided`: nixl, whose receivers read the senders' registered
memory) has no broadcast to time beside it: pair it with gloo's or nccl's raw on the same machine."""


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="ckpt-engine bench", description=__doc__)
    p.add_argument("--preset", default="tiny", help=f"{', '.join(PRESETS)} or a path to an HF config.json")
    p.add_argument("--layers", type=at_least(1), default=None, help="override the number of decoder layers (>= 1)")
    p.add_argument("--backend", default="auto", help="auto, gloo, nccl, ...")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--bucket-mb", type=above_zero, default=None, help="bucket size in MiB (default: 1024 on CUDA, 64 on CPU, or the largest tensor if larger)")
    p.add_argument("--buffers", type=at_least(2), default=2, help="rotating buffers per side (>= 2)")
    p.add_argument("--receivers", type=at_least(1), default=1)
    p.add_argument(
        "--in-place", action="store_true",
        help="receivers offer their tensors as destinations: tensors split over buckets are reassembled in place",
    )
    p.add_argument(
        "--solo-mb", type=at_least(0, float), default=None,
        help="tensors of at least this many MiB travel in a bucket of their own (default: the backend's; 0: never)",
    )
    p.add_argument(
        "--engine-kwargs", default=None, metavar="JSON",
        help='extra backend options as a JSON object, e.g. \'{"group_max_tensors": 0}\'',
    )
    p.add_argument("--profile", default=None, metavar="DIR", help="after timing, trace one more sync with torch.profiler (a Chrome trace per rank in DIR)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument(
        "--wire-dtype", choices=("fp8",), default=None,
        help="block-FP8 on the wire (checkpoint_engine.wire_dtype=fp8): the sender quantizes every linear weight inside the timed sync; "
        "receivers hold the FP8 checkpoint layout (with --receiver-tp: the region bench, --link-mb-s; with --delta / --senders N: the "
        "chain bench, the same versions on a bf16 wire and then on the FP8 one)",
    )
    p.add_argument("--iters", type=at_least(1), default=3)
    p.add_argument(
        "--modes", default=None,
        help="comma-separated subset of raw,bucketed,naive,ours (default raw,naive,ours; colocated: raw,ours). raw: the bytes "
        "in broadcasts of <= 1 GiB from 2 rotating buffers (colocated: one device-to-device copy); bucketed: raw in bucket-sized messages",
    )
    p.add_argument("--timeout-s", type=seconds, default=600.0, help="bound on every wait, in (0, 604800] seconds")
    p.add_argument("--json", default=None, help="write results as JSON to this file ('-' for stdout)")
    p.add_argument("--senders", type=at_least(1), default=1, help="sending ranks (>= 1); above 1 each sends its dim-0 row block of every matrix")
    p.add_argument("--delta", action="store_true", help="real consecutive versions (AdamW on fp32 masters, cast to --dtype) sent as lossless patches")
    p.add_argument("--lr", type=above_zero, default=1e-6, help="AdamW learning rate of the versions --delta generates")
    p.add_argument("--versions", type=at_least(1), default=3, help="patch syncs after the dense seed with --delta")
    p.add_argument(
        "--receiver-tp", type=at_least(1), default=None,
        help="receiver ranks are TP ranks of this size holding only their slices: region delivery against whole-tensor receive (benchmark/regions.py)",
    )
    p.add_argument(
        "--link-mb-s", type=above_zero, default=None,
        help="with --receiver-tp over gloo: every rank's link paced to this many MB/s in and out (a network-bound emulation; benchmark/paced_link.py)",
    )
    p.add_argument("--fused-experts", action="store_true", help="with --receiver-tp: each layer's routed experts travel as one stacked tensor per projection")
    p.add_argument(
        "--region-slot-memory-mb", type=above_zero, default=None,
        help="with --receiver-tp: the senders' slot memory for receiver sets side by side (checkpoint_engine.region_slot_memory_mb; unset: 8 sets)",
    )
    return p


def default_bucket_mb(args: argparse.Namespace, device: str) -> float:
    """1 GiB on CUDA (64 MiB on CPU), grown to hold the largest tensor whole: a tensor split over
    buckets needs a reassembly tensor on the receiver, which is extra memory beyond the buffers."""
    base = 1024 if device == "cuda" else 64
    specs = checkpoint_specs(load_preset_config(args.preset), dtype=args.dtype, num_layers=args.layers)
    largest = max((s.nbytes for s in specs), default=0)
    step = 256 if device == "cuda" else 16
    return float(max(base, -(-largest // (step << 20)) * step))


def parse_engine_kwargs(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--engine-kwargs is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"--engine-kwargs must be a JSON object, got {type(value).__name__}")
    return value


def is_colocated(backend: str) -> bool:
    return issubclass(CheckpointEngineRegistry.get(backend), ColocatedTransport)


def is_pull(backend: str) -> bool:
    """A one-sided transport (nixl): receivers read the senders' memory, nothing broadcasts."""
    cls = CheckpointEngineRegistry.get(backend)
    return issubclass(cls, Transport) and cls.one_sided


def resolve_modes(args: argparse.Namespace, backend: str) -> str:
    """The modes to run on `backend`; modes it cannot run are refused by name, before any rank starts."""
    colocated, pull = is_colocated(backend), is_pull(backend)
    if args.modes is None:
        return ",".join(COLOCATED_MODES if colocated else PULL_MODES if pull else ("raw", "naive", "ours"))
    if pull and (refused := [m for m in args.modes.split(",") if m not in PULL_MODES]):
        raise ValueError(
            f"--modes {','.join(refused)}: the {backend} backend has no process group to broadcast on (its receivers read the "
            f"senders' memory); its mode is {','.join(PULL_MODES)}: run gloo's or nccl's raw beside it for the link's own speed"
        )
    if colocated:
        refused = [m for m in args.modes.split(",") if m not in COLOCATED_MODES]
        if refused:
            raise ValueError(
                f"--modes {','.join(refused)}: the colocated backend has no broadcast (sender and receiver share one device "
                f"through shared buffers); its modes are {','.join(COLOCATED_MODES)} (raw: a device-to-device copy of the same bytes)"
            )
        if args.receivers != 1:
            raise ValueError(f"--receivers {args.receivers}: the colocated backend pairs one sender with one receiver")
    return args.modes


def run_bench(args: argparse.Namespace, show_progress: bool = True) -> dict[str, Any]:
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    backend = CheckpointEngineRegistry.resolve_name(args.backend, device)
    CheckpointEngineRegistry.get(backend)  # fail early, with the list of backends
    args.modes = resolve_modes(args, backend)
    if args.engine_kwargs is not None:
        try:
            CheckpointEngineRegistry.check_options(backend, parse_engine_kwargs(args.engine_kwargs))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"--engine-kwargs: {backend}: {exc}") from None
    bucket_mb = args.bucket_mb if args.bucket_mb is not None else default_bucket_mb(args, device)
    world = args.receivers + 1
    store = serve_store("127.0.0.1", args.timeout_s)
    token = uuid.uuid4().hex
    prefixed = torch.distributed.PrefixStore(f"{token}/", store)
    common = [
        "--world-size", str(world), "--host", "127.0.0.1", "--port", str(store.port), "--token", token,
        "--backend", backend, "--device", device, "--preset", args.preset, "--dtype", args.dtype,
        "--bucket-mb", str(bucket_mb), "--buffers", str(args.buffers), "--iters", str(args.iters),
        "--modes", args.modes, "--timeout-s", str(args.timeout_s),
    ]
    if args.layers is not None:
        common += ["--layers", str(args.layers)]
    if args.in_place:
        common.append("--in-place")
    if args.solo_mb is not None:
        common += ["--solo-mb", str(args.solo_mb)]
    if args.profile:
        common += ["--profile", os.path.abspath(args.profile)]
    if args.engine_kwargs is not None:
        common += ["--engine-kwargs", json.dumps(parse_engine_kwargs(args.engine_kwargs))]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # like torchrun: ranks sharing a host must not oversubscribe it
    procs = [
        subprocess.Popen([sys.executable, "-m", "ckpt_engine.benchmark.worker", "--rank", str(r), *common], env=env)
        for r in range(world)
    ]
    from tqdm import tqdm  # the `cli` extra, checked by main()

    steps = args.iters * len(args.modes.split(","))
    deadline = time.monotonic() + args.timeout_s * (steps + 2)
    with tqdm(total=steps, desc=f"bench {args.preset} {backend}", disable=not show_progress, file=sys.stderr) as bar:
        results = collect_results(procs, prefixed, deadline, "bench", on_tick=lambda: bar.update(prefixed.add("progress", 0) - bar.n))
        bar.update(steps - bar.n)
    return summarize(results, args, backend, device, bucket_mb)


def plan_memory(args: argparse.Namespace, backend: str, bucket_mb: float, modes: list[str], num_layers: int | None) -> MemoryPlan:
    """The busiest device's memory for this run's settings with `num_layers` (None: the full model)."""
    specs = checkpoint_specs(load_preset_config(args.preset), dtype=args.dtype, num_layers=num_layers)
    total = sum(s.nbytes for s in specs)
    bucket = int(bucket_mb * (1 << 20)) // 4096 * 4096
    return memory_plan(
        total, max((s.nbytes for s in specs), default=0), bucket, args.buffers, raw_message_bytes(total, bucket), modes,
        colocated=is_colocated(backend), in_place=args.in_place,
    )


def summarize(results: list[dict[str, Any]], args: argparse.Namespace, backend: str, device: str, bucket_mb: float) -> dict[str, Any]:
    sender = results[0]
    nbytes = sender["bytes"]
    bucket = int(bucket_mb * (1 << 20)) // 4096 * 4096
    summary: dict[str, Any] = {
        "preset": args.preset, "layers": args.layers, "backend": backend, "device": device, "receivers": args.receivers,
        "dtype": args.dtype, "bucket_mb": bucket_mb, "buffers": args.buffers, "in_place": args.in_place, "solo_mb": args.solo_mb,
        "engine_kwargs": parse_engine_kwargs(args.engine_kwargs) if args.engine_kwargs else {}, "bytes": nbytes, "tensors": sender["tensors"],
        "iters": args.iters, "ratio_meaning": RATIO_MEANING, "modes": {},
    }
    if torch.cuda.is_available() and device == "cuda":
        summary["gpu"] = torch.cuda.get_device_name(0)
    for mode in MODES:
        key = f"{mode}_s"
        if key not in sender:
            continue
        times = [max(r[key][i] for r in results) for i in range(len(sender[key]))]  # slowest rank per iteration
        best = min(times)
        summary["modes"][mode] = {
            "best_s": best, "median_s": statistics.median(times), "gbps": nbytes / best / 1e9, "all_s": times,
            "extra_mem_bytes": {f"rank{r['rank']}": r["extra_mem"][mode] for r in results},
        }
    raw = summary["modes"].get("raw")
    if raw is not None:
        message = raw_message_bytes(nbytes, bucket)
        summary["raw_message_bytes"] = message
        summary["raw_meaning"] = raw_meaning(message, nbytes, is_colocated(backend))
    for mode, m in summary["modes"].items():
        m["ratio_to_raw"] = raw["best_s"] / m["best_s"] if raw else None
    if "ours_s" in sender:
        summary["buckets"] = sender["buckets"]
        summary["solo_bytes"] = sender["solo_bytes"]
        summary["extra_mem_bytes"] = {f"rank{r['rank']}": r["ours_extra_mem"] for r in results}
        summary["buffer_bytes"] = sender["buffer_bytes"]
    modes = list(summary["modes"])
    summary["memory_plan"] = plan_memory(args, backend, bucket_mb, modes, args.layers).to_dict()
    summary["memory_plan_full"] = plan_memory(args, backend, bucket_mb, modes, None).to_dict()
    expected = sender["expected_checksum"]
    problems = []
    for r in results[1:]:
        for mode in ("naive", "ours"):
            if f"{mode}_checksum" in r and r[f"{mode}_checksum"] != expected:
                problems.append(f"rank {r['rank']} {mode}: weights differ from the sender's")
    summary["correct"] = not problems
    summary["problems"] = problems
    return summary


def _mib(v: int | None) -> str:
    return "?" if v is None else f"{v / 2**20:,.0f}"


def print_summary(summary: dict[str, Any], console: Console) -> None:
    from rich.table import Table
    title = (
        f"{summary['preset']}: {summary['tensors']} tensors, {summary['bytes'] / 1e9:.3f} GB {summary['dtype']}, "
        f"{summary['backend']} on {summary.get('gpu', summary['device'])}, {summary['receivers']} receiver(s), "
        f"bucket {summary['bucket_mb']:.0f} MiB x {summary['buffers']}"
    )
    table = Table(title=title)
    for col in ("mode", "best s", "median s", "GB/s", "vs raw", "extra MiB per rank"):
        table.add_column(col, justify="right" if col != "mode" else "left")
    colocated = summary.get("raw_meaning", "").startswith("one device-to-device copy")
    labels = {
        "raw": "device-to-device copy" if colocated else "raw broadcast", "bucketed": "raw in bucket-sized messages",
        "naive": "naive per-tensor", "ours": "ckpt-engine sync",
    }
    for mode, m in summary["modes"].items():
        ratio = f"{m['ratio_to_raw']:.3f}" if m["ratio_to_raw"] is not None else "-"
        mem = " / ".join(_mib(v) for v in m["extra_mem_bytes"].values())
        table.add_row(labels[mode], f"{m['best_s']:.4f}", f"{m['median_s']:.4f}", f"{m['gbps']:.2f}", ratio, mem)
    console.print(table)
    if "raw_meaning" in summary:
        console.print(f"raw: {summary['raw_meaning']}")
    console.print(f"vs raw: {summary['ratio_meaning']}")
    if "extra_mem_bytes" in summary:
        mem = ", ".join(f"{k} {_mib(v)} MiB" for k, v in summary["extra_mem_bytes"].items())
        console.print(f"extra memory during sync (buffers included): {mem} (buffers: {summary['buffer_bytes'] / 2**20:.0f} MiB per side)")
    for key, what in (("memory_plan", "this run"), ("memory_plan_full", "the full model")):
        if key == "memory_plan_full" and summary["layers"] is None:
            continue
        p = summary[key]
        modes = ", ".join(f"{k[: -len('_extra')]} +{p[k] / 2**30:.2f}" for k in p if k.endswith("_extra"))
        weights = f"{p['ranks_per_device']} x " if p["ranks_per_device"] > 1 else ""
        console.print(
            f"memory per device, {what} (planned): weights {weights}{p['weights'] / 2**30:.2f} GiB + buffers {p['buffers'] / 2**30:.2f} GiB "
            f"+ the largest mode ({modes} GiB): peak {p['peak'] / 2**30:.2f} GiB"
        )
    console.print("correctness: " + ("receivers' weights equal the sender's" if summary["correct"] else "; ".join(summary["problems"])))


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    from rich.console import Console  # the `cli` extra (rich, tqdm): ckpt_engine/cli.py names it when missing
    import tqdm  # noqa: F401  (imported here so a missing one fails before any rank starts)
    unknown = sorted(set(args.modes.split(",")) - set(MODES)) if args.modes is not None else []
    if unknown:
        parser.error(f"argument --modes: unknown mode(s) {', '.join(unknown)}; allowed: {', '.join(MODES)}")
    if args.receiver_tp is None and (args.link_mb_s is not None or args.fused_experts or args.region_slot_memory_mb is not None):
        parser.error("--link-mb-s, --fused-experts and --region-slot-memory-mb go with --receiver-tp (the region bench)")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here; use --device cpu (or auto)")
    if args.json not in (None, "-"):  # a path the results cannot reach is refused before the run, not after it
        try:
            open(args.json, "a").close()
        except OSError as exc:
            parser.error(f"--json: {exc}")
    chain = (args.delta or args.senders > 1) and args.receiver_tp is None
    if args.wire_dtype is not None and args.receiver_tp is None and not chain:
        parser.error(
            "--wire-dtype fp8 goes with --receiver-tp (the region bench, --link-mb-s) or the chain bench (--delta / --senders N, "
            "which runs a bf16 chain and then the FP8 one); the dense bench does not take it yet: for whole-model syncs use "
            "--receiver-tp 1 (its `full` mode), beside the same command without --wire-dtype"
        )
    try:
        if args.receiver_tp is not None:
            from ckpt_engine.benchmark.regions import print_region_summary, run_region_bench

            device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
            backend = CheckpointEngineRegistry.resolve_name(args.backend, device)
            bucket_mb = args.bucket_mb if args.bucket_mb is not None else default_bucket_mb(args, device)
            summary = run_region_bench(args, backend, device, bucket_mb)
        elif chain:
            from ckpt_engine.benchmark.chain import run_chain_bench

            device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
            backend = CheckpointEngineRegistry.resolve_name(args.backend, device)
            bucket_mb = args.bucket_mb if args.bucket_mb is not None else default_bucket_mb(args, device)
            summary = run_chain_bench(args, backend, device, bucket_mb)
        else:
            summary = run_bench(args, show_progress=args.json != "-")
    except ValueError as exc:  # bad preset, backend or device: say what, no traceback
        print(f"ckpt-engine bench: error: {exc}", file=sys.stderr)
        return 2
    except RankDied as exc:  # e.g. the OOM killer: one line naming the rank, not its peers' tracebacks
        print(f"ckpt-engine bench: error: {exc}", file=sys.stderr)
        return 1
    if args.json == "-":
        print(json.dumps(summary, indent=2))
    else:
        if args.receiver_tp is not None:
            print_region_summary(summary, Console())
        elif chain:
            from ckpt_engine.benchmark.chain import print_chain_summary

            print_chain_summary(summary, Console())
        else:
            print_summary(summary, Console())
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summary, f, indent=2)
    return 0 if summary["correct"] else 1
