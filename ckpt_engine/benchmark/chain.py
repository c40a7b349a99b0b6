"""`ckpt-engine bench --delta` / `--senders N`: the driver for `chain_worker`.

Starts the senders and receivers, collects their JSON, and reports in one table: the raw
broadcast of all bytes from one sender, the same bytes split over every sender at once, the dense
sync, the delta seed and each patch sync (wire bytes, changed fraction, encode / apply seconds),
each mode's speed relative to raw (`ratio_to_raw` = raw seconds / the mode's seconds, as in every
bench JSON: `ratio_meaning`), the base copies' memory, and whether every receiver ended bit-exact.
With --delta it also says what `delta: auto` would pick from these timings (`DeltaPolicy`'s rule).

`--wire-dtype fp8` runs the same chain twice in one call, the same versions on a bf16 wire and then
through the block-FP8 wire (receivers holding the FP8 layout), and reports both side by side, with
the fraction of FP8 codes and scales each version changed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import uuid
from typing import TYPE_CHECKING, Any

import torch

from ckpt_engine.benchmark.rank_exit import collect_results
from ckpt_engine.benchmark.raw_link import raw_meaning, raw_message_bytes
from ckpt_engine.delta.request import DeltaRequest
from ckpt_engine.sync.delta_policy import SyncCosts
from ckpt_engine.sync.report import RATIO_MEANING
from ckpt_engine.store import serve_store

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["print_chain_summary", "run_chain_bench"]


def launch_ranks(module: str, world: int, common: list[str], timeout_s: float, store: Any) -> list[dict[str, Any]]:
    """Run `python -m module --rank r ...` for every rank; their JSON results from the store."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # like torchrun: ranks sharing a host must not oversubscribe it
    procs = [subprocess.Popen([sys.executable, "-m", module, "--rank", str(r), *common], env=env) for r in range(world)]
    return collect_results(procs, store, time.monotonic() + timeout_s, f"bench (within {timeout_s:.0f}s)")


def run_chain_bench(args: argparse.Namespace, backend: str, device: str, bucket_mb: float) -> dict[str, Any]:
    """One chain (module docstring); with --wire-dtype fp8 the bf16 chain, then the FP8 one."""
    if getattr(args, "wire_dtype", None) is None:
        return _run_chain(args, backend, device, bucket_mb, None)
    runs = {wire: _run_chain(args, backend, device, bucket_mb, wire) for wire in ("bf16", "fp8")}
    return {
        "wires": runs, "correct": all(r["correct"] for r in runs.values()),
        "problems": [f"{w}: {p}" for w, r in runs.items() for p in r["problems"]],
        "fp8_over_bf16_bytes": runs["fp8"]["bytes"] / runs["bf16"]["bytes"],
    }


def _run_chain(args: argparse.Namespace, backend: str, device: str, bucket_mb: float, wire: str | None) -> dict[str, Any]:
    world = args.senders + args.receivers
    store = serve_store("127.0.0.1", args.timeout_s)
    token = uuid.uuid4().hex
    common = [
        "--world-size", str(world), "--senders", str(args.senders), "--host", "127.0.0.1", "--port", str(store.port),
        "--token", token, "--backend", backend, "--device", device, "--preset", args.preset, "--dtype", args.dtype,
        "--bucket-mb", str(bucket_mb), "--buffers", str(args.buffers), "--iters", str(args.iters),
        "--timeout-s", str(args.timeout_s), "--lr", str(args.lr), "--versions", str(args.versions),
    ]
    if args.layers is not None:
        common += ["--layers", str(args.layers)]
    if args.delta:
        common.append("--delta")
    if wire == "fp8":
        common += ["--wire-dtype", "fp8"]
    if getattr(args, "in_place", False):
        common.append("--in-place")
    if args.engine_kwargs is not None:
        common += ["--engine-kwargs", args.engine_kwargs]
    if getattr(args, "profile", None):
        common += ["--profile", os.path.abspath(args.profile)]
    steps = 4 + args.iters * 3 + args.versions
    results = launch_ranks("ckpt_engine.benchmark.chain_worker", world, common, args.timeout_s * steps, torch.distributed.PrefixStore(f"{token}/", store))
    s = summarize_chain(results, args, backend, device, bucket_mb)
    s["wire"] = wire
    return s


