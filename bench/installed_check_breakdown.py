"""Where a checked colocated sync's extra time goes (issue 42's one-GPU cost), in one process.

A real CUDA vLLM engine with its engine core in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`,
so its worker's methods run here too) and the trainer's tensors on the same GPU; one session at
`verify_installed: 2`, so checked and unchecked syncs alternate. With `--wrap` about twenty
functions of the check on both sides (the trainer's `InstalledChecks`, the handle's route, the
worker's receiver and capture, the reports' wire forms, the fold kernel's tables and launch) are
wrapped to add up their wall time per sync, as are the steps of the one-copy hand-off around the
device copies (the offer, take, taken, the copy launches); some of them (`_MARKED`), every worker call (by its
method, `rpc.<method>`) and the handle client's engine-core calls note when they start and end (ms
from the sync's start, the `@0.` and `@1.` rows). With the engine core in its own process
(`VLLM_ENABLE_V1_MULTIPROCESSING=1`) only the trainer's side is wrapped. Prints, per figure, the
median over unchecked and checked syncs and the difference, then the check's cost (checked median
over unchecked - 1).

Wall times of wrapped functions include waits for the interpreter lock: read them for where the
time sits, and take the cost from a run without `--wrap` (the wrappers add ~1 us a call).

    VLLM_ENABLE_V1_MULTIPROCESSING=0 python bench/installed_check_breakdown.py --preset qwen2.5-7b --wrap
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
os.environ.setdefault("VLLM_USE_DEEP_GEMM", "0")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

FIGURES: dict[str, float] = {}
"""This sync's figures: each wrapped function's summed wall time, and the marks."""
_START = [0.0]
_MARKED = {
    "ExtensionRoute.receive", "VllmReceiverCore.receive_begin", "VllmReceiverCore.receive_end", "VllmReceiverCore.finalize",
    "InstalledChecks.expected_report", "InstalledChecks.fold_noted", "InstalledCapture.launch", "InstalledCapture.report",
    "LLMWeightSyncClient.pause", "LLMWeightSyncClient.reset_prefix_cache", "LLMWeightSyncClient.set_weight_version",
    "LLMWeightSyncClient.resume", "InstalledChecks.fold_ahead", "VllmReceiverCore.receive", "VllmReceiverCore._stream",
    "VllmReceiverCore.installed", "InstalledChecks.source_digests",
    # the one-copy hand-off around the device copies (issue 39's head and tail, checked or not)
    "WeightSyncSession._prepare_validated", "SharedSources.send", "ColocatedTransport.offer", "ColocatedTransport.wait_taken",
    "ColocatedTransport.take", "ColocatedTransport.taken", "FusedCopy.launch", "VllmRollout.receive", "WeightSyncSession._report",
}


def _timed(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        marked = label in _MARKED or label.startswith("rpc.")
        if marked:
            FIGURES.setdefault("@0." + label, t - _START[0])
        try:
            return fn(*args, **kwargs)
        finally:
            end = time.perf_counter()
            FIGURES[label] = FIGURES.get(label, 0.0) + end - t
            if marked:
                FIGURES["@1." + label] = end - _START[0]
    return timed


def _timed_rpc(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`ExtensionRoute.rpc`, timed and marked per method (`rpc.ckpt_receive_begin`, ...)."""
    @functools.wraps(fn)
    def timed(self: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        return _timed(f"rpc.{method}", fn)(self, method, *args, **kwargs)
    return timed


def _wrap(owner: type, *names: str) -> None:
    for name in names:
        setattr(owner, name, _timed(f"{owner.__name__}.{name}", getattr(owner, name)))


def _wrap_classmethod(owner: type, name: str) -> None:
    fn = getattr(owner, name).__func__
    setattr(owner, name, classmethod(_timed(f"{owner.__name__}.{name}", fn)))


def install_wrappers() -> None:
    from ckpt_engine import copy_kernel, installed, installed_kernel
    from ckpt_engine.pipeline import shared_sources
    from ckpt_engine.rollout_adapters.vllm import rollout
    from ckpt_engine.sync import session
    from ckpt_engine.transports import colocated
    from ckpt_engine.rollout_adapters.vllm import installed as worker_installed
    from ckpt_engine.rollout_adapters.vllm import clients, receiver, routes, worker
    from ckpt_engine.sync import installed as checks

    _wrap(checks.InstalledChecks, "arm_manifest", "fold_ahead", "fold_noted", "expected_report", "source_digests", "verify", "_compare", "release")
    _wrap(installed.InstalledReport, "to_wire")
    _wrap_classmethod(installed.InstalledReport, "from_wire")
    _wrap_classmethod(installed.InstalledRequest, "from_wire")
    _wrap(installed_kernel.Folder, "__init__", "launch_all")
    _wrap(worker_installed.InstalledCapture, "launch", "report")
    _wrap(worker_installed.LiveImages, "valid")
    _wrap(receiver.VllmReceiverCore, "installed_arm", "installed", "receive", "_stream", "receive_begin", "receive_end", "finalize")
    _wrap(routes.ExtensionRoute, "receive")
    routes.ExtensionRoute.rpc = _timed_rpc(routes.ExtensionRoute.rpc)  # type: ignore[method-assign]
    _wrap(clients.LLMWeightSyncClient, "pause", "resume", "reset_prefix_cache", "set_weight_version", "_settle")
    worker.agrees = _timed("worker.agrees", worker.agrees)
    _wrap(session.WeightSyncSession, "_prepare_validated", "_report")
    _wrap(shared_sources.SharedSources, "send")
    _wrap(colocated.ColocatedTransport, "offer", "wait_taken", "take", "taken")
    _wrap(copy_kernel.FusedCopy, "launch")
    _wrap(rollout.VllmRollout, "receive")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen2.5-7b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--per-round", type=int, default=9, help="checked syncs a round (as many unchecked between them)")
    ap.add_argument("--gpu-mem", type=float, default=0.3)
    ap.add_argument("--wrap", action="store_true", help="wrap the check's functions (where the time sits; the cost from a run without)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from bench.vllm_colocated_bench import colocated_engine
    from ckpt_engine import CheckpointEngineConfig
    from ckpt_engine.rollout_adapters.vllm import VllmRollout
    from ckpt_engine.sources.base import StateDictSource
    from ckpt_engine.sync.api import close_sessions, sync_rollout_weights

    llm, weights, _ = colocated_engine(args.preset, args.layers, args.gpu_mem)
    handle = VllmRollout("breakdown", llm, timeout_s=600.0)
    cfg = CheckpointEngineConfig(backend="colocated", timeout_s=600.0, delta="off", stage="off", verify_installed=2)
    source = StateDictSource(weights)
    for _ in range(3):  # the join, the check's dry run, warm kernels
        sync_rollout_weights(source, [handle], config=cfg)
    if args.wrap:
        install_wrappers()
    rows: dict[str, list[dict[str, float]]] = {"unchecked": [], "checked": []}
    for _ in range(args.rounds * 2 * args.per_round):
        FIGURES.clear()
        _START[0] = t = time.perf_counter()
        report = sync_rollout_weights(source, [handle], config=cfg)
        wall = time.perf_counter() - t
        assert report is not None
        kind = "checked" if "installed_check" in report.seconds else "unchecked"
        rows[kind].append({"wall": wall, **{f"phase.{k}": v for k, v in report.seconds.items()}, **FIGURES})
    close_sessions()

    def median_ms(kind: str, key: str) -> float:
        return statistics.median(r.get(key, 0.0) for r in rows[kind]) * 1e3

    keys = sorted({k for kind in rows.values() for r in kind for k in r})
    print(f"{'figure (ms)':48s} {'unchecked':>10s} {'checked':>10s} {'diff':>8s}")
    for key in keys:
        off, on = median_ms("unchecked", key), median_ms("checked", key)
        print(f"{key:48s} {off:10.3f} {on:10.3f} {on - off:8.3f}")
    cost = median_ms("checked", "wall") / median_ms("unchecked", "wall") - 1.0
    print(f"check cost: {cost:+.1%} ({len(rows['checked'])} checked, {len(rows['unchecked'])} unchecked syncs{', wrapped' if args.wrap else ''})")
    if args.json:
        Path(args.json).write_text(json.dumps({"preset": args.preset, "wrapped": args.wrap, "cost": cost, "syncs": rows}))


if __name__ == "__main__":
    main()
