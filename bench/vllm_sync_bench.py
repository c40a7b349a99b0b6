"""A real CUDA vLLM engine (GPU 0, dummy weights) fed from a trainer's tensors on GPU 1, in one
process and one run, three ways over the same two GPUs:

  raw   - back-to-back NCCL broadcasts of the model's bytes (512 MiB messages) into the worker, over
          vLLM's own trainer group (bench/vllm_bench_ext.py): the link's speed
  vllm  - vLLM 0.26's own NCCL weight-transfer engine, packed (its fast path): start_weight_update,
          update_weights while the trainer runs `trainer_send_weights(packed=True)`, finish_weight_update
  ours  - `sync_rollout_weights` over `backend: nccl` into the same engine (`VllmRollout`), dense,
          unstaged; then staged (the default: receive beside serving, swap between two steps)

Each figure is the median of `--iters` syncs after a first (join / warm-up) one; after the last
sync of each path the engine's installed parameters are folded on the GPU and must be equal
(vLLM's load and ours installed the same bytes). Prints one JSON line; `--json` writes it too.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
os.environ.setdefault("VLLM_USE_DEEP_GEMM", "0")
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")

MESSAGE = 512 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Background:
    """Run one engine call beside the trainer's send; re-raise its error on join."""

    def __init__(self, fn: Any, *args: Any, **kwargs: Any) -> None:
        self.error: BaseException | None = None
        self.value: Any = None

        def run() -> None:
            try:
                self.value = fn(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 - re-raised in join
                self.error = e

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def join(self, timeout: float = 900.0) -> Any:
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise TimeoutError("the engine call did not return")
        if self.error is not None:
            raise self.error
        return self.value


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen2.5-7b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--gpu-mem", type=float, default=0.3)
    ap.add_argument("--no-staged", action="store_true")
    ap.add_argument("--checked", action="store_true", help="also ours with an installed-weight check at every sync (issue 42's cost)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from vllm import LLM
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

    from ckpt_engine import CheckpointEngineConfig
    from ckpt_engine.benchmark.presets import checkpoint_specs, load_preset_config
    from ckpt_engine.rollout_adapters.vllm import VllmRollout
    from ckpt_engine.sources.base import StateDictSource
    from ckpt_engine.sync.api import close_sessions, sync_rollout_weights

    from bench.vllm_bench_ext import time_engine_calls

    config = load_preset_config(args.preset, args.layers)
    config.update(torch_dtype="bfloat16", max_position_embeddings=min(config.get("max_position_embeddings", 4096), 4096))
    model_dir = Path(tempfile.mkdtemp())
    (model_dir / "config.json").write_text(json.dumps(config))
    specs = checkpoint_specs(config, "bfloat16", args.layers)
    out: dict[str, Any] = {"preset": args.preset, "layers": config["num_hidden_layers"], "tensors": len(specs)}

    t0 = time.perf_counter()
    llm = LLM(
        model=str(model_dir), load_format="dummy", skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
        max_model_len=256, max_num_seqs=4, gpu_memory_utilization=args.gpu_mem,
        worker_extension_cls="bench.vllm_bench_ext.BenchExtension", weight_transfer_config={"backend": "nccl"},
    )
    out["engine_up_s"] = round(time.perf_counter() - t0, 1)

    torch.cuda.set_device(1)  # vLLM's trainer_init joins from the current device
    g = torch.Generator(device="cuda:1").manual_seed(0)
    weights = {s.name: torch.randn(tuple(s.shape), generator=g, device="cuda:1", dtype=torch.float32).mul_(0.02).to(torch.bfloat16) for s in specs}
    total = sum(t.nbytes for t in weights.values())
    out["bytes"] = total
    items = list(weights.items())

    # vLLM's own group: the raw link and its packed path share it
    port = free_port()
    info = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2}
    joining = Background(llm.init_weight_transfer_engine, {"init_info": info})
    group = NCCLWeightTransferEngine.trainer_init(info)
    joining.join(300)

    def raw() -> float:
        buf = torch.empty(MESSAGE, dtype=torch.uint8, device="cuda:1")
        torch.cuda.synchronize(1)
        t = time.perf_counter()
        worker = Background(llm.collective_rpc, "bench_raw_receive", kwargs={"total_bytes": total, "message_bytes": MESSAGE})
        done = 0
        while done < total:
            n = min(MESSAGE, total - done)
            group.broadcast(buf[:n], src=0, stream=torch.cuda.current_stream())
            done += n
        torch.cuda.synchronize(1)
        worker.join()
        return time.perf_counter() - t

    update = {"names": [n for n, _ in items], "dtype_names": ["bfloat16"] * len(items), "shapes": [list(t.shape) for _, t in items], "packed": True}

    def vllm_packed() -> float:
        torch.cuda.synchronize(1)
        t = time.perf_counter()
        llm.start_weight_update()
        worker = Background(llm.update_weights, {"update_info": update})
        NCCLWeightTransferEngine.trainer_send_weights(iter(items), {"group": group, "packed": True})
        worker.join()
        llm.finish_weight_update()
        return time.perf_counter() - t

    handle = VllmRollout("bench", llm, timeout_s=600.0)
    reports: list[Any] = []
    calls = time_engine_calls(handle)  # the last sync's engine calls (name, seconds), in order

    def ours(stage: str, verify: str | int = "first") -> Any:
        cfg = CheckpointEngineConfig(backend="nccl", timeout_s=600.0, stage=stage, delta="off", verify_installed=verify)

        def run() -> float:
            calls.clear()
            t = time.perf_counter()
            reports.append(sync_rollout_weights(StateDictSource(weights), [handle], config=cfg))
            return time.perf_counter() - t
        return run

    def measure(name: str, fn: Any) -> None:
        (out.setdefault("memory_gib", {})[f"before_{name}"],) = llm.collective_rpc("bench_memory")
        try:
            first = fn()
            runs = [fn() for _ in range(args.iters)]
        except Exception as exc:  # keep what ran: the JSON says which path failed and the engine's memory
            (out["memory_gib"][f"failed_{name}"],) = llm.collective_rpc("bench_memory")
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[:600]}
            print(f"{name}: {out[name]} memory {out['memory_gib']}", flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps(out, indent=1))
            raise
        (out["memory_gib"][f"after_{name}"],) = llm.collective_rpc("bench_memory")
        out[name] = {"first_s": round(first, 4), "median_s": round(statistics.median(runs), 4), "runs_s": [round(r, 4) for r in runs],
                     "gb_s": round(total / statistics.median(runs) / 1e9, 1)}
        print(f"{name}: {out[name]}", flush=True)

    measure("raw", raw)
    measure("vllm_packed", vllm_packed)
    (fold_vllm,) = llm.collective_rpc("bench_param_fold")
    measure("ours", ours("off"))
    out["ours"]["seconds"] = {k: round(v, 4) for k, v in reports[-1].seconds.items()}  # where the last sync's time went
    out["ours"]["engine_calls_ms"] = [[n, round(1000 * s, 2)] for n, s in calls]
    out["ours"]["finalize_split_s"] = {k: round(float(v), 4) for k, v in handle.last_finalize.items()}
    (fold_ours,) = llm.collective_rpc("bench_param_fold")
    out["same_install"] = fold_vllm == fold_ours
    out["differing"] = sorted(n for n in fold_vllm if fold_vllm[n] != fold_ours.get(n))[:8]
    if args.checked:  # right after the unchecked syncs, on the same engine: what a check adds to a dense sync
        reports.clear()
        measure("ours_checked", ours("off", 1))
        out["ours_checked"]["installed_check_s"] = [round(r.seconds.get("installed_check", float("nan")), 4) for r in reports]
        out["ours_checked"]["seconds"] = {k: round(v, 4) for k, v in reports[-1].seconds.items()}
        out["check_share"] = round(out["ours_checked"]["median_s"] / out["ours"]["median_s"] - 1, 4)
    if not args.no_staged:
        reports.clear()
        measure("ours_staged", ours("auto"))
        out["ours_staged"]["stall_s"] = [round(r.stall_s, 4) for r in reports]
        out["ours_staged"]["staged"] = [r.staged for r in reports]
    raw_s = out["raw"]["median_s"]
    out["ratio_ours_to_raw"] = round(raw_s / out["ours"]["median_s"], 3)
    out["ratio_vllm_to_raw"] = round(raw_s / out["vllm_packed"]["median_s"], 3)
    out["speedup_ours_over_vllm"] = round(out["vllm_packed"]["median_s"] / out["ours"]["median_s"], 3)
    print(json.dumps(out), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    close_sessions()
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
