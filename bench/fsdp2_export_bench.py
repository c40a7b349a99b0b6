"""FSDP2 export benchmark: unit-level gather (iter_weights) vs one all-gather per parameter vs raw broadcast.

Builds a HF causal LM from a `config.json` on the meta device, shards it with FSDP2TrainEngine over
2 processes (spawned here; NCCL on GPUs, gloo on CPU; the rendezvous port comes from the OS),
materializes the shards in bf16 and measures, on the same group:

  (a) export: walking `engine.source.iter_weights()` (one all-gather per FSDP unit, next unit prefetched);
  (b) per-param: `DTensor.full_tensor()` on every parameter (one all-gather each);
  (c) raw: `broadcast` from rank 0 of the same number of bytes, in 1 GiB messages.

Prints seconds and ratio export/raw (target <= 1.3), and writes them as JSON with --json.

    python bench/fsdp2_export_bench.py --preset /path/to/qwen2.5-7b/config.json --json out.json
    python bench/fsdp2_export_bench.py --preset tiny            # CPU / gloo smoke run
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ckpt_engine.benchmark.processes import run_processes

logger = logging.getLogger("fsdp2_export_bench")

TINY = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 4096,
    "max_position_embeddings": 512, "tie_word_embeddings": False, "rms_norm_eps": 1e-6,
}
MESSAGE_BYTES = 1 << 30


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Any, device: torch.device, group: dist.ProcessGroup, repeats: int) -> list[float]:
    fn()  # warm-up (communicators, allocator)
    times = []
    for _ in range(repeats):
        _sync(device)
        dist.barrier(group=group)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        dist.barrier(group=group)
        times.append(time.perf_counter() - t0)
    return times


def _rank_main(rank: int, world_size: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    from transformers import AutoConfig

    from ckpt_engine.trainer.engines.common import hf_model_from_config

    from ckpt_engine.trainer.engines.fsdp2 import FSDP2Config, FSDP2TrainEngine

    use_cuda = args.backend == "nccl"
    if use_cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
    timeout = datetime.timedelta(seconds=args.timeout_s)
    store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False, timeout=timeout)
    dist.init_process_group(args.backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    group = dist.group.WORLD
    assert group is not None
    hf_config = AutoConfig.from_pretrained(args.preset_dir)
    dtype = getattr(torch, args.dtype)
    with torch.device("meta"):
        model = hf_model_from_config(hf_config, dtype)
    engine = FSDP2TrainEngine(model, config=FSDP2Config(wire_dtype=args.dtype), process_group=group, device=device)
    engine.materialize()
    specs = engine.source.metadata()
    total_bytes = sum(s.nbytes for s in specs)

    def export() -> None:
        for _name, _t in engine.source.iter_weights():
            pass

    params = [p for p in engine.model.parameters()]

    def per_param() -> None:
        with torch.no_grad():
            for p in params:
                p.full_tensor()

    buf = torch.empty(min(total_bytes, MESSAGE_BYTES), dtype=torch.uint8, device=device)

    def raw() -> None:
        left = total_bytes
        while left > 0:
            n = min(left, buf.numel())
            dist.broadcast(buf[:n], src=dist.get_global_rank(group, 0), group=group)
            left -= n

    result: dict[str, Any] = {}
    for key, fn in (("export_s", export), ("per_param_allgather_s", per_param), ("raw_broadcast_s", raw)):
        times = _timed(fn, device, group, args.repeats)
        result[key] = statistics.median(times)
        result[key + "_all"] = times
    result.update(
        bytes=total_bytes, tensors=len(specs), world_size=world_size, backend=args.backend, dtype=args.dtype,
        ratio_export_over_raw=result["export_s"] / result["raw_broadcast_s"],
        ratio_per_param_over_raw=result["per_param_allgather_s"] / result["raw_broadcast_s"],
        raw_gbps=total_bytes / result["raw_broadcast_s"] / 1e9, export_gbps=total_bytes / result["export_s"] / 1e9,
        device=torch.cuda.get_device_name(device) if use_cuda else "cpu", torch=torch.__version__,
    )
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(result, f, indent=2)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", required=True, help="path to a HF config.json (or its directory), or 'tiny'")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--backend", choices=["auto", "nccl", "gloo"], default="auto")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--timeout-s", type=float, default=600.0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.backend == "auto":
        args.backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= args.world_size else "gloo"
    with tempfile.TemporaryDirectory() as tmp:
        if args.preset == "tiny":
            with open(os.path.join(tmp, "config.json"), "w") as f:
                json.dump(TINY, f)
            args.preset_dir = tmp
        else:
            args.preset_dir = os.path.dirname(args.preset) if args.preset.endswith(".json") else args.preset
        store = dist.TCPStore("127.0.0.1", 0, args.world_size + 1, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=args.timeout_s))
        out_path = os.path.join(tmp, "result.json")
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_rank_main, args=(r, args.world_size, store.port, args, out_path)) for r in range(args.world_size)]
        run_processes(procs, args.timeout_s)
        codes = [proc.exitcode for proc in procs]
        if any(c != 0 for c in codes) or not os.path.exists(out_path):
            logger.error("benchmark ranks failed: exit codes %s", codes)
            return 1
        with open(out_path) as f:
            result = json.load(f)
    result["preset"] = args.preset
    summary = (
        f"{result['tensors']} tensors, {result['bytes'] / 1e9:.2f} GB {result['dtype']} over {result['world_size']} ranks "
        f"({result['backend']}, {result['device']}):\n"
        f"  export (unit gather)   {result['export_s']:.4f} s  ({result['export_gbps']:.1f} GB/s)\n"
        f"  per-param all-gather   {result['per_param_allgather_s']:.4f} s\n"
        f"  raw broadcast          {result['raw_broadcast_s']:.4f} s  ({result['raw_gbps']:.1f} GB/s)\n"
        f"  ratio export/raw       {result['ratio_export_over_raw']:.3f}  (target <= 1.3)\n"
        f"  ratio per-param/raw    {result['ratio_per_param_over_raw']:.3f}"
    )
    sys.stdout.write(summary + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
