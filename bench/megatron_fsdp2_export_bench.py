"""Megatron-FSDP2 export benchmark: `MegatronFSDP2TrainEngine.iter_weights()` vs a raw broadcast.

Builds a HF causal LM from a config (a preset name shipped with ckpt_engine, or a config.json) on
each GPU in bf16, shards it with Megatron-FSDP2's per-module `fully_shard` (fp32 main weights) over
2 processes (spawned here, NCCL; the rendezvous port comes from the OS) and measures, on the
same group (`--engine fsdp2`: the same model under FSDP2, fp32 master weights with bf16 compute,
gathers and gradient reduction, for a side-by-side):

  (a) export: walking `engine.source.iter_weights()` (one all-gather per unit, the next unit prefetched);
  (b) raw: `broadcast` from rank 0 of the same number of bytes, in 1 GiB messages;
  (c) with --train-steps N: the median time of a training step (forward/backward of one
      sequence of --seq tokens per rank, clip, AdamW, main -> compute weights).

Prints seconds and the ratio export/raw (target <= 1.0), and writes them as JSON with --json.

    python bench/megatron_fsdp2_export_bench.py --preset qwen2.5-7b --json out.json --train-steps 3
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

logger = logging.getLogger("megatron_fsdp2_export_bench")

MESSAGE_BYTES = 1 << 30


def _timed(fn: Any, group: dist.ProcessGroup, repeats: int) -> list[float]:
    fn()  # warm-up (communicators, allocator)
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        dist.barrier(group=group)
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        dist.barrier(group=group)
        times.append(time.perf_counter() - t0)
    return times


def _rank_main(rank: int, world_size: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    from transformers import AutoConfig

    from ckpt_engine.benchmark.presets import load_preset_config
    from ckpt_engine.trainer.engines.common import hf_model_from_config

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    timeout = datetime.timedelta(seconds=args.timeout_s)
    store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False, timeout=timeout)
    dist.init_process_group("nccl", store=store, rank=rank, world_size=world_size, timeout=timeout)
    group = dist.group.WORLD
    assert group is not None
    raw_cfg = dict(load_preset_config(args.preset))
    raw_cfg["tie_word_embeddings"] = False
    hf_config = AutoConfig.for_model(**raw_cfg)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    engine: Any
    if args.engine == "fsdp2":
        from ckpt_engine.trainer.engines.fsdp2 import FSDP2Config, FSDP2TrainEngine

        with torch.device(device):
            model = hf_model_from_config(hf_config, torch.float32)
        fcfg = FSDP2Config(wire_dtype="bfloat16", param_dtype="bfloat16", reduce_dtype="bfloat16", lr=1e-6)
        engine = FSDP2TrainEngine(model, config=fcfg, process_group=group)
    else:
        from ckpt_engine.trainer.engines.megatron_fsdp2 import MegatronFSDP2Config, MegatronFSDP2TrainEngine

        with torch.device(device):
            model = hf_model_from_config(hf_config, torch.bfloat16)
        mcfg = MegatronFSDP2Config(wire_dtype="bfloat16", main_params_dtype="float32", lr=1e-6)
        engine = MegatronFSDP2TrainEngine(model, config=mcfg, process_group=group)
    build_s = time.perf_counter() - t0
    specs = engine.source.metadata()
    total_bytes = sum(s.nbytes for s in specs)

    def export() -> None:
        for _name, _t in engine.source.iter_weights():
            pass

    buf = torch.empty(min(total_bytes, MESSAGE_BYTES), dtype=torch.uint8, device=device)

    def raw() -> None:
        left = total_bytes
        while left > 0:
            n = min(left, buf.numel())
            dist.broadcast(buf[:n], src=dist.get_global_rank(group, 0), group=group)
            left -= n

    result: dict[str, Any] = {"build_s": build_s}
    for key, fn in (("export_s", export), ("raw_broadcast_s", raw)):
        times = _timed(fn, group, args.repeats)
        result[key] = statistics.median(times)
        result[key + "_all"] = times
    result.update(
        bytes=total_bytes, tensors=len(specs), units=len(engine.source.units), world_size=world_size, dtype="bfloat16",
        ratio_export_over_raw=result["export_s"] / result["raw_broadcast_s"],
        raw_gbps=total_bytes / result["raw_broadcast_s"] / 1e9, export_gbps=total_bytes / result["export_s"] / 1e9,
        device=torch.cuda.get_device_name(device), torch=torch.__version__, engine=args.engine,
    )
    if args.train_steps:
        ids = torch.randint(0, hf_config.vocab_size, (1, args.seq), device=device, generator=torch.Generator(device).manual_seed(rank))

        def loss_fn(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
            x = batch["input_ids"]
            return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), x[:, 1:].reshape(-1))

        def step() -> None:
            engine.forward_backward({"input_ids": ids}, loss_fn)
            engine.optimizer_step()

        times = _timed(step, group, args.train_steps)
        result.update(train_step_s=statistics.median(times), train_step_s_all=times, train_seq=args.seq,
                      peak_mem_gb=torch.cuda.max_memory_allocated(device) / 1e9)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(result, f, indent=2)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", required=True, help="a preset name (qwen2.5-7b, tiny) or a path to a HF config.json")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--train-steps", type=int, default=0, help="also time this many training steps (after one warm-up)")
    p.add_argument("--seq", type=int, default=1024, help="tokens per rank in a timed training step")
    p.add_argument("--engine", choices=["megatron_fsdp2", "fsdp2"], default="megatron_fsdp2")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--timeout-s", type=float, default=600.0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if torch.cuda.device_count() < args.world_size:
        logger.error("needs %d CUDA GPUs, found %d (Megatron-FSDP2 runs on CUDA only)", args.world_size, torch.cuda.device_count())
        return 1
    with tempfile.TemporaryDirectory() as tmp:
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
    lines = [
        f"{result['engine']}: {result['tensors']} tensors in {result['units']} units, {result['bytes'] / 1e9:.2f} GB bf16 over "
        f"{result['world_size']} ranks ({result['device']}), built and sharded in {result['build_s']:.1f} s:",
        f"  export (unit gather)   {result['export_s']:.4f} s  ({result['export_gbps']:.1f} GB/s)",
        f"  raw broadcast          {result['raw_broadcast_s']:.4f} s  ({result['raw_gbps']:.1f} GB/s)",
        f"  ratio export/raw       {result['ratio_export_over_raw']:.3f}  (target <= 1.0)",
    ]
    if "train_step_s" in result:
        lines.append(f"  training step          {result['train_step_s']:.3f} s  ({result['train_seq']} tokens/rank, "
                     f"peak {result['peak_mem_gb']:.1f} GB)")
    sys.stdout.write("\n".join(lines) + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
