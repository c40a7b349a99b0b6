"""A real CUDA vLLM engine and its trainer's tensors on one GPU (the colocated / hybrid-engine setup),
in one process and one run:

  copy      - one device-to-device copy of the model's bytes on that GPU (one flat buffer into
              another): the floor a colocated sync is held against (issue 39: >= 0.8 x)
  ours      - `sync_rollout_weights` over `backend: colocated` into the engine (`VllmRollout`),
              dense, unstaged, installed-weight checks off; the loaders' copies made directly
              (`vllm/direct_load.py`, the default for a model that loads in place)
  loaders   - the same through vLLM's own loaders (`CKPT_ENGINE_VLLM_DIRECT=0` in the worker): the
              before/after of the direct copies, in the same run
  checked   - the same in one session at `verify_installed: 2`: checked and unchecked syncs alternate
              (a checked one: the trainer folds the source through the receive plan, every worker
              folds what it installed); the cost is the checked median over the unchecked one of
              the same session (issue 42's <= 5 %)
  staged    - `stage: auto` (receive beside serving, swap between two steps): the stall per sync

Each figure is the median of `--iters` syncs after a first (join / warm-up) one. The checked syncs
compare, on every sync, what the engine installed with the source (a mismatch fails the sync).
Prints one JSON line; `--json` writes it too.

    python bench/vllm_colocated_bench.py --preset qwen2.5-7b --gpu-mem 0.3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
os.environ.setdefault("VLLM_USE_DEEP_GEMM", "0")
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")


def colocated_engine(preset: str, layers: int | None, gpu_mem: float) -> tuple[Any, dict[str, torch.Tensor], dict[str, Any]]:
    """A vLLM engine of `preset`'s shapes (dummy bf16 weights, the bench's worker extension) and the
    trainer's random bf16 tensors of the same shapes, both on cuda:0, with what describes them
    (preset, layers, tensors, gpu, engine_up_s)."""
    from vllm import LLM

    from ckpt_engine.benchmark.presets import checkpoint_specs, load_preset_config

    config = load_preset_config(preset)
    if layers:
        config["num_hidden_layers"] = layers
    config.update(torch_dtype="bfloat16", max_position_embeddings=min(config.get("max_position_embeddings", 4096), 4096))
    model_dir = Path(tempfile.mkdtemp())
    (model_dir / "config.json").write_text(json.dumps(config))
    specs = checkpoint_specs(config, "bfloat16", layers)
    info: dict[str, Any] = {"preset": preset, "layers": config["num_hidden_layers"], "tensors": len(specs), "gpu": torch.cuda.get_device_name(0)}
    t0 = time.perf_counter()
    llm = LLM(
        model=str(model_dir), load_format="dummy", skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
        max_model_len=256, max_num_seqs=4, gpu_memory_utilization=gpu_mem, worker_extension_cls="bench.vllm_bench_ext.BenchExtension",
    )
    info["engine_up_s"] = round(time.perf_counter() - t0, 1)
    g = torch.Generator(device="cuda:0").manual_seed(0)
    weights = {s.name: torch.randn(tuple(s.shape), generator=g, device="cuda:0", dtype=torch.float32).mul_(0.02).to(torch.bfloat16) for s in specs}
    return llm, weights, info


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen2.5-7b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--gpu-mem", type=float, default=0.3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--bucket-mb", default="", help="comma-separated bucket sizes (MiB) to measure beside the default, e.g. 1024,4096")
    ap.add_argument("--profile", default=None, help="write cProfile tables of four syncs of the checked session here (raw stats beside it)")
    ap.add_argument("--trace", default=None, help="write a torch.profiler chrome trace of three unchecked syncs here and print "
                    "where the device's time went in each (bench/trace_summary.py --windows)")
    ap.add_argument("--trace-stack", action="store_true", help="with --trace: every Python call of every thread in the trace too "
                    "(slows the host: read it for the order of the host's steps, not their times), and stop after it")
    ap.add_argument("--quick", action="store_true", help="only copy and ours (and --trace): an A/B of two libraries in one lease")
    args = ap.parse_args()

    from ckpt_engine import CheckpointEngineConfig
    from ckpt_engine.rollout_adapters.vllm import VllmRollout
    from ckpt_engine.sources.base import StateDictSource
    from ckpt_engine.sync.api import close_sessions, sync_rollout_weights

    llm, weights, out = colocated_engine(args.preset, args.layers, args.gpu_mem)
    total = sum(t.nbytes for t in weights.values())
    out["bytes"] = total

    flat = [torch.empty(total, dtype=torch.uint8, device="cuda:0") for _ in range(2)]

    def copy() -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        flat[1].copy_(flat[0])
        torch.cuda.synchronize()
        return time.perf_counter() - t

    handle = VllmRollout("bench", llm, timeout_s=600.0)
    reports: list[Any] = []

    def ours(**options: Any) -> Any:
        cfg = CheckpointEngineConfig(backend="colocated", timeout_s=600.0, delta="off", **options)

        def run() -> float:
            t = time.perf_counter()
            reports.append(sync_rollout_weights(StateDictSource(weights), [handle], config=cfg))
            return time.perf_counter() - t
        return run

    def measure(name: str, fn: Any) -> None:
        reports.clear()
        first = fn()
        runs = [fn() for _ in range(args.iters)]
        out[name] = {"first_s": round(first, 4), "median_s": round(statistics.median(runs), 4), "runs_s": [round(r, 4) for r in runs],
                     "gb_s": round(total / statistics.median(runs) / 1e9, 1)}
        print(f"{name}: {out[name]}", flush=True)

    measure("copy", copy)
    flat.clear()
    torch.cuda.empty_cache()
    measure("ours", ours(stage="off", verify_installed="off"))
    out["ours"]["seconds"] = {k: round(v, 4) for k, v in reports[-1].seconds.items()}  # where one sync's time went
    out["ours"]["direct_tensors"] = reports[-1].receivers[handle.name].get("direct_tensors", 0)
    if args.trace:  # the device's own timeline of three unchecked syncs: do the copies wait for the host?
        from torch.profiler import ProfilerActivity, profile, record_function

        from bench.trace_summary import windows

        run = ours(stage="off", verify_installed="off")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=args.trace_stack) as prof:
            for i in range(3):
                with record_function(f"sync {i}"):
                    run()
        prof.export_chrome_trace(args.trace)
        out["trace"] = windows(json.loads(Path(args.trace).read_text()))
        for row in out["trace"]:
            print(f"trace: {json.dumps(row)}", flush=True)
    if args.trace_stack or args.quick:
        out["ratio_ours_to_copy"] = round(out["copy"]["median_s"] / out["ours"]["median_s"], 3)
        print(json.dumps(out), flush=True)
        close_sessions()
        llm.llm_engine.engine_core.shutdown()
        return
    for mb in [float(x) for x in args.bucket_mb.split(",") if x]:  # fewer, larger buckets: less per-bucket control
        measure(f"ours_bucket_{mb:g}mb", ours(stage="off", verify_installed="off", bucket_size_mb=mb))
        out[f"ours_bucket_{mb:g}mb"]["seconds"] = {k: round(v, 4) for k, v in reports[-1].seconds.items()}
    llm.collective_rpc("bench_set_env", args=("CKPT_ENGINE_VLLM_DIRECT", "0"))
    measure("loaders", ours(stage="off", verify_installed="off"))
    out["loaders"]["seconds"] = {k: round(v, 4) for k, v in reports[-1].seconds.items()}
    llm.collective_rpc("bench_set_env", args=("CKPT_ENGINE_VLLM_DIRECT", "1"))
    try:  # one session at verify_installed: 2, so checked and unchecked syncs alternate (paired, same state)
        run = ours(stage="off", verify_installed=2)
        reports.clear()
        times = [run() for _ in range(2 * args.iters + 1)][1:]  # the first: join and the check's dry run
        pairs = list(zip(times, reports[1:]))
        checked = [t for t, r in pairs if "installed_check" in r.seconds]
        plain = [t for t, r in pairs if "installed_check" not in r.seconds]
        last = next(r for r in reversed(reports) if "installed_check" in r.seconds)
        out["checked"] = {"median_s": round(statistics.median(checked), 4), "runs_s": [round(t, 4) for t in checked],
                          "unchecked_median_s": round(statistics.median(plain), 4), "unchecked_runs_s": [round(t, 4) for t in plain],
                          "installed_check_s": [round(r.seconds["installed_check"], 4) for _, r in pairs if "installed_check" in r.seconds],
                          "seconds": {k: round(v, 4) for k, v in last.seconds.items()}}
        out["check_cost"] = round(out["checked"]["median_s"] / out["checked"]["unchecked_median_s"] - 1.0, 4)
        print(f"checked: {out['checked']} cost {out['check_cost']}", flush=True)
        if args.profile:  # where a checked sync's time goes: the worker's rpc thread and the trainer's main thread
            import cProfile
            import io
            import pstats

            llm.collective_rpc("bench_profile", args=("start",))
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(4):  # two checked, two unchecked
                run()
            prof.disable()
            worker = llm.collective_rpc("bench_profile", args=("stop", args.profile + ".worker.pstats", 45))[0]
            prof.dump_stats(args.profile + ".trainer.pstats")  # both raw, for pstats wherever they are read
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(45)
            Path(args.profile).write_text("== worker (4 syncs, 2 checked)\n" + worker + "\n== trainer main thread\n" + text.getvalue())
    except Exception as e:  # noqa: BLE001 - recorded, the other figures stand
        out["checked"] = {"error": f"{type(e).__name__}: {e}"[:400]}
        print(f"checked: {out['checked']}", flush=True)
    try:
        measure("staged", ours(stage="auto", verify_installed="off"))
        out["staged"]["stall_s"] = [round(r.stall_s, 4) for r in reports]
        out["staged"]["staged"] = [r.staged for r in reports]
    except Exception as e:  # noqa: BLE001 - recorded, the other figures stand
        out["staged"] = {"error": f"{type(e).__name__}: {e}"[:400]}
        print(f"staged: {out['staged']}", flush=True)
    out["ratio_ours_to_copy"] = round(out["copy"]["median_s"] / out["ours"]["median_s"], 3)
    out["ratio_loaders_to_copy"] = round(out["copy"]["median_s"] / out["loaders"]["median_s"], 3)
    print(json.dumps(out), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    close_sessions()
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