def _slowest(results: list[dict[str, Any]], key: str) -> list[float]:
    return [max(r[key][i] for r in results) for i in range(len(results[0][key]))]


def summarize_chain(results: list[dict[str, Any]], args: argparse.Namespace, backend: str, device: str, bucket_mb: float) -> dict[str, Any]:
    nbytes = results[0]["bytes"]
    s: dict[str, Any] = {
        "preset": args.preset, "layers": args.layers, "backend": backend, "device": device, "senders": args.senders,
        "receivers": args.receivers, "bucket_mb": bucket_mb, "bytes": nbytes, "delta": args.delta, "lr": args.lr, "modes": {},
        "in_place": bool(getattr(args, "in_place", False)), "ratio_meaning": RATIO_MEANING,
    }
    message = raw_message_bytes(nbytes, int(bucket_mb * (1 << 20)) // 4096 * 4096)
    s["raw_message_bytes"] = message
    s["raw_meaning"] = raw_meaning(message, nbytes, colocated=False) + "; from sender 0, the other senders idle"
    if torch.cuda.is_available() and device == "cuda":
        s["gpu"] = torch.cuda.get_device_name(0)
    for mode in ("raw", "raw_split", "dense"):
        if f"{mode}_s" in results[0]:
            times = _slowest(results, f"{mode}_s")
            s["modes"][mode] = {"best_s": min(times), "median_s": statistics.median(times), "all_s": times}
    if args.delta:
        s["modes"]["seed"] = {"best_s": max(r["seed_s"] for r in results)}
        senders, receivers = results[: args.senders], results[args.senders :]
        for i in range(args.versions):
            sec = max(r["delta"][i]["seconds"] for r in results)
            wire = sum(r["delta"][i]["wire_bytes"] for r in senders)
            dense = sum(r["delta"][i]["dense_bytes"] for r in senders)
            s["modes"][f"delta v{i + 2}"] = {
                "best_s": sec, "wire_bytes": wire, "wire_fraction": wire / dense if dense else 0.0,
                "changed_fraction": statistics.mean(r["delta"][i]["changed_fraction"] for r in senders),
                "encode_s": max(r["delta"][i].get("encode_s", 0.0) for r in senders),
                "apply_s": max(r["delta"][i].get("apply_s", 0.0) for r in receivers),
            }
            if "fp8_changes" in senders[0]["delta"][i]:  # sender 0's count, untimed
                s["modes"][f"delta v{i + 2}"]["fp8_changes"] = senders[0]["delta"][i]["fp8_changes"]
            for key in ("host_walk_s", "host_wait_s", "host_finish_s", "host_send_s"):  # sender host time
                if key in senders[0]["delta"][i]:
                    s["modes"][f"delta v{i + 2}"][key] = max(r["delta"][i][key] for r in senders)
            if "setup_s" in receivers[0]["delta"][i]:  # receiver host time before its first frame
                s["modes"][f"delta v{i + 2}"]["setup_s"] = max(r["delta"][i]["setup_s"] for r in receivers)
        s["base_bytes"] = {f"rank{r['rank']}": r["base_bytes"] for r in results}
        s["versions_generate_s"] = max(r.get("generate_s", 0.0) for r in senders)
        s["versions_kept"] = senders[0].get("versions_kept")
        s["auto_picks"] = _auto_picks(s, nbytes)
    raw = s["modes"]["raw"]["best_s"]
    for m in s["modes"].values():
        m["gbps"] = nbytes / m["best_s"] / 1e9
        m["ratio_to_raw"] = raw / m["best_s"]  # RATIO_MEANING: raw seconds / these seconds, > 1 beats raw
    expected = results[0]["checksum"]
    s["problems"] = [f"rank {r['rank']}: weights differ from the senders'" for r in results[args.senders :] if r["checksum"] != expected]
    s["correct"] = not s["problems"]
    return s


def _auto_picks(s: dict[str, Any], nbytes: int) -> str:
    """What `delta: auto` would do after these syncs, by its own rule (`DeltaPolicy`): patches
    while the cheapest of the last patch syncs costs no more per dense byte than the cheapest
    dense sync, and never where a patch sync's wire reached the dense bytes."""
    costs = SyncCosts()
    for t in s["modes"]["dense"]["all_s"]:
        costs.record(None, t, nbytes)
    patches = [m for k, m in s["modes"].items() if k.startswith("delta v")]
    for m in patches:
        costs.record(DeltaRequest(True, 1, 2), m["best_s"], nbytes)
    if patches and patches[-1]["wire_fraction"] >= 1.0:
        return "dense (the last patch sync's wire reached the dense bytes)"
    verdict = costs.verdict()
    if verdict is None:
        return "undecided (fewer patch syncs than it measures)"
    return "patches" if verdict else "dense (patch syncs cost more per byte than dense ones)"


def print_chain_summary(s: dict[str, Any], console: Console) -> None:
    """One chain's table, or (--wire-dtype fp8) the bf16 and FP8 chains' tables and their ratios."""
    if "wires" not in s:
        _print_one(s, console)
        return
    for wire, run in s["wires"].items():
        console.print(f"[bold]{wire} wire[/bold]")
        _print_one(run, console)
    bf16, fp8 = s["wires"]["bf16"]["modes"], s["wires"]["fp8"]["modes"]
    console.print(f"FP8 / bf16: wire bytes {s['fp8_over_bf16_bytes']:.3f} x; dense sync {fp8['dense']['best_s'] / bf16['dense']['best_s']:.2f} x the time")
    for k in (k for k in fp8 if k.startswith("delta v")):
        f, b = fp8[k], bf16[k]
        console.print(f"{k}: patch bytes FP8 {f['wire_bytes'] / 1e6:.1f} MB against bf16 {b['wire_bytes'] / 1e6:.1f} MB; time {f['best_s'] / b['best_s']:.2f} x")


def _print_one(s: dict[str, Any], console: Console) -> None:
    from rich.table import Table  # the `cli` extra

    layers = "" if s["layers"] is None else f" ({s['layers']} layers)"
    title = (
        f"{s['preset']}{layers}: {s['bytes'] / 1e9:.3f} GB, {s['backend']} on "
        f"{s.get('gpu', s['device'])}, {s['senders']} sender(s) -> {s['receivers']} receiver(s), bucket {s['bucket_mb']:.0f} MiB"
        + (f", AdamW lr {s['lr']:g}" if s["delta"] else "") + (", block-FP8 wire" if s.get("wire") == "fp8" else "")
    )
    table = Table(title=title)
    for col in ("mode", "seconds", "GB/s (dense bytes)", "vs raw", "wire bytes", "changed", "encode s", "apply s"):
        table.add_column(col, justify="left" if col == "mode" else "right")
    labels = {"raw": "raw broadcast, one sender", "raw_split": "raw, bytes split over senders", "dense": "ckpt-engine dense sync", "seed": "delta seed (dense)"}
    for mode, m in s["modes"].items():
        table.add_row(
            labels.get(mode, mode), f"{m['best_s']:.4f}", f"{m['gbps']:.2f}", f"{m['ratio_to_raw']:.3f}",
            f"{m['wire_bytes'] / 1e6:.1f} MB ({100 * m['wire_fraction']:.1f}%)" if "wire_bytes" in m else "-",
            f"{100 * m['changed_fraction']:.2f}%" if "changed_fraction" in m else "-",
            f"{m['encode_s']:.4f}" if "encode_s" in m else "-", f"{m['apply_s']:.4f}" if "apply_s" in m else "-",
        )
    console.print(table)
    for mode, m in s["modes"].items():
        if "fp8_changes" in m:
            c = m["fp8_changes"]
            console.print(f"{mode}: {100 * c['codes']:.2f}% of the FP8 codes and {100 * c['scales']:.2f}% of the block scales changed")
    console.print(f"raw: {s['raw_meaning']}")
    console.print(f"vs raw: {s['ratio_meaning']}")
    if "base_bytes" in s:
        console.print("delta base copies: " + ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in s["base_bytes"].items()))
        console.print(f"versions generated in {s['versions_generate_s']:.1f} s before the syncs (untimed), kept in {s['versions_kept']}")
        console.print(f"delta: auto would send: {s['auto_picks']}")
    console.print("correctness: " + ("every receiver equals the senders bit for bit" if s["correct"] else "; ".join(s["problems"])))
