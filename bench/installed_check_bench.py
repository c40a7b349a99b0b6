"""What an installed-weight check costs (issue 42 item 5): dense syncs of a preset's checkpoint into
one reference receiver in its own process, checked and unchecked, and the digests alone on both
sides (the trainer's fold of the source, the engine's of what it installed).

    python bench/installed_check_bench.py --preset qwen2.5-7b --layers 1 --syncs 4 [--samples 4096]
    python bench/installed_check_bench.py --preset qwen2.5-7b --layers 28 --device cuda --backend colocated --syncs 9
    python bench/installed_check_bench.py --preset qwen2.5-7b --layers 28 --shrink 16 --syncs 9   # many tensors, few bytes

By default one session runs `verify_installed: 2` (after a first sync that joins, checked and
unchecked syncs alternate, `--syncs` of each), so host drift hits both sides of the pair alike;
`--two-sessions` runs the earlier method, a session unchecked then one checked at every sync. With
`--device cuda` the trainer's tensors and the receiver's (a reference receiver started by this
script, holding zeros of the checkpoint on that device) share one GPU; the one-GPU backend is
`colocated`. `--shrink K` divides the widths (hidden, intermediate, vocabulary) by K and keeps every
tensor: on the host, a 28-layer 7B's 339 tensors in ~60 MB (K 16) stand in for the GPU's sync, where
the bytes move fast and the per-tensor host work is what a check adds. Prints one JSON line: the
median dense sync without and with the check (`difference_share`: what the check adds, paired in
one session), the trainer's check time (`check_s`: its folds and the compare) and the engine's own
digest time inside the checked receive (`engine_check_s`), the median `transfer` of both kinds, and
each side's digest time alone (sampled and, for reference, a full fold: --samples 0's), and what
each side's fold leaves after the last bucket, measured in this process (`tails`: `engine_tail_s`
against `engine_fold_at_end_s`, `trainer_tail_s`).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from ckpt_engine import CheckpointEngineConfig, WeightSyncSession
from ckpt_engine.benchmark.presets import checkpoint_specs, load_preset_config
from ckpt_engine.control.server import RpcServer
from ckpt_engine.installed import InstalledRequest, digest
from ckpt_engine.installed_held import HeldDigests
from ckpt_engine.planning.buckets import plan_buckets
from ckpt_engine.rollout_adapters.torch_ref.rollout import read_ready_line
from ckpt_engine.rollout_adapters.torch_ref.models import RefModel, load_spec_file
from ckpt_engine.rollout_adapters.torch_ref.worker import TorchRefWorker
from ckpt_engine.rollout_adapters.torch_ref import TorchRefRollout, write_spec_file
from ckpt_engine.rollout_adapters.torch_ref.serve import READY_PREFIX, TOKEN_ENV
from ckpt_engine.sources.base import StateDictSource
from ckpt_engine.sync.installed import InstalledChecks


def fold_s(sd: dict[str, torch.Tensor], samples: int) -> float:
    t = time.perf_counter()
    for v in [digest(x, 12345, samples) for x in sd.values()]:
        int(v)
    return time.perf_counter() - t


def tails(sd: dict[str, torch.Tensor], specs: list, bucket_bytes: int, samples: int, repeats: int) -> dict[str, float]:
    """What each side's fold leaves on the sync's path, in this process (no transfer): the engine's
    (a reference receiver's `HeldDigests`) when every tensor is folded after the last bucket
    (`engine_fold_at_end_s`: a report with nothing landed) against the report after its buckets
    landed (`engine_tail_s`: on the host the last batch's fold, on a GPU one read-back), and what the
    landings cost while the buckets stream (`engine_landed_s`: on the host a batch fold at every
    ~1/8 of the tensors, on a GPU one launch once the last tensor landed); the trainer's: noting a
    stable walk (`trainer_walk_s`) and what follows the send (`trainer_tail_s`: its fold, the
    read-back; it overlaps the engines' tails and replies). The device is drained before each timed
    tail (the stream would have run the landings' kernels by then). Medians of `repeats`."""
    manifest = plan_buckets(specs, bucket_bytes)
    landed = [[e.name for e in b.entries if e.chunk_offset + e.chunk_size == e.nbytes] for b in manifest.buckets]
    request = InstalledRequest([s.name for s in specs], 12345, samples)
    rank = HeldDigests(sd, {})
    sync = torch.cuda.synchronize if next(iter(sd.values())).is_cuda else (lambda: None)
    runs: dict[str, list[float]] = {k: [] for k in ("engine_fold_at_end_s", "engine_landed_s", "engine_tail_s", "trainer_walk_s", "trainer_tail_s")}
    checks = InstalledChecks(1, samples, "warn")
    for _ in range(repeats + 1):  # the first of each warms the kept tables
        sync()
        t = time.perf_counter()
        rank.report(request)
        runs["engine_fold_at_end_s"].append(time.perf_counter() - t)
        fold = rank.begin(request)
        t = time.perf_counter()
        for names in landed:
            fold.landed(names)
        runs["engine_landed_s"].append(time.perf_counter() - t)
        sync()
        t = time.perf_counter()
        fold.report()
        runs["engine_tail_s"].append(time.perf_counter() - t)
        checks.arm_manifest([], manifest, [None], 1)  # as a session arms it (its layout kept across checks)
        t = time.perf_counter()
        for _ in checks.tap(iter(sd.items()), stable=True):
            pass
        runs["trainer_walk_s"].append(time.perf_counter() - t)
        sync()
        t = time.perf_counter()
        checks.fold_noted()
        checks.source_digests()
        runs["trainer_tail_s"].append(time.perf_counter() - t)
        checks.release()
    return {k: round(statistics.median(v[1:]), 5) for k, v in runs.items()}


def phase_medians(runs: list[dict[str, float]]) -> dict[str, float]:
    """The median of each `SyncReport.seconds` phase over `runs` (where a check's time goes)."""
    return {k: round(statistics.median(r.get(k, 0.0) for r in runs) * 1e3, 3) for k in sorted({k for r in runs for k in r})}


def serve_receiver(spec_file: str, device: str) -> None:
    """The receiver process for a device run: the reference receiver's worker over zeros of the
    checkpoint made on `device` (the spawned reference receiver holds host tensors)."""
    token = os.environ.pop(TOKEN_ENV, "")
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is not None:
        torch.cuda.set_device(dev)
    model = RefModel({s.name: torch.zeros(s.shape, dtype=getattr(torch, s.dtype), device=dev) for s in load_spec_file(spec_file)})
    server = RpcServer(TorchRefWorker.of(model).handlers(), token=token).start()
    print(f"{READY_PREFIX}{server.port}", flush=True)
    parent = os.getppid()
    while os.getppid() == parent:  # exit when the bench goes away
        threading.Event().wait(1.0)


def start_receiver(spec_file: str, device: str, timeout_s: float) -> TorchRefRollout:
    """A reference receiver: the library's spawned one on the host, this script's on a device."""
    if torch.device(device).type == "cpu":
        return TorchRefRollout.spawn("ref", spec_file=spec_file, dtype="bfloat16", timeout_s=timeout_s)
    token = secrets.token_hex(16)
    cmd = [sys.executable, __file__, "--serve-receiver", spec_file, "--device", device]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, TOKEN_ENV: token})
    port = int(read_ready_line(proc, READY_PREFIX, "the bench's reference receiver", timeout_s))
    return TorchRefRollout("ref", "127.0.0.1", port, proc, timeout_s, token=token)


def run_session(
    engine: TorchRefRollout, sd: dict[str, torch.Tensor], first: str, verify: str | int, syncs: int, args: argparse.Namespace,
) -> list[tuple[float, float | None, float, float | None]]:
    """(total seconds, the check's seconds or None when unchecked, the transfer's seconds, the
    engine's own digest seconds) of each sync after the first, which joins the group and is not
    counted."""
    kwargs = {args.backend: {"device": args.device}} if torch.device(args.device).type != "cpu" else {}
    cfg = CheckpointEngineConfig(backend=args.backend, bucket_size_mb=args.bucket_mb, stage="off", timeout_s=600, delta="off",
                                 verify_installed=verify, verify_installed_samples=args.samples, engine_kwargs=kwargs)
    session = WeightSyncSession([engine], cfg)
    out = []
    phases = args.phases
    try:
        for _ in range(syncs + 1):
            with torch.no_grad():
                sd[first][0, 0] += 1
            seconds = session.sync(StateDictSource(sd)).seconds
            check = seconds.get("installed_check")
            engine_s = session._installed.engine_seconds if check is not None else None  # bench-only peek: the engine's own digests
            out.append((seconds["total"], check, seconds["transfer"], engine_s))
            phases.append((check is not None, dict(seconds)))
    finally:
        session.close()
    return out[1:]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="qwen2.5-7b")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--syncs", type=int, default=4, help="checked syncs, and as many unchecked")
    p.add_argument("--samples", type=int, default=4096)
    p.add_argument("--bucket-mb", type=float, default=256)
    p.add_argument("--device", default="cpu", help="where the trainer's and the receiver's tensors live (cpu, cuda, cuda:N)")
    p.add_argument("--backend", default="gloo", help="gloo on the host; colocated for one GPU")
    p.add_argument("--shrink", type=int, default=1, help="divide hidden, intermediate and vocabulary sizes by this (same tensors, fewer bytes)")
    p.add_argument("--tail-repeats", type=int, default=20, help="repeats of the in-process fold tails (engine_tail_s, trainer_tail_s)")
    p.add_argument("--two-sessions", action="store_true", help="an unchecked session, then one checked at every sync")
    p.add_argument("--serve-receiver", metavar="SPEC_FILE", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.phases = []
    if args.serve_receiver:
        return serve_receiver(args.serve_receiver, args.device)
    dev = torch.device(args.device)
    if dev.type == "cuda" and dev.index is not None:
        torch.cuda.set_device(dev)
    config = load_preset_config(args.preset)
    if args.shrink < 1:
        raise SystemExit(f"--shrink must be >= 1, got {args.shrink}")
    for key in ("hidden_size", "intermediate_size", "moe_intermediate_size", "vocab_size", "head_dim"):
        if config.get(key):
            config[key] = max(config[key] // args.shrink, 1)
    specs = checkpoint_specs(config, num_layers=args.layers)
    g = torch.Generator(device=dev).manual_seed(0)
    sd = {s.name: torch.randn(s.shape, generator=g, dtype=torch.float32, device=dev).to(getattr(torch, s.dtype)) for s in specs}
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    out: dict[str, object] = {
        "preset": args.preset, "layers": args.layers, "tensors": len(sd), "gb": round(nbytes / 1e9, 3), "samples": args.samples,
        "shrink": args.shrink, "device": str(dev), "backend": args.backend,
        "method": "two sessions (off, verify_installed: 1)" if args.two_sessions else "one session, verify_installed: 2 (interleaved)",
    }
    with tempfile.TemporaryDirectory() as tmp:
        spec_file = str(Path(tmp) / "spec.msgpack")
        write_spec_file(spec_file, specs)
        engine = start_receiver(spec_file, args.device, 600)
        try:
            if args.two_sessions:
                runs = run_session(engine, sd, specs[0].name, "off", args.syncs, args) + run_session(engine, sd, specs[0].name, 1, args.syncs, args)
            else:
                runs = run_session(engine, sd, specs[0].name, 2, 2 * args.syncs, args)
            off = [t for t, c, _, _ in runs if c is None]
            on = [t for t, c, _, _ in runs if c is not None]
            out["sync_s_off"], out["sync_s_checked"] = round(statistics.median(off), 4), round(statistics.median(on), 4)
            out["syncs_off"], out["syncs_checked"] = [round(x, 4) for x in off], [round(x, 4) for x in on]
            out["check_s"] = round(statistics.median(c for _, c, _, _ in runs if c is not None), 4)
            out["transfer_s_off"] = round(statistics.median(x for _, c, x, _ in runs if c is None), 4)
            out["transfer_s_checked"] = round(statistics.median(x for _, c, x, _ in runs if c is not None), 4)  # with the engine's digests since 6d4f7b7
            out["engine_check_s"] = round(statistics.median(e for _, c, _, e in runs if c is not None and e is not None), 5)
            out["phases_off"], out["phases_checked"] = (phase_medians([s for c, s in args.phases[1:] if c is kind]) for kind in (False, True))
            req = InstalledRequest([s.name for s in specs], 12345, args.samples)
            t = time.perf_counter()
            engine.installed_digests(req)
            out["engine_digests_s"] = round(time.perf_counter() - t, 4)
            out["trainer_fold_s"] = round(fold_s(sd, args.samples), 4)
            out["trainer_full_fold_s"] = round(fold_s(sd, 0), 3)
            out.update(tails(sd, specs, int(args.bucket_mb * 2**20), args.samples, args.tail_repeats))
        finally:
            engine.close()
    off_s, on_s = out["sync_s_off"], out["sync_s_checked"]
    out["check_share"] = round(out["check_s"] / off_s, 4)  # type: ignore[operator]  # the check's own time over a dense sync
    out["difference_share"] = round((on_s - off_s) / off_s, 4)  # type: ignore[operator]  # checked minus unchecked, same session
    out["digests_share"] = round((out["engine_digests_s"] + out["trainer_fold_s"]) / off_s, 4)  # type: ignore[operator]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
